"""`python -m bench.tpu_check`: the old name of the TPU run, which notes
and issues written before bench/ had subpackages give; it runs
bench/on_device/tpu_check.py, `python -m bench.on_device.tpu_check`."""

import runpy

if __name__ == "__main__":
  runpy.run_module("bench.on_device.tpu_check", run_name="__main__")
