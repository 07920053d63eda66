"""The te backend's MoE layer lowered for CUDA on a CPU, through jax.export.

TE's primitives have CUDA lowerings only, but `jax.export(platforms=
["cuda"])` produces them anywhere once TE believes in a GPU of some compute
capability (`_te.compute_capability`). For sm_90 and sm_100 this exports
`moe_core.moe_layer(..., backend="te")` forward, under `jax.grad`, and
inside the transformations users wrap around it (`jax.jvp`, `jax.hessian`
of a small loss, `jax.vmap`, a `jax.shard_map` with check_vma=True), and
reads the StableHLO text: which TE custom calls it holds (and nothing
else: no Triton kernel, no XLA dot or ragged_dot standing in for an expert
GEMM), and the operand shapes and dtypes of each grouped GEMM, checked
against what TE's FFI takes (transformer_engine/jax/cpp_extensions/
gemm.py, `GroupedGemmPrimitive`):

  te_grouped_gemm_ffi     lhs, lhs_scale_inv, rhs, rhs_scale_inv, bias,
                          lhs_first_dims, lhs_last_dims, rhs_first_dims,
                          rhs_last_dims, out_first_dims, out_last_dims,
                          group_offset [1] int32
  te_grouped_gemm_v2_ffi  the same eleven, then alpha and beta float32,
                          [E] on sm_100+ and [1] below

where a *_dims operand is the [E] int32 group sizes along a ragged axis
and [0] where that axis is not ragged. Unquantised operands keep their
shapes; quantised ones are flattened to 1-D. The expected targets come
from TE's rules, not from the code under test: the bf16 grouped GEMM takes
the v2 kernel on sm_90+ when TE's library has cuBLAS's grouped GEMM,
tensor-scaled FP8 never does, MXFP8 only on sm_100+ with row and
contraction sizes that are multiples of 128 (not the case here).

Numerics and XLA:GPU compilation need a GPU (bench/on_device/gpu_check.py);
this is what can be held fixed without one. Runs in the TE environment
(tools/setup_te.sh); elsewhere each test skips with the reason.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import moe_core
from backends.te import _te
from backends.te import gemm as gemm_lib
from backends.testing.te_required import require_te
from moe_core.parallel import options

_T, _E, _K, _D, _F = 32, 8, 2, 64, 128
_M = _T * _K  # Rows of the expert GEMMs: one per token copy.

V1 = "te_grouped_gemm_ffi"
V2 = "te_grouped_gemm_v2_ffi"
ROUTER_FORWARD = "te_fused_topk_with_score_function_forward_ffi"
ROUTER_BACKWARD = "te_fused_topk_with_score_function_backward_ffi"
# TE's fused load-balancing loss: allowed, not required.
AUX_LOSS = (
    "te_fused_moe_aux_loss_forward_ffi",
    "te_fused_moe_aux_loss_backward_ffi",
)
QUANTIZE = ("te_grouped_quantize_ffi", "te_grouped_quantize_v2_ffi")
# The per-group path may copy group sizes to the host ahead of the GEMMs.
D2H = "te_grouped_gemm_d2h_group_sizes_ffi"
# XLA's collective, a custom call in the StableHLO of the ragged exchange.
RAGGED_ALL_TO_ALL = "ragged_all_to_all"

_FLOAT8 = ("f8E4M3FN", "f8E5M2")  # MLIR's float8_e4m3fn, float8_e5m2.
_SCALE_DTYPE = {"fp8_tensor": "f32", "mxfp8": "f8E8M0FNU"}


# --- Reading the StableHLO text ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tensor:
  shape: tuple[int, ...]
  dtype: str  # MLIR's spelling: bf16, f32, i32, f8E4M3FN, ...

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class CustomCall:
  """One stablehlo.custom_call of the module text."""

  target: str
  operands: tuple[Tensor, ...]
  results: tuple[Tensor, ...]
  config: dict  # mhlo.backend_config: name -> bool, int or float.
  function: str  # The func.func it is in.
  in_shard_map: bool  # In a shard_map body, or a function one calls.


def _tensor(text: str) -> Tensor:
  *dims, dtype = text.split(",")[0].strip().split("x")
  return Tensor(tuple(int(d) for d in dims), dtype)


def _tensors(text: str) -> tuple[Tensor, ...]:
  return tuple(_tensor(t) for t in re.findall(r"tensor<([^>]*)>", text))


def _backend_config(line: str) -> dict:
  found = re.search(r"mhlo\.backend_config = \{([^{}]*)\}", line)
  config = {}
  for name, value in re.findall(
      r"(\w+) = (true|false|-?[\d.]+(?:e[+-]?\d+)?)",
      found.group(1) if found else "",
  ):
    if value in ("true", "false"):
      config[name] = value == "true"
    else:
      config[name] = (
          float(value) if "." in value or "e" in value else int(value)
      )
  return config


def custom_calls(module_text: str) -> list[CustomCall]:
  """Every custom call of `module_text`, in program order.

  A call is `in_shard_map` when it sits in the region of an
  `sdy.manual_computation` (what shard_map lowers to) or in a function
  called, directly or not, from one.
  """
  found = []  # (target, signature line, function, in_region)
  calls = collections.defaultdict(set)  # function -> functions it calls
  region_calls = set()  # functions called from a shard_map region
  function = ""
  region_indent = None
  for line in module_text.splitlines():
    indent = len(line) - len(line.lstrip())
    head = re.match(r"\s*func\.func (?:public |private )?@([\w$.-]+)\(", line)
    if head:
      function, region_indent = head.group(1), None
      continue
    if (
        region_indent is not None
        and indent == region_indent
        and (line.lstrip().startswith("}"))
    ):
      region_indent = None
    if "sdy.manual_computation(" in line:
      region_indent = indent
    for callee in re.findall(r"\bcall @([\w$.-]+)\(", line):
      calls[function].add(callee)
      if region_indent is not None:
        region_calls.add(callee)
    target = re.search(r"stablehlo\.custom_call @([\w$.-]+)\(", line)
    if target:
      found.append((target.group(1), line, function, region_indent is not None))
  inside = set()
  todo = list(region_calls)
  while todo:
    name = todo.pop()
    if name not in inside:
      inside.add(name)
      todo.extend(calls[name])
  out = []
  for target, line, function, in_region in found:
    signature = line[line.rindex("} : (") + len("} : (") :]
    operands, results = signature.split(") -> ", 1)
    results = re.sub(r"\s+loc\(.*$", "", results)
    out.append(
        CustomCall(
            target=target,
            operands=_tensors(operands),
            results=_tensors(results),
            config=_backend_config(line),
            function=function,
            in_shard_map=in_region or function in inside,
        )
    )
  return out


@dataclasses.dataclass(frozen=True)
class Gemm:
  """A grouped GEMM call, its operands named as TE's FFI names them."""

  call: CustomCall

  def __getattr__(self, name):
    names = (
        "lhs", "lhs_scale_inv", "rhs", "rhs_scale_inv", "bias",
        "lhs_first_dims", "lhs_last_dims", "rhs_first_dims", "rhs_last_dims",
        "out_first_dims", "out_last_dims",
    )  # fmt: skip
    if name in names:
      return self.call.operands[names.index(name)]
    raise AttributeError(name)

  @property
  def out(self) -> Tensor:
    return self.call.results[0]

  @property
  def role(self) -> str:
    """Which of the three grouped GEMMs: forward, dgrad or wgrad.

    The forms grouped_dense's rules call, and the te backend's TEKernels
    (its gmm, gmm of transposed weights and tgmm). wgrad contracts the
    ragged rows: its rhs is ragged too, and its output is [E, C, N]. dgrad
    multiplies the output's cotangent with the transposed kernel: a float8
    e5m2 lhs (TE's own FP8 backward) or rhs_is_trans on unquantised
    operands.
    """
    if self.rhs_first_dims.size:
      return "wgrad"
    if self.lhs.dtype == "f8E5M2":
      return "dgrad"
    if self.lhs.dtype in _FLOAT8:
      return "forward"
    return "dgrad" if self.call.config.get("rhs_is_trans") else "forward"


