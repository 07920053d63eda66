"""pytest: leave out the template backend folders.

conformance/example_backend/ and conformance/example_kernel_backend/ are
folders to copy, not registered backends: their conformance_test.py names
a backend ("example", "example_kernel") that this repository does not
register, so its tests would fail here. example_backend_test.py and
example_kernel_backend_test.py copy them, register them and run their suite.
"""

collect_ignore = ["example_backend", "example_kernel_backend"]
