"""ExpertParallelSuite: the layer on a device mesh equals the layer on one.

Needs 8 devices (`--xla_force_host_platform_device_count=8` on CPU, set
before jax is imported); skips with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import ClassVar

from absl.testing import parameterized
import jax
import numpy as np

from conformance import base
from conformance import cases
from conformance import tolerances
import moe_core
from moe_core import parallel

NUM_DEVICES = 8


@dataclasses.dataclass(frozen=True)
class MeshCase:
  """A mesh over the first prod(shape) devices, tokens over data x expert."""

  name: str
  shape: tuple[int, ...]
  axis_names: tuple[str, ...]

  @property
  def data_axes(self) -> tuple[str, ...]:
    return tuple(a for a in self.axis_names if a != "expert")

  def build(self) -> jax.sharding.Mesh:
    devices = jax.devices()[: math.prod(self.shape)]
    return jax.sharding.Mesh(
        np.array(devices).reshape(self.shape), self.axis_names
    )


MESHES = (
    MeshCase("ep2", (2,), ("expert",)),
    MeshCase("ep4", (4,), ("expert",)),
    MeshCase("ep8", (8,), ("expert",)),
    MeshCase("data2_ep4", (2, 4), ("data", "expert")),
)
_MESH = {m.name: m for m in MESHES}


def _pick(what: str, predicate) -> cases.LayerCase:
  """The first layer case with `predicate`; picked by property, not name.

  Every EP case must differentiate, split over 8 token shards and (for
  ep = 8) over 8 expert shards.
  """
  for case in cases.LAYER_CASES + cases.ROUTING_VARIANTS + cases.FFN_VARIANTS:
    if (
        case.grads
        and case.num_tokens % NUM_DEVICES == 0
        and case.cfg.num_experts % NUM_DEVICES == 0
        and predicate(case)
    ):
      return case
  raise LookupError(
      f"conformance/cases.py has no layer case for the EP "
      f"suite's {what} (grads, tokens and experts divisible by "
      f"{NUM_DEVICES})."
  )


_BASE = _pick(
    "float32 case with a gated shared expert",
    lambda c: (
        c.dtype == "float32"
        and c.cfg.shared_expert_gate
        and c.hot_expert is None
        and not c.cold_experts
    ),
)
_BF16 = _pick(
    "bfloat16 case",
    lambda c: (
        c.dtype == "bfloat16" and c.hot_expert is None and not c.cold_experts
    ),
)
_COLD = _pick("experts without tokens", lambda c: bool(c.cold_experts))
# Every token's best expert is the hot one: with top_k=1 every copy goes to
# the device holding it (the worst imbalance), which must take them all.
_HOT = _pick(
    "one expert takes all",
    lambda c: (c.hot_expert is not None and c.cfg.top_k == 1),
)
_DEEPSEEK = _pick(
    "DeepSeek-V3 router",
    lambda c: (
        c.cfg.group_score == "sum_top2"
        and c.cfg.correction_bias
        and c.cfg.n_group > 1
    ),
)

# The expert-FFN switches that touch the exchange: biases split over the
# expert axis with the weights, and copies that travel scaled.
_EXPERT_BIAS = _pick(
    "float32 case with expert biases",
    lambda c: c.cfg.expert_bias and c.dtype == "float32",
)
_WEIGHTS_ON_INPUT = _pick(
    "routing weights on the input", lambda c: c.cfg.routing_weights_on_input
)
# The router's learned extras (replicated like the router): an input norm
# scale and per-expert output scales.
_ROUTER_PARAMS = _pick(
    "router input norm and expert output scale",
    lambda c: c.cfg.router_input_norm and c.cfg.expert_output_scale,
)
# JetMoE's output bias, replicated and added per device after the combine.
_OUTPUT_BIAS = _pick("output bias", lambda c: c.cfg.output_bias)
_OUTPUT_NORM = _pick("output norm", lambda c: c.cfg.output_norm)
# Muse Spark's: latent rows travel, each expert's output normed per device.
_LATENT_NORMS = _pick(
    "latent width with its norms",
    lambda c: c.cfg.expert_latent_size > 0 and c.cfg.post_expert_norm,
)

# Zero experts: their copies travel with weight 0, their x is added back.
_ZERO_EXPERTS = _pick(
    "zero experts",
    lambda c: c.cfg.zero_expert_output == "identity"
    and c.cfg.num_zero_experts > 0,
)


def _product(case_list, mesh_names, exchange="padded"):
  return [
      (
          f"{c.name}_{m}" + ("" if exchange == "padded" else f"_{exchange}"),
          c,
          _MESH[m],
          exchange,
      )
      for c in case_list
      for m in mesh_names
  ]


_ALL_MESHES = [m.name for m in MESHES]
# Kept small: each entry is one compile of the layer and its gradients.
EP_CASES = (
    _product((_BASE, _COLD, _HOT), _ALL_MESHES)
    + _product((_BF16, _DEEPSEEK), ("ep8", "data2_ep4"))
    + _product(
        (_ROUTER_PARAMS, _ZERO_EXPERTS, _OUTPUT_BIAS, _OUTPUT_NORM),
        ("ep8",),
    )
    # The ragged layout (ragged_all_to_all on GPU/TPU) through its all_gather
    # emulation, which runs anywhere.
    + _product((_BASE,), ("ep8",), "ragged_emulated")
    + _product((_HOT,), ("data2_ep4",), "ragged_emulated")
    + _product((_EXPERT_BIAS, _WEIGHTS_ON_INPUT), ("data2_ep4",))
    + _product((_LATENT_NORMS,), ("data2_ep4",))
)


class ExpertParallelSuite(base.BackendTestCase):
  """moe_layer(..., mesh=...) against the same backend on one device."""

  BACKEND: ClassVar[str]
  BACKEND_OPTIONS: ClassVar[dict] = {}

  def setUp(self):
    super().setUp()
    if jax.device_count() < NUM_DEVICES:
      self.skipTest(
          f"expert-parallel suite needs {NUM_DEVICES} devices, found "
          f"{jax.device_count()}: set XLA_FLAGS=--xla_force_host_platform_"
          f"device_count={NUM_DEVICES} before jax is imported."
      )

  def run_ep(
      self, case: cases.LayerCase, mesh_case: MeshCase, exchange: str
  ) -> base.LayerResult:
    self.skip_unless_computes(case.dtype)
    params, x, _ = cases.layer_inputs(case)
    fn = jax.jit(
        base.layer_fn(
            self.backend,
            case,
            grads=True,
            mesh=mesh_case.build(),
            data_axes=mesh_case.data_axes,
            ep_options=parallel.EPOptions(exchange=exchange),
        )
    )
    y, aux, grads = fn(params, x)
    return base.LayerResult(
        y=np.asarray(y),
        aux={
            f.name: np.asarray(getattr(aux, f.name))
            for f in dataclasses.fields(aux)
        },
        grads={n: np.asarray(g) for n, g in grads.items()},
        rerun=lambda: fn(params, x)[::2],
    )

  @parameterized.named_parameters(*EP_CASES)
  def test_matches_single_device(self, case, mesh_case, exchange):
    got = self.run_ep(case, mesh_case, exchange)
    want = self.run_layer(case, jit=True)  # Same backend, one device.
    msg = f"{mesh_case.name} vs one device"
    with self.subTest("y"):
      self.assertEqual(got.y.shape, want.y.shape)
      self.assertEqual(got.y.dtype, want.y.dtype)
      self.assertClose(got.y, want.y, case.dtype, msg=f"y, {msg}")
    # Routing runs in float32 whatever the activations' dtype.
    routing_tol = tolerances.routing()
    for name, value in want.aux.items():
      with self.subTest(f"aux.{name}"):
        self.assertEqual(got.aux[name].shape, value.shape, f"aux.{name}")
        self.assertEqual(got.aux[name].dtype, value.dtype, f"aux.{name}")
        if np.issubdtype(value.dtype, np.floating):
          problem = tolerances.violation(got.aux[name], value, routing_tol)
          self.assertIsNone(problem, f"aux.{name}, {msg}: {problem}")
        else:
          np.testing.assert_array_equal(
              got.aux[name], value, f"aux.{name}, {msg}"
          )
    for name in sorted(want.grads):
      with self.subTest(f"d {name}"):
        self.assertEqual(got.grads[name].dtype, want.grads[name].dtype)
        self.assertClose(
            got.grads[name],
            want.grads[name],
            case.dtype,
            "gradient",
            msg=f"d {name}, {msg}",
        )
    self.assertEqual(int(got.aux["dropped_tokens"]), 0, "dropless")
    self.assertEqual(
        int(got.aux["tokens_per_expert"].sum()),
        case.num_tokens * case.cfg.top_k,
    )

  @parameterized.named_parameters(("ep8", "ep8"), ("data2_ep4", "data2_ep4"))
  def test_experts_without_tokens_get_exactly_zero_gradient(self, mesh_name):
    got = self.run_ep(_COLD, _MESH[mesh_name], "padded")
    self.assertAllZero(
        got.aux["tokens_per_expert"][list(_COLD.cold_experts)],
        msg="tokens of the cold experts",
    )
    for name in ("w_gate", "w_up", "w_down"):
      for e in _COLD.cold_experts:
        self.assertAllZero(
            got.grads[name][e], msg=f"d {name} of expert {e} (no tokens)"
        )

  def test_all_tokens_on_one_device_are_all_computed(self):
    # One device of 8 holds the hot expert and receives every copy; none is
    # lost.
    got = self.run_ep(_HOT, _MESH["ep8"], "padded")
    self.assertEqual(
        int(got.aux["tokens_per_expert"][_HOT.hot_expert]), _HOT.num_tokens
    )
    self.assertTrue(np.all(got.aux["kept"]))
    self.assertMatchesPerTokenMath(_HOT, got)

  # --- What a user gets wrong, said once and first -------------------------

  def _hot_layer(self, **options):
    """(f(params, x) -> (y, aux) on ep8, params, x) for the hot-expert case:
    every copy goes to one device."""
    case = _HOT
    self.skip_unless_computes(case.dtype)
    params, x, _ = cases.layer_inputs(case)
    mesh = _MESH["ep8"].build()

    def layer(params, x):
      return moe_core.moe_layer(
          params,
          x,
          case.cfg,
          backend=self.backend,
          mesh=mesh,
          data_axes=(),
          ep_options=parallel.EPOptions(**options),
      )

    return layer, params, x

  def test_exchange_refuses_a_platform_it_cannot_run_on(self):
    platform = jax.devices()[0].platform
    if platform in parallel.RAGGED_PLATFORMS:
      self.skipTest(f"the ragged exchange runs on {platform!r}")
    layer, params, x = self._hot_layer(exchange="ragged")
    message = (
        f"exchange 'ragged' cannot run on platform '{platform}': it needs "
        "jax.lax.ragged_all_to_all, which XLA implements on gpu and tpu "
        f"only. On '{platform}' use exchange='padded'"
    )
    for name, fn in (("eager", layer), ("jit", jax.jit(layer))):
      with (
          self.subTest(name),
          self.assertRaisesRegex(NotImplementedError, message),
      ):
        jax.block_until_ready(fn(params, x))

  def test_overflow_error_says_the_message_once(self):
    # Each of 8 devices holds 2 tokens and may send the hot expert's device
    # ceil(2 * 2 tokens / 8) = 1 of them: 8 of the 16 copies do not fit.
    layer, params, x = self._hot_layer(buffer_factor=2.0, overflow="error")
    message = (
        "expert-parallel receive buffer overflow: 8 token copies did not "
        "fit the bounded buffer (buffer_factor=2.0, 1 slots per peer, "
        "exchange='padded')"
    )
    callback_log = logging.getLogger("jax._src.callback")
    with self.subTest("eager"):
      # On concrete arrays: the library's error itself, from Python.
      with self.assertNoLogs(callback_log, logging.ERROR):
        with self.assertRaises(RuntimeError) as raised:
          layer(params, x)
      self.assertIsInstance(raised.exception, parallel.BufferOverflowError)
      self.assertTrue(str(raised.exception).startswith(message))
    with self.subTest("jit"):
      # Traced: a host callback raises on every device; JAX wraps its error
      # (docs/expert_parallel.md) and logs nothing more of it.
      with self.assertNoLogs(callback_log, logging.ERROR):
        with self.assertRaises(Exception) as raised:
          jax.block_until_ready(jax.jit(layer)(params, x))
        # A program with effects leaves JAX a token of the failed run,
        # which would raise the error once more at exit: take it now.
        with contextlib.suppress(Exception):
          jax.effects_barrier()
      self.assertEqual(str(raised.exception).count(message), 1)
