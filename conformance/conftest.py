"""pytest: leave out the template backend folder.

conformance/example_backend/ is a folder to copy, not a registered backend:
its conformance_test.py names a backend ("example") that this repository
does not register, so its tests would fail here. example_backend_test.py
copies it, registers it and runs its suite.
"""

collect_ignore = ["example_backend"]