def gemms(calls: list[CustomCall]) -> list[Gemm]:
  return [Gemm(c) for c in calls if c.target in (V1, V2)]


def dots(module_text: str) -> list[tuple[Tensor, ...]]:
  """The operand types of every XLA dot (dot, dot_general, ragged_dot)."""
  found = []
  for line in module_text.splitlines():
    if re.search(r"\b(stablehlo|chlo)\.(dot|dot_general|ragged_dot)\b", line):
      signature = re.search(r" : \((.*?)\) -> ", line)
      found.append(_tensors(signature.group(1)) if signature else ())
  return found


# --- What TE should do, from its source --------------------------------------


def expected_bf16_target(cc: int) -> str:
  """TE 2.20's kernel for an unquantised bf16 grouped GEMM without bias.

  cpp_extensions/gemm.py, `_is_v2_grouped_gemm_supported`: v2 needs TE's
  library to have cuBLAS's grouped GEMM (probed at import by
  `get_grouped_gemm_setup_workspace_size`, which raises otherwise) and a
  minimum device capability of 90.
  """
  # pylint: disable-next=g-import-not-at-top
  import transformer_engine_jax

  try:
    transformer_engine_jax.get_grouped_gemm_setup_workspace_size(1)
  except RuntimeError:
    return V1
  return V2 if cc >= 90 else V1


def expected_quantized_target(recipe: str, cc: int) -> str:
  """The kernel of a quantised forward GEMM (`_is_v2_grouped_gemm_supported`).

  Tensor scaling never takes v2; MXFP8 only on sm_100+ with both operands'
  row and column sizes multiples of 128, which D = 64 is not.
  """
  del recipe, cc
  return V1


