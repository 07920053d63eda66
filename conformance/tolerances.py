"""The conformance tolerances: one (atol, rtol) table by dtype."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

# A comparison passes when, element by element,
#
#     |actual - expected| <= atol * max|expected| + rtol * |expected|
#
# `atol` is relative to the largest magnitude of the expected tensor, so a
# sum over a large D that cancels to a small value is judged against the size
# of its terms, not against that small value. An expected tensor that is all
# zeros must be matched exactly.
#
# The oracle (the reference backend, or float64 numpy) works in float32 or
# better from the same inputs, so the error budget is the backend's own
# rounding. With u the unit roundoff of the dtype (2^-p for p significant
# bits):
#
# * bfloat16, p = 8, u = 2^-8 ~ 3.9e-3. A backend may round each intermediate
#   to bfloat16 (the gate and up projections, act(gate) * up, each expert's
#   output, and y), each a relative error of at most u; through the layer that
#   is about 5u of the summands' size, and we allow 6u. The backward pass
#   rounds about twice as many tensors (the cotangent, its products with each
#   weight, and the recomputed activations), so gradients get 12u. rtol is 2u:
#   the final rounding of a value plus one intermediate.
# * float32, p = 24, u ~ 6e-8. Backends differ from the reference only in the
#   order of float32 sums; for sums of n <= 512 terms the worst case is about
#   n * u ~ 3e-5 of the summands' size and the typical error is sqrt(n) * u.
#   We allow 2e-5 (forward) and 5e-5 (gradients, two GEMMs deep).
# * tfloat32: XLA's default precision for float32 dots on NVIDIA GPUs rounds
#   the inputs to TF32 (p = 11, u = 2^-11 ~ 4.9e-4) and accumulates in float32
#   (docs.jax.dev, "Matmul precision"). float32 comparisons on a GPU use this
#   row. On a TPU the default is one bfloat16 pass: the bfloat16 row.
# Measured on the CPU (jax 0.10.2), the xla backend's worst case uses about a
# fifth of the bfloat16 budgets and a hundredth of the float32 ones.
#
# A backend loosens only in its test subclass, with the reason:
# `TOLERANCE_OVERRIDES = {"bfloat16": (4e-2, 2e-2)}  # split-K` (both kinds),
# or `{"bfloat16": {"gradient": (4e-2, 2e-2)}}` (one kind).

KINDS = ("forward", "gradient")


class Tolerance(NamedTuple):
  atol: float  # Times max|expected|.
  rtol: float  # Times |expected|, element by element.


_U_BF16 = 2.0**-8
_U_TF32 = 2.0**-11

TABLE: dict[str, dict[str, Tolerance]] = {
    "float32": {
        "forward": Tolerance(atol=2e-5, rtol=1e-5),
        "gradient": Tolerance(atol=5e-5, rtol=1e-5),
    },
    "bfloat16": {
        "forward": Tolerance(atol=6 * _U_BF16, rtol=2 * _U_BF16),
        "gradient": Tolerance(atol=12 * _U_BF16, rtol=2 * _U_BF16),
    },
    "tfloat32": {
        "forward": Tolerance(atol=6 * _U_TF32, rtol=2 * _U_TF32),
        "gradient": Tolerance(atol=12 * _U_TF32, rtol=2 * _U_TF32),
    },
}

# What float32 dots default to, per platform (see the module docstring).
_FLOAT32_ROW = {
    "cpu": "float32",
    "gpu": "tfloat32",
    "cuda": "tfloat32",
    "rocm": "tfloat32",
    "tpu": "bfloat16",
}


def row_for(dtype, platform: str | None = None) -> str:
  """The TABLE row for a comparison of `dtype` values on `platform`."""
  name = np.dtype(dtype).name
  if name not in ("float32", "bfloat16"):
    raise ValueError(f"dtype must be float32 or bfloat16, got {name}.")
  if name == "float32":
    return _FLOAT32_ROW.get(platform or jax.default_backend(), "float32")
  return name


def lookup(
    dtype, kind: str, overrides: dict | None = None, platform: str | None = None
) -> Tolerance:
  """The tolerance of `kind` ("forward" or "gradient") for `dtype`.

  Args:
    dtype: the dtype the backend computed in (the inputs' dtype).
    kind: "forward" or "gradient".
    overrides: a backend's TOLERANCE_OVERRIDES, keyed by dtype name or by
      TABLE row ("tfloat32"): a (atol, rtol) pair for both kinds, or a dict
      kind -> (atol, rtol).
    platform: jax platform; jax.default_backend() by default.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  row = row_for(dtype, platform)
  tol = TABLE[row][kind]
  for key in (np.dtype(dtype).name, row):
    override = (overrides or {}).get(key)
    if isinstance(override, dict):
      override = override.get(kind)
    if override is not None:
      tol = Tolerance(*override)
  return tol


def violation(actual, expected, tol: Tolerance) -> str | None:
  """None if `actual` is within `tol` of `expected`, else what is wrong."""
  actual = np.asarray(actual).astype(np.float64)
  expected = np.asarray(expected).astype(np.float64)
  if actual.shape != expected.shape:
    return f"shape {actual.shape} != expected {expected.shape}"
  if not np.all(np.isfinite(actual)):
    bad = np.argwhere(~np.isfinite(actual))[0]
    return (
        f"{np.sum(~np.isfinite(actual))} non-finite values, first at "
        f"{tuple(bad)}"
    )
  if actual.size == 0:
    return None
  scale = np.max(np.abs(expected))
  err = np.abs(actual - expected)
  allowed = tol.atol * scale + tol.rtol * np.abs(expected)
  if np.all(err <= allowed):
    return None
  worst = np.unravel_index(np.argmax(err - allowed), err.shape)
  return (
      f"{np.sum(err > allowed)} of {err.size} values off; worst at "
      f"{tuple(int(i) for i in worst)}: actual {actual[worst]:.6g}, "
      f"expected {expected[worst]:.6g}; max|err| / max|expected| = "
      f"{np.max(err) / scale if scale else np.inf:.3g} "
      f"(atol={tol.atol:.3g}, rtol={tol.rtol:.3g})"
  )
