"""`python -m bench.gpu_check`: the old name of the GPU run, which notes
and issues written before bench/ had subpackages give; it runs
bench/on_device/gpu_check.py, `python -m bench.on_device.gpu_check`."""

import runpy

if __name__ == "__main__":
  runpy.run_module("bench.on_device.gpu_check", run_name="__main__")