# TE's MXFP8 grouped GEMM lays its scales out in tiles of 128 rows per group
# (swizzled for cuBLAS): each group's rows must come padded to a multiple
# of it.
MXFP8_TILE_ROWS = 128


def padded_rows_ok(rows: int, align: int) -> bool:
  """Whether `rows` is the static buffer of groups padded to `align` rows:
  the smallest multiple of `align` that holds the M copies plus up to
  align - 1 padding rows per group, whatever the routing."""
  worst = _M + _E * (align - 1)
  return rows % align == 0 and worst <= rows < worst + align


def _cfg(**changes) -> moe_core.MoEConfig:
  return moe_core.MoEConfig(
      num_experts=_E, top_k=_K, hidden_size=_D, expert_ffn_size=_F, **changes
  )


def _inputs(cfg: moe_core.MoEConfig):
  """params (float32, as training keeps them) and x [T, D] bfloat16."""
  params = moe_core.init_params(jax.random.key(0), cfg)
  if cfg.correction_bias:
    params["correction_bias"] = 0.1 * jax.random.normal(
        jax.random.key(2), (_E,), jnp.float32
    )
  x = jax.random.normal(jax.random.key(1), (_T, _D), jnp.bfloat16)
  return params, x


def _layer(cfg, backend="te", **layer_kwargs):
  def forward(params, x):
    return moe_core.moe_layer(params, x, cfg, backend=backend, **layer_kwargs)

  def loss(params, x):
    y, aux = forward(params, x)
    return (
        jnp.sum(jnp.square(y.astype(jnp.float32)))
        + 0.01 * aux.load_balancing_loss
        + 0.001 * aux.router_z_loss
    )

  return forward, jax.grad(loss, argnums=(0, 1))


def export(fn, *args, extra_targets=()) -> jax.export.Exported:
  """`jax.export` of jit(fn) for CUDA, TE's custom calls allowed."""
  targets = (*_te.custom_call_targets(), *extra_targets)
  return jax.export.export(
      jax.jit(fn),
      platforms=["cuda"],
      disabled_checks=[
          jax.export.DisabledSafetyCheck.custom_call(t) for t in targets
      ],
  )(*args)


