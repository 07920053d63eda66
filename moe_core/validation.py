"""Input checks shared by every stage; errors name the argument, want, got."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_core import config as config_lib
from moe_core import params as params_lib

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _dtype_name(x) -> str:
  return np.dtype(x.dtype).name


def check_config(cfg) -> None:
  if not isinstance(cfg, config_lib.MoEConfig):
    raise TypeError(f"cfg must be a moe_core.MoEConfig, got {type(cfg)}.")


def check_tokens(x, cfg: config_lib.MoEConfig, *, name: str = "x") -> None:
  """x: [..., D] floating activations with at least one token."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x)}.")
  if x.ndim < 1 or x.shape[-1] != cfg.hidden_size:
    raise ValueError(
        f"{name} must have shape [..., hidden_size={cfg.hidden_size}], got "
        f"{name}.shape={tuple(x.shape)}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be floating point, got dtype "
                    f"{_dtype_name(x)}.")
  if x.size == 0:
    raise ValueError(f"{name} must hold at least one token, got "
                     f"{name}.shape={tuple(x.shape)}.")


def check_params(params, cfg: config_lib.MoEConfig) -> None:
  """Every parameter `cfg` needs is present with its exact shape."""
  if not isinstance(params, dict):
    raise TypeError(f"params must be a dict of arrays, got {type(params)}.")
  expected = params_lib.param_shapes(cfg)
  missing = sorted(set(expected) - set(params))
  if missing:
    raise ValueError(f"params is missing {missing} for this config; expected "
                     f"keys {sorted(expected)}, got {sorted(params)}.")
  for name, shape in expected.items():
    got = tuple(getattr(params[name], "shape", ()))
    if got != shape:
      raise ValueError(f"params[{name!r}] must have shape {shape}, got {got}.")
    if not jnp.issubdtype(params[name].dtype, jnp.floating):
      raise TypeError(f"params[{name!r}] must be floating point, got dtype "
                      f"{_dtype_name(params[name])}.")
  extra = sorted(set(params) - set(expected))
  if extra:
    # A stray correction_bias or shared expert would be silently ignored.
    raise ValueError(f"params has keys {extra} that this config does not use "
                     f"(expected {sorted(expected)}); check correction_bias / "
                     "shared_ffn_size / shared_expert_gate.")


def check_group_sizes(group_sizes, num_groups: int, *,
                      name: str = "group_sizes") -> None:
  if not hasattr(group_sizes, "dtype"):
    raise TypeError(f"{name} must be an int32 array, got {type(group_sizes)}.")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer (int32) array, got dtype "
                    f"{_dtype_name(group_sizes)}.")
  if group_sizes.shape != (num_groups,):
    raise ValueError(f"{name} must have shape ({num_groups},) (one size per "
                     f"group), got {name}.shape={tuple(group_sizes.shape)}.")


def check_grouped_gemm(rows, weights, group_sizes, *,
                       transpose_rhs: bool = False) -> None:
  """rows [M, K], weights [E, K, N] ([E, N, K] if transposed), sizes [E]."""
  for name, arr in (("rows", rows), ("weights", weights)):
    if not hasattr(arr, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(arr)}.")
    if not jnp.issubdtype(arr.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point, got dtype "
                      f"{_dtype_name(arr)}.")
  if rows.ndim != 2:
    raise ValueError(f"rows must be 2-D [M, K], got rows.shape={rows.shape}.")
  if weights.ndim != 3:
    raise ValueError("weights must be 3-D [E, K, N], got "
                     f"weights.shape={weights.shape}.")
  k_axis = 2 if transpose_rhs else 1
  if weights.shape[k_axis] != rows.shape[1]:
    layout = "[E, N, K]" if transpose_rhs else "[E, K, N]"
    raise ValueError(
        f"weights {layout} must contract over rows' K={rows.shape[1]}, got "
        f"rows.shape={rows.shape}, weights.shape={weights.shape}.")
  check_group_sizes(group_sizes, weights.shape[0])


def check_routing(expert_ids, combine_weights, num_tokens: int,
                  cfg: config_lib.MoEConfig) -> None:
  want = (num_tokens, cfg.top_k)
  if tuple(expert_ids.shape) != want:
    raise ValueError(f"expert_ids must have shape [T, K]={want}, got "
                     f"{tuple(expert_ids.shape)}.")
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise TypeError(f"expert_ids must be int32, got {_dtype_name(expert_ids)}.")
  if tuple(combine_weights.shape) != want:
    raise ValueError(f"combine_weights must have shape [T, K]={want}, got "
                     f"{tuple(combine_weights.shape)}.")


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)
