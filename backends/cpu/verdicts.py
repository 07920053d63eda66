"""Which kernel sets beat the xla backend, per dtype: the data "auto" reads.

The rule is measured data, not a timing taken at import: `auto` picks the
cpu backend only where the kernel set the library runs on this CPU beat the
xla backend for every dtype it serves. "Beat" is one number per run of
`bench/micro/grouped_gemm_bench.py --backends=dense,cpu,xla`: the geometric
mean, over its cases (E in {8, 64} x even / random / Zipf groups) and both
phases (forward, forward+backward), of the cpu time over xla's time in
the same process, below 1. Each verdict names that run's JSON under
bench/results/; kernels_test checks the verdict against it. A set that
loses (today `portable`: 1.4-9.3x xla's time on an AVX2 host) still runs
under `--moe_backend=cpu`.
"""

from __future__ import annotations

import dataclasses

# Every kernel set the library picks by cpuid (backends/cpu/cc/gemm.h),
# fastest first, and the operand dtypes of its custom calls.
KERNEL_SETS = ("amx", "avx512-bf16", "avx512", "avx2", "portable")
DTYPES = ("float32", "bfloat16")
# Sets no run has measured, so they have no verdict and "auto" passes the
# cpu backend over where one runs: `amx` (bfloat16 on AMX tiles, float32
# as `avx512-bf16`), because none of this project's machines has AMX; its
# numerics are tested by `amx-emulated`, its speed is unknown.
UNMEASURED = ("amx",)
# Sets only a name selects (DROPLESS_CPU_KERNELS, library.use_kernels),
# never cpuid: `amx-emulated` runs amx's packing and blocking on a scalar
# C++ emulation of the tile unit, on any CPU, to test them where no AMX
# is. Slow by design: never a verdict, so "auto" never picks the cpu
# backend while it runs.
TEST_KERNEL_SETS = ("amx-emulated",)


@dataclasses.dataclass(frozen=True)
class Verdict:
  """One kernel set's grouped GEMM against the xla backend's, one dtype.

  Attributes:
    beats_xla: the geometric mean of its time over xla's, over the run's
      cases and phases, was below 1.
    evidence: that run's JSON, under bench/results/ (its `cpu_kernels` and
      `dtype` name this set and dtype).
    host: the CPU it was measured on.
  """

  beats_xla: bool
  evidence: str
  host: str


_EPYC_BF16 = "AMD EPYC with AVX-512 and AVX512_BF16, 2 cores"
_XEON_AVX512 = "Intel Xeon with AVX-512, no AVX512_BF16 or AMX, 2 cores"
# The lent TPU v5e's host CPU (AVX2 + FMA, no AVX-512), the issue's
# machine kind; pinned to 2 of its 13 cores (taskset -c 0,1), jax 0.10.2.
_AVX2_HOST = "x86-64 with AVX2 + FMA, no AVX-512 (TPU v5e host), 2 cores"

# (kernel set, dtype) -> Verdict; each from one run's JSON,
# bench/results/grouped_gemm_cpu_<stamp>.json.
VERDICTS: dict[tuple[str, str], Verdict] = {
    (kernels, dtype): Verdict(beats, f"grouped_gemm_cpu_{stamp}.json", host)
    for kernels, dtype, beats, stamp, host in (
        ("avx512-bf16", "float32", True, "20261205_171502", _EPYC_BF16),
        ("avx512-bf16", "bfloat16", True, "20261205_171442", _EPYC_BF16),
        ("avx512", "float32", True, "20261207_021600", _XEON_AVX512),
        ("avx512", "bfloat16", True, "20261207_021426", _XEON_AVX512),
        ("avx2", "float32", True, "20261207_022640", _AVX2_HOST),
        ("avx2", "bfloat16", True, "20261207_022540", _AVX2_HOST),
        ("portable", "float32", False, "20261207_020932", _AVX2_HOST),
        ("portable", "bfloat16", False, "20261207_020741", _AVX2_HOST),
    )
}


def verdict(kernels: str, dtype: str) -> Verdict:
  """The verdict for `kernels` on `dtype` operands (KeyError if none)."""
  return VERDICTS[kernels, dtype]


def auto_choice(kernels: str) -> tuple[bool, str]:
  """(True, "") if "auto" may pick the cpu backend running `kernels`, else
  (False, why): a dtype whose kernels here lost to the xla backend, or that
  no measurement covers (UNMEASURED, or a set newer than this table), or a
  test-only set."""
  if kernels in TEST_KERNEL_SETS:
    return False, (
        f"cpu: its {kernels!r} kernels are a test-only emulation "
        "(DROPLESS_CPU_KERNELS), so 'auto' passes it over; "
        "--moe_backend=cpu still runs them."
    )
  unmeasured = [d for d in DTYPES if (kernels, d) not in VERDICTS]
  if unmeasured:
    return False, (
        f"cpu: no measured verdict for its {kernels!r} kernels "
        f"({', '.join(unmeasured)}; backends/cpu/verdicts.py), so 'auto' "
        "passes it over; --moe_backend=cpu still runs them."
    )
  losing = [d for d in DTYPES if not verdict(kernels, d).beats_xla]
  if not losing:
    return True, ""
  files = ", ".join(verdict(kernels, d).evidence for d in losing)
  return False, (
      f"cpu: its {kernels!r} kernels on this CPU lose to xla for "
      f"{' and '.join(losing)} (bench/results/{files}), so 'auto' passes it "
      "over; --moe_backend=cpu still runs them."
  )