class LoweringTestCase(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    require_te(self)

  def lower(self, cc, fn, *args, extra_targets=()):
    with _te.compute_capability(cc):
      exported = export(fn, *args, extra_targets=extra_targets)
    return exported, custom_calls(exported.mlir_module())

  def assertRoundTrips(self, exported: jax.export.Exported):
    """serialize, deserialize: the same program, signature and calls."""
    restored = jax.export.deserialize(exported.serialize())
    self.assertEqual(restored.platforms, ("cuda",))
    self.assertEqual(restored.in_avals, exported.in_avals)
    self.assertEqual(restored.out_avals, exported.out_avals)
    self.assertEqual(restored.in_tree, exported.in_tree)
    self.assertEqual(restored.out_tree, exported.out_tree)
    self.assertEqual(restored.mlir_module(), exported.mlir_module())
    self.assertEqual(
        [c.target for c in custom_calls(restored.mlir_module())],
        [c.target for c in custom_calls(exported.mlir_module())],
    )

  def assertTargets(self, calls, *, required, allowed=()):
    """Every `required` target is called, and nothing outside both lists."""
    targets = collections.Counter(c.target for c in calls)
    for target in required:
      self.assertIn(target, targets, f"{target} missing from {targets}")
    unexpected = set(targets) - set(required) - set(allowed)
    self.assertEmpty(unexpected, f"unexpected custom calls: {unexpected}")

  def assertGroupSizes(self, tensor: Tensor, groups: int, what: str):
    """[groups] int32 group sizes, or the empty [0] of an axis not ragged."""
    self.assertEqual(tensor, Tensor((groups,), "i32"), what)

  def assertForwardGemms(
      self, found, *, lhs_dtype, cc, target, scale=None, m=_M, e=_E, align=1
  ):
    """The gate/up and down GEMMs of the expert FFN, forward.

    gate and up: [M, D] x [E, D, F] (or both in one [E, D, 2F] GEMM);
    down: [M, F] x [E, F, D]; outputs bf16, rows ragged by the [E] int32
    group sizes. Quantised operands are 1-D of the same number of
    elements, with scale_inv of the recipe's dtype. align > 1: each group
    padded to a multiple of `align` rows (`padded_rows_ok`) instead of M
    rows. Returns the forward GEMMs.
    """
    forward = [g for g in found if g.role == "forward"]
    self.assertNotEmpty(forward)
    if align > 1:
      m = forward[0].out.shape[0]
      self.assertTrue(
          padded_rows_ok(m, align),
          f"{m} rows for {_M} token copies in groups of {align}",
      )
    gate_up_width = 0
    downs = 0
    for g in forward:
      with self.subTest(gemm=str(g.out)):
        self.assertEqual(g.call.target, target)
        self.assertEqual(g.lhs.dtype, lhs_dtype)
        self.assertEqual(g.rhs.dtype, lhs_dtype)
        n = g.out.shape[1]
        contracted = g.lhs.size // m
        self.assertEqual(g.out.dtype, "bf16")
        self.assertEqual(g.out.shape, (m, n))
        if n == _D:  # down
          downs += 1
          self.assertEqual(contracted, _F)
        else:  # gate, up or both
          gate_up_width += n
          self.assertEqual(contracted, _D)
        if lhs_dtype == "bf16":
          self.assertEqual(g.lhs.shape, (m, contracted))
          self.assertEqual(g.rhs.shape, (e, contracted, n))
          self.assertEqual(g.lhs_scale_inv.size, 0)
        else:
          self.assertEqual(g.lhs.shape, (m * contracted,))
          self.assertEqual(g.rhs.shape, (e * contracted * n,))
          self.assertEqual(g.lhs_scale_inv.dtype, scale)
          self.assertEqual(g.rhs_scale_inv.dtype, scale)
          if scale == "f32":
            # Tensor scaling as moe_core's fp8_tensor: one scale per group
            # of rows, one per expert's weights.
            self.assertEqual(g.lhs_scale_inv.shape, (e,))
            self.assertEqual(g.rhs_scale_inv.shape, (e,))
          else:
            # MXFP8: an E8M0 scale per 32 elements along the contraction
            # (TE pads the scale arrays to its swizzled tiles).
            self.assertGreaterEqual(g.lhs_scale_inv.size, m * contracted // 32)
            self.assertGreaterEqual(
                g.rhs_scale_inv.size, e * contracted * n // 32
            )
        self.assertGroupSizes(g.lhs_first_dims, e, "lhs_first_dims")
        self.assertGroupSizes(g.out_first_dims, e, "out_first_dims")
        self.assertGroupSizes(g.rhs_first_dims, 0, "rhs_first_dims")
        self.assertAlphaBeta(g, cc, e)
    self.assertEqual(downs, 1)
    self.assertEqual(gate_up_width, 2 * _F)
    return forward

  def assertAlphaBeta(self, g: Gemm, cc: int, e: int = _E):
    """v2 takes float32 alpha and beta, one per group on sm_100+ only
    (`_v2_grouped_gemm_supports_per_group_alpha_beta`); v1 a group_offset.
    """
    if g.call.target == V2:
      numel = e if cc >= 100 else 1
      self.assertEqual(g.call.operands[11:], (Tensor((numel,), "f32"),) * 2)
    else:
      self.assertEqual(g.call.operands[11:], (Tensor((1,), "i32"),))

  def assertBackwardGemms(self, found, forward, *, cc, target, m=_M, e=_E):
    """For each forward [M, C] x [E, C, N]: a dgrad [M, N] x [E, C, N]^T ->
    [M, C] and a wgrad [M, C]^T x [M, N] -> [E, C, N], both unquantised
    bf16 (the contract's straight-through gradients, in the activation
    dtype, whatever the forward recipe).
    """
    shapes = [(g.lhs.size // g.out.shape[0], g.out.shape[1]) for g in forward]
    dgrads = [g for g in found if g.role == "dgrad"]
    wgrads = [g for g in found if g.role == "wgrad"]
    self.assertCountEqual(
        [(g.out.shape[1], g.lhs.shape[1]) for g in dgrads], shapes
    )
    self.assertCountEqual([g.out.shape[1:] for g in wgrads], shapes)
    for g in dgrads:
      c, n = g.out.shape[1], g.lhs.shape[1]
      with self.subTest(dgrad=str(g.out)):
        self.assertEqual(g.call.target, target)
        self.assertEqual(g.lhs, Tensor((m, n), "bf16"))
        self.assertEqual(g.rhs, Tensor((e, c, n), "bf16"))
        self.assertEqual(g.out, Tensor((m, c), "bf16"))
        self.assertGroupSizes(g.lhs_first_dims, e, "lhs_first_dims")
        self.assertGroupSizes(g.out_first_dims, e, "out_first_dims")
        self.assertAlphaBeta(g, cc, e)
    for g in wgrads:
      c, n = g.out.shape[1:]
      with self.subTest(wgrad=str(g.out)):
        self.assertEqual(g.call.target, target)
        self.assertEqual(g.lhs, Tensor((m, c), "bf16"))
        self.assertEqual(g.rhs, Tensor((m, n), "bf16"))
        self.assertEqual(g.out, Tensor((e, c, n), "bf16"))
        self.assertGroupSizes(g.lhs_first_dims, e, "lhs_first_dims")
        self.assertGroupSizes(g.rhs_first_dims, e, "rhs_first_dims")
        self.assertGroupSizes(g.out_first_dims, 0, "out_first_dims")
        self.assertAlphaBeta(g, cc, e)


class Bf16LoweringTest(LoweringTestCase):
  """The default config (softmax, K=2) in bf16: TE's router and GEMMs."""

  @parameterized.parameters(90, 100)
  def test_grouped_gemm_path_names_the_kernel(self, cc):
    path = _te.grouped_gemm_path(cc)
    self.assertStartsWith(path, expected_bf16_target(cc) + ":")

  @parameterized.parameters(90, 100)
  def test_forward_lowers_to_router_and_grouped_gemms(self, cc):
    cfg = _cfg()
    forward, _ = _layer(cfg)
    _, calls = self.lower(cc, forward, *_inputs(cfg))
    target = expected_bf16_target(cc)
    # The permutation is pure JAX (TE's Triton kernels are not lowered):
    # nothing but the router and the GEMMs is a custom call.
    self.assertTargets(
        calls, required=(ROUTER_FORWARD, target), allowed=(*AUX_LOSS, D2H)
    )
    router = [c for c in calls if c.target == ROUTER_FORWARD]
    for call in router:
      # logits [T, E] float32 and an empty expert bias in; sparse probs,
      # the [T, E] routing map and the saved scores out.
      self.assertEqual(call.operands[0], Tensor((_T, _E), "f32"))
      self.assertEqual(call.results[1], Tensor((_T, _E), "i1"))
      self.assertEqual(call.config["topk"], _K)
    found = gemms(calls)
    forward_gemms = self.assertForwardGemms(
        found, lhs_dtype="bf16", cc=cc, target=target
    )
    self.assertLen(found, len(forward_gemms))
    # One device, no shard_map (the mesh test relies on telling them apart).
    self.assertFalse(any(c.in_shard_map for c in calls))

  @parameterized.parameters(90, 100)
  def test_gradient_adds_dgrad_and_wgrad_gemms(self, cc):
    cfg = _cfg()
    _, grad = _layer(cfg)
    _, calls = self.lower(cc, grad, *_inputs(cfg))
    target = expected_bf16_target(cc)
    self.assertTargets(
        calls,
        required=(ROUTER_FORWARD, ROUTER_BACKWARD, target),
        allowed=(*AUX_LOSS, D2H),
    )
    found = gemms(calls)
    forward = self.assertForwardGemms(
        found, lhs_dtype="bf16", cc=cc, target=target
    )
    self.assertBackwardGemms(found, forward, cc=cc, target=target)
    self.assertLen(found, 3 * len(forward))

  @parameterized.parameters(90, 100)
  def test_serialization_round_trips(self, cc):
    cfg = _cfg()
    _, grad = _layer(cfg)
    # The program as a training step traces it: moe_core's run-time checks
    # are traced only inside moe_core.checked, so it carries no checkify
    # effect and serialises as it is.
    exported, calls = self.lower(cc, grad, *_inputs(cfg))
    self.assertIn(expected_bf16_target(cc), [c.target for c in calls])
    self.assertRoundTrips(exported)


class QuantizedLoweringTest(LoweringTestCase):
  """FP8 and MXFP8: TE quantises the forward operands, bf16 gradients."""

  def group_align(self, recipe: str) -> int:
    """The rows per group the backend pads quantised GEMMs to."""
    align = gemm_lib.GROUP_ALIGN.get(recipe, 1)
    if recipe == "mxfp8":
      self.assertEqual(align % MXFP8_TILE_ROWS, 0)
    return align

  @parameterized.named_parameters(
      ("_fp8_tensor_sm90", "fp8_tensor", 90),
      ("_fp8_tensor_sm100", "fp8_tensor", 100),
      ("_mxfp8_sm100", "mxfp8", 100),
  )
  def test_forward_gemms_take_float8_and_gradients_bf16(self, recipe, cc):
    cfg = _cfg(precision=recipe)
    _, grad = _layer(cfg)
    _, calls = self.lower(cc, grad, *_inputs(cfg))
    target = expected_quantized_target(recipe, cc)
    bf16_target = expected_bf16_target(cc)
    self.assertTargets(
        calls,
        required=(ROUTER_FORWARD, ROUTER_BACKWARD, target, bf16_target),
        allowed=(*QUANTIZE, *AUX_LOSS, D2H),
    )
    quantize = [c for c in calls if c.target in QUANTIZE]
    # Each forward GEMM's rows and weights.
    found = gemms(calls)
    forward = self.assertForwardGemms(
        found,
        lhs_dtype="f8E4M3FN",
        cc=cc,
        target=target,
        scale=_SCALE_DTYPE[recipe],
        align=self.group_align(recipe),
    )
    self.assertLen(quantize, 2 * len(forward))
    for call in quantize:
      self.assertIn(call.operands[0].dtype, ("bf16",))
      self.assertIn("f8E4M3FN", [r.dtype for r in call.results])
      self.assertNotIn("f8E5M2", [r.dtype for r in call.results])
    # Straight-through: the backward GEMMs are unquantised bf16.
    self.assertBackwardGemms(found, forward, cc=cc, target=bf16_target)
    self.assertLen(found, 3 * len(forward))

  @parameterized.named_parameters(
      ("_fp8_tensor_sm90", "fp8_tensor", 90),
      ("_mxfp8_sm100", "mxfp8", 100),
  )
  def test_forward_mode_tangents_are_bf16_gemms(self, recipe, cc):
    # Straight-through at every order: the quantised GEMMs are the jvp's
    # primal only, each tangent is the unquantised GEMM's (dX W + X dW in
    # TE's bf16 kernel), and a Hessian's backward GEMMs are bf16 too.
    cfg = _cfg(precision=recipe)
    bf16_target = expected_bf16_target(cc)
    fn, args = _transformed(cfg, "jvp")
    exported, calls = self.lower(cc, fn, *args)
    found = gemms(calls)
    quantised = [g for g in found if g.lhs.dtype in _FLOAT8]
    self.assertForwardGemms(
        quantised,
        lhs_dtype="f8E4M3FN",
        cc=cc,
        target=expected_quantized_target(recipe, cc),
        scale=_SCALE_DTYPE[recipe],
        align=self.group_align(recipe),
    )
    self.assertLen(quantised, 3)
    tangents = [g for g in found if g.lhs.dtype not in _FLOAT8]
    self.assertLen(tangents, 6)
    for g in tangents:
      with self.subTest(tangent=str(g.out)):
        self.assertEqual(g.role, "forward")
        self.assertEqual(g.call.target, bf16_target)
        self.assertEqual((g.lhs.dtype, g.rhs.dtype), ("bf16", "bf16"))
    self.assertRoundTrips(exported)
    fn, args = _transformed(cfg, "hessian")
    _, calls = self.lower(cc, fn, *args)
    found = gemms(calls)
    backward = [g for g in found if g.role != "forward"]
    self.assertEqual({g.role for g in backward}, {"dgrad", "wgrad"})
    for g in backward:
      with self.subTest(backward=f"{g.role} {g.out}"):
        self.assertEqual(g.call.target, bf16_target)
        self.assertEqual((g.lhs.dtype, g.rhs.dtype), ("bf16", "bf16"))

  def test_mxfp8_forward_lowers_on_sm100(self):
    cfg = _cfg(precision="mxfp8")
    forward, _ = _layer(cfg)
    _, calls = self.lower(100, forward, *_inputs(cfg))
    self.assertTargets(
        calls,
        required=(ROUTER_FORWARD, V1),
        allowed=(*QUANTIZE, *AUX_LOSS, D2H),
    )
    self.assertForwardGemms(
        gemms(calls),
        lhs_dtype="f8E4M3FN",
        cc=100,
        target=V1,
        scale="f8E8M0FNU",
        align=self.group_align("mxfp8"),
    )

  @parameterized.parameters("fp8_block", "nvfp4")
  def test_recipes_without_te_kernels_raise(self, recipe):
    cfg = _cfg(precision=recipe)
    forward, _ = _layer(cfg)
    with self.assertRaisesRegex(NotImplementedError, recipe):
      self.lower(100, forward, *_inputs(cfg))

  def test_delayed_scaling_raises(self):
    cfg = _cfg(precision="fp8_tensor")
    backend = moe_core.get_backend("te", fp8_scaling="delayed")
    forward, _ = _layer(cfg, backend=backend)
    with self.assertRaisesRegex(NotImplementedError, "delayed"):
      self.lower(90, forward, *_inputs(cfg))


class RouterChoiceTest(LoweringTestCase):
  """The fused router is lowered exactly when `router_choice` says so."""

  @parameterized.named_parameters(
      ("_softmax", dict(), True),
      ("_softmax_renormalised", dict(norm_topk_prob=True), True),
      (
          "_deepseek_v3",
          dict(
              score_func="sigmoid",
              norm_topk_prob=True,
              norm_epsilon=1e-20,
              correction_bias=True,
              routed_scaling_factor=2.5,
          ),
          True,
      ),
      # TE takes an expert bias only with sigmoid scores.
      ("_softmax_with_correction_bias", dict(correction_bias=True), False),
      # TE renormalises sigmoid weights whenever K > 1.
      ("_sigmoid_not_renormalised", dict(score_func="sigmoid"), False),
  )
  def test_router_lowering_follows_router_choice(self, changes, fused):
    cfg = _cfg(**changes)
    backend = moe_core.get_backend("te")
    choice, reason = backend.router_choice(cfg)
    self.assertEqual(choice, fused, reason)
    if not fused:
      self.assertNotEmpty(reason)
    _, grad = _layer(cfg)
    _, calls = self.lower(90, grad, *_inputs(cfg))
    router = (ROUTER_FORWARD, ROUTER_BACKWARD)
    gemm = expected_bf16_target(90)
    if fused:
      self.assertTargets(calls, required=(*router, gemm), allowed=AUX_LOSS)
    else:
      self.assertTargets(calls, required=(gemm,), allowed=AUX_LOSS)

  def test_fused_router_false_uses_the_library_router(self):
    backend = moe_core.get_backend("te", fused_router=False)
    cfg = _cfg()
    self.assertEqual(backend.router_choice(cfg)[0], False)
    forward, _ = _layer(cfg, backend=backend)
    _, calls = self.lower(90, forward, *_inputs(cfg))
    self.assertTargets(calls, required=(expected_bf16_target(90),))


def _transformed(cfg, name: str):
  """(fn, args): the te layer inside a user's transformation, by name.

  jvp      jax.jvp of the layer's output, params and x both perturbed;
  hessian  jax.hessian of a small loss in two scalars that scale the
           input and the down projection (the derivatives of every
           backward GEMM, as the conformance suite's Hessian);
  vmap     jax.vmap of the layer over a batch of two inputs.
  """
  params, x = _inputs(cfg)

  def layer(params, x):
    y, _ = moe_core.moe_layer(params, x, cfg, backend="te")
    return y.astype(jnp.float32)

  if name == "jvp":
    tangents = jax.tree.map(lambda a: 0.5 * jnp.ones_like(a), (params, x))
    return (
        lambda p, x, tp, tx: jax.jvp(layer, (p, x), (tp, tx)),
        (params, x, *tangents),
    )
  if name == "hessian":

    def loss(v):
      scaled = dict(params, w_down=params["w_down"] * v[1])
      return jnp.sum(jnp.tanh(layer(scaled, x * v[0].astype(x.dtype))))

    return jax.hessian(loss), (jnp.array([1.1, 0.9], jnp.float32),)
  if name == "vmap":
    return jax.vmap(layer, (None, 0)), (params, jnp.stack([x, -x]))
  raise ValueError(name)


class TransformsLoweringTest(LoweringTestCase):
  """The layer inside users' transformations runs TE's kernels.

  Forward mode, Hessians and vmap go through the te backend's grouped GEMM
  (moe_core's grouped-matmul primitive over TE's raw grouped GEMM), its
  router (a custom JVP over TE's forward kernel, TE's backward kernel as
  the transpose) and its permutation, and lower to TE's custom calls only:
  no XLA dot stands in for an expert GEMM.
  """

  def assertTeGemmsOnly(self, exported, calls, cc):
    """Every grouped GEMM is TE's expected kernel on bf16 operands, and no
    XLA dot touches an expert's weights (every one is [E, *, F] or
    [E, F, *]: a dot with an F-wide operand would be an expert GEMM)."""
    target = expected_bf16_target(cc)
    found = gemms(calls)
    self.assertNotEmpty(found)
    for g in found:
      with self.subTest(gemm=f"{g.role} {g.out}"):
        self.assertEqual(g.call.target, target)
        self.assertEqual((g.lhs.dtype, g.rhs.dtype), ("bf16", "bf16"))
        self.assertIn(g.out.dtype, ("bf16", "f32"))
        self.assertAlphaBeta(g, cc)
    found_dots = dots(exported.mlir_module())
    # The router's logits (x @ router [D, E], float32) are an XLA dot: the
    # parser sees dots.
    router = Tensor((_D, _E), "f32")
    self.assertTrue(any(router in operands for operands in found_dots))
    for operands in found_dots:
      with self.subTest(dot=str(operands)):
        self.assertNotIn("bf16", [t.dtype for t in operands])
        self.assertNotIn(_F, [d for t in operands for d in t.shape])
    return found

  @parameterized.parameters(90, 100)
  def test_jvp_lowers_to_forward_gemms_and_router_forward(self, cc):
    fn, args = _transformed(_cfg(), "jvp")
    exported, calls = self.lower(cc, fn, *args)
    target = expected_bf16_target(cc)
    # Forward mode transposes nothing: no dgrad, wgrad or router backward.
    self.assertTargets(
        calls, required=(ROUTER_FORWARD, target), allowed=(*AUX_LOSS, D2H)
    )
    found = self.assertTeGemmsOnly(exported, calls, cc)
    self.assertEqual({g.role for g in found}, {"forward"})
    # Each of the 3 GEMMs, then its tangent dX W + X dW: two more products
    # of the same shapes, summed in float32.
    self.assertLen(found, 9)
    self.assertLen([g for g in found if g.out.dtype == "f32"], 6)
    self.assertForwardGemms(
        [g for g in found if g.out.dtype == "bf16"],
        lhs_dtype="bf16",
        cc=cc,
        target=target,
    )
    self.assertRoundTrips(exported)

  @parameterized.parameters(90, 100)
  def test_hessian_lowers_to_every_gemm_and_router_kernel(self, cc):
    fn, args = _transformed(_cfg(), "hessian")
    exported, calls = self.lower(cc, fn, *args)
    target = expected_bf16_target(cc)
    self.assertTargets(
        calls,
        required=(ROUTER_FORWARD, ROUTER_BACKWARD, target),
        allowed=(*AUX_LOSS, D2H),
    )
    found = self.assertTeGemmsOnly(exported, calls, cc)
    self.assertEqual({g.role for g in found}, {"forward", "dgrad", "wgrad"})
    self.assertRoundTrips(exported)

  @parameterized.parameters(90, 100)
  def test_vmap_lowers_to_one_call_per_example(self, cc):
    fn, args = _transformed(_cfg(), "vmap")
    exported, calls = self.lower(cc, fn, *args)
    target = expected_bf16_target(cc)
    self.assertTargets(
        calls, required=(ROUTER_FORWARD, target), allowed=(*AUX_LOSS, D2H)
    )
    found = self.assertTeGemmsOnly(exported, calls, cc)
    # A loop over the batch (the groups differ per example): the GEMMs of
    # one example, M rows each, not one GEMM over the batch's 2M rows.
    self.assertForwardGemms(found, lhs_dtype="bf16", cc=cc, target=target)
    self.assertLen(found, 3)
    self.assertIn("stablehlo.while", exported.mlir_module())
    self.assertRoundTrips(exported)

  def test_user_shard_map_with_checked_variance_lowers(self):
    # Tokens split over a "data" axis in the user's own shard_map, with
    # check_vma=True (the default): TE's calls lower inside it.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    spec = jax.sharding.PartitionSpec
    cfg = _cfg()
    params, x = _inputs(cfg)

    def per_device(params, x):
      y, _ = moe_core.moe_layer(params, x, cfg, backend="te")
      return jnp.sum(jnp.square(y.astype(jnp.float32)))

    sharded = jax.shard_map(
        lambda p, x: jax.lax.psum(per_device(p, x), "data"),
        mesh=mesh,
        in_specs=(spec(), spec("data")),
        out_specs=spec(),
    )
    grad = jax.grad(sharded, argnums=(0, 1))
    exported, calls = self.lower(90, grad, params, x)
    self.assertEqual(exported.nr_devices, 2)
    target = expected_bf16_target(90)
    self.assertTargets(
        calls,
        required=(ROUTER_FORWARD, ROUTER_BACKWARD, target),
        allowed=(*AUX_LOSS, D2H),
    )
    for call in calls:
      self.assertTrue(call.in_shard_map, f"{call.target} outside shard_map")
    found = self.assertTeGemmsOnly(exported, calls, 90)
    self.assertBackwardGemms(
        found,
        self.assertForwardGemms(
            found, lhs_dtype="bf16", cc=90, target=target, m=_M // 2
        ),
        cc=90,
        target=target,
        m=_M // 2,
    )


class ExpertParallelLoweringTest(LoweringTestCase):
  """With a mesh: TE's calls run inside shard_map, one device per expert."""

  def setUp(self):
    super().setUp()
    if jax.device_count() < _E:
      self.skipTest(
          f"needs {_E} devices (XLA_FLAGS="
          f"--xla_force_host_platform_device_count={_E}), got "
          f"{jax.device_count()}"
      )
    self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:_E]), ("expert",))

  @parameterized.named_parameters(
      ("_ragged_forward", "ragged", False),
      ("_ragged_gradient", "ragged", True),
      ("_padded_forward", "padded", False),
  )
  def test_grouped_gemms_lower_inside_shard_map(self, exchange, gradient):
    cfg = _cfg()
    forward, grad = _layer(
        cfg,
        mesh=self.mesh,
        data_axes=(),
        ep_options=moe_core.EPOptions(exchange=exchange),
    )
    fn = grad if gradient else forward
    exported, calls = self.lower(
        90, fn, *_inputs(cfg), extra_targets=(RAGGED_ALL_TO_ALL,)
    )
    self.assertEqual(exported.nr_devices, _E)
    target = expected_bf16_target(90)
    required = [ROUTER_FORWARD, target]
    if gradient:
      required.append(ROUTER_BACKWARD)
    if exchange == "ragged":
      required.append(RAGGED_ALL_TO_ALL)
    self.assertTargets(calls, required=required, allowed=(*AUX_LOSS, D2H))
    te_calls = [c for c in calls if c.target != RAGGED_ALL_TO_ALL]
    for call in te_calls:
      self.assertTrue(call.in_shard_map, f"{call.target} outside shard_map")
    # Each device runs its one expert (E_l = 1) over its receive buffer.
    rows = options.buffer_sizes(_T // _E, _K, _E, _E, None)[1]
    found = gemms(calls)
    forward = self.assertForwardGemms(
        found, lhs_dtype="bf16", cc=90, target=target, m=rows, e=1
    )
    if gradient:
      self.assertBackwardGemms(
          found, forward, cc=90, target=target, m=rows, e=1
      )
    self.assertLen(found, (3 if gradient else 1) * len(forward))


if __name__ == "__main__":
  absltest.main()
