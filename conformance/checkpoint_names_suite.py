"""CheckpointNamesSuite: what the remat policies keep of a backend's FFN.

`moe_core.remat`'s policies pick the saved residuals by the checkpoint
names of the expert GEMM outputs (`moe_core.backend.CHECKPOINT_NAMES`); a
backend that forgets a name changes what "save_moe" keeps without any
numerical difference, so no other suite would notice. Here the residuals
a backward pass saves are listed with
`jax.ad_checkpoint.print_saved_residuals` and compared with what the
backend documents through `Backend.checkpoint_names`; the checks only
trace (nothing is compiled or run), on small shapes.
"""

from __future__ import annotations

import contextlib
import io
import re

from absl.testing import parameterized
import jax
import jax.numpy as jnp

import moe_core
from conformance import base
from conformance import cases
from moe_core import backend as backend_lib
from moe_core import remat

# print_saved_residuals' lines read "<aval> named '<name>' from ...",
# "... from the argument ...", "... from a constant", alike on jax 0.10 to
# 0.12.
_NAMED = re.compile(r" named '([^']+)'")
# Residuals no policy decides on: the differentiated function's inputs and
# the values it closes over.
_INPUT = re.compile(r" from (the argument|a constant)")
_HOST = "<host>"


def _saved_residuals(test, fn, *args) -> list[str]:
  """One line per residual the backward pass of fn(*args) -> scalar saves.

  Skips `test` where this jax cannot list them.
  """
  if not hasattr(jax.ad_checkpoint, "print_saved_residuals"):
    test.skipTest(
        "jax.ad_checkpoint.print_saved_residuals is missing in jax "
        f"{jax.__version__}."
    )
  buffer = io.StringIO()
  try:
    with contextlib.redirect_stdout(buffer):
      jax.ad_checkpoint.print_saved_residuals(fn, *args)
  except NotImplementedError as e:
    # An interpreted kernel (Mosaic GPU's interpreter) is an ordered
    # io_callback, which jax.checkpoint cannot differentiate; compiled
    # kernels are custom calls and never get here.
    if "Effects not supported in AD of `checkpoint`" not in str(e):
      raise
    test.skipTest(f"{test.BACKEND} with {test.BACKEND_OPTIONS}: {e}")
  return [line for line in buffer.getvalue().splitlines() if line.strip()]


def _names(residuals: list[str]) -> list[str]:
  """The checkpoint names among the residuals, sorted (repeats kept)."""
  return sorted(m.group(1) for r in residuals if (m := _NAMED.search(r)))


def _computed(residuals: list[str]) -> list[str]:
  """The residuals that are neither inputs nor constants."""
  return [r for r in residuals if not _INPUT.search(r)]


class CheckpointNamesSuite(base.BackendTestCase):
  """The expert FFN's outputs carry their names under every remat policy."""

  def _checkpointed_ffn_residuals(
      self, policy: str, activation: str
  ) -> list[str]:
    """Residuals of expert_ffn under jax.checkpoint(policy=policy).

    The output is squared inside the checkpointed function, so that the
    backward needs the down projection's output too (a loss linear in it
    would not): with "save_moe", every named output is then a residual.
    """
    cfg = cases.FFN_CFG.replace(activation=activation)
    rows, group_sizes, params, cotangent = cases.ffn_inputs(
        self.compute_dtype(), cfg
    )
    # Tracing only; finite rows keep the jaxpr free of NaN constants.
    rows = jnp.nan_to_num(rows)

    def block(rows, params):
      out = self.backend.expert_ffn(rows, group_sizes, params, cfg)
      return out * out

    def loss(rows, params):
      remat_block = jax.checkpoint(block, policy=remat.policy(policy))
      return jnp.sum(remat_block(rows, params) * cotangent)

    return _saved_residuals(self, loss, rows, params)

  def _documented_names(self, activation: str) -> list[str]:
    names = self.backend.checkpoint_names(activation)
    self.assertLessEqual(
        set(names),
        set(remat.MOE_NAMES),
        "checkpoint_names lists a name the remat policies do not know",
    )
    self.assertIn(
        backend_lib.DOWN_NAME,
        names,
        "every expert FFN, fused or not, names its down projection",
    )
    return sorted(names)

  # "silu" runs in the pallas epilogue when fuse_activation is set; the exact
  # "gelu" never does, so it covers the unfused path of such a backend;
  # "relu2" has no gate GEMM, so no moe_gate name.
  @parameterized.parameters("silu", "gelu", "relu2")
  def test_save_moe_saves_exactly_the_named_outputs(self, activation):
    saved = self._checkpointed_ffn_residuals("save_moe", activation)
    self.assertEqual(
        _names(saved),
        self._documented_names(activation),
        f"{self.BACKEND}: names saved by save_moe:\n" + "\n".join(saved),
    )
    unnamed = [r for r in _computed(saved) if not _NAMED.search(r)]
    self.assertEqual(
        unnamed,
        [],
        f"{self.BACKEND}: save_moe saved outputs that carry no name",
    )

  @parameterized.parameters("full", "recompute_moe")
  def test_other_policies_save_no_expert_output(self, policy):
    saved = self._checkpointed_ffn_residuals(policy, "silu")
    self.assertEqual(
        _names(saved),
        [],
        f"{self.BACKEND}: {policy} saved named outputs:\n" + "\n".join(saved),
    )
    if policy == "full":
      self.assertEqual(
          _computed(saved), [], f"{self.BACKEND}: full saved computed values"
      )

  def test_offload_moe_moves_each_named_output_to_host(self):
    saved = self._checkpointed_ffn_residuals("offload_moe", "silu")
    on_host = [r for r in _computed(saved) if _HOST in r]
    self.assertLen(
        on_host,
        len(self._documented_names("silu")),
        f"{self.BACKEND}: offload_moe residuals:\n" + "\n".join(saved),
    )
    self.assertEqual(
        [r for r in _computed(saved) if _HOST not in r],
        [],
        f"{self.BACKEND}: offload_moe kept outputs on the device",
    )

  def test_moe_layer_under_save_moe_saves_the_expert_names(self):
    overrides = type(self.backend)._routed_experts
    if overrides is not backend_lib.Backend._routed_experts:
      self.skipTest(
          f"{self.BACKEND} overrides _routed_experts, which need not call "
          "expert_ffn (the reference runs every expert densely and names "
          "nothing: save_moe then recomputes as full does); its expert_ffn "
          "is checked by the other tests here."
      )
    case = cases.LAYER_BY_NAME[
        "base_f32" if self.compute_dtype() == "float32" else "base_bf16"
    ]
    expected = self._documented_names(case.cfg.activation)
    if self.backend._routing_weights_in_down(case.cfg, case.dtype):
      # The down GEMM's output is then no residual of the layer (combine's
      # weights are ones): save_moe keeps the other names.
      expected.remove(backend_lib.DOWN_NAME)
    params, x, cotangent = cases.layer_inputs(case)

    def loss(params, x):
      layer = jax.checkpoint(
          lambda p, x: moe_core.moe_layer(p, x, case.cfg, self.backend)[0],
          policy=remat.policy("save_moe"),
      )
      return jnp.sum(layer(params, x) * cotangent)

    saved = _saved_residuals(self, loss, params, x)
    self.assertEqual(
        _names(saved),
        expected,
        f"{self.BACKEND}: layer residuals under save_moe:\n" + "\n".join(saved),
    )
    self.assertEqual(
        [r for r in _computed(saved) if not _NAMED.search(r)],
        [],
        f"{self.BACKEND}: save_moe saved unnamed layer values",
    )
