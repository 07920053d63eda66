"""Presets: published parameter counts, FLOPs, memory, --dry_run."""

import io

import jax
import jax.numpy as jnp
from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized
from flax import nnx

from train import main
from train import presets
from train.models import transformer as model_lib
from train.presets import published
from train.presets import sizing
from train.run.reporting import cost_report
from train.testing import small_runs


def setUpModule():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # Under pytest nobody parses absl flags.


class PublishedCountsTest(parameterized.TestCase):

  @parameterized.parameters(*presets.FULL_SIZE)
  def test_counts_match_the_published_figures(self, name):
    figures = published.PUBLISHED[name]
    total, active = published.counts_as_published(name)
    for what, got, want in (
        ("total", total, figures.total),
        ("active", active, figures.active),
    ):
      with self.subTest(what):
        tolerance = published.published_tolerance(want)
        self.assertLessEqual(
            abs(got - want),
            tolerance,
            f"{name} {what}: computed {got / 1e9:.3f}B, published "
            f"{want / 1e9:g}B (tolerance {tolerance / 1e9:.3f}B; source: "
            f"{figures.source})",
        )

  def test_active_counts_differ_by_exactly_the_input_embedding(self):
    # One embedding row of hidden_size per vocabulary entry is looked up
    # per token but counted in neither's FLOPs: vocab_size * hidden_size.
    for name in presets.FULL_SIZE:
      model = presets.get_preset(name).model
      counts = sizing.param_counts(model)
      with self.subTest(name):
        self.assertEqual(
            counts.active - counts.active_without_embedding,
            model.vocab_size * model.hidden_size,
        )

  def test_tolerance_is_half_a_unit_of_the_last_digit_plus_one_percent(self):
    self.assertAlmostEqual(
        published.published_tolerance(46.7e9), 0.05e9 + 0.467e9
    )
    self.assertAlmostEqual(published.published_tolerance(671e9), 0.5e9 + 6.71e9)
    # A figure quoted in trillions (DeepSeek-V4-Pro's 1.6T).
    self.assertAlmostEqual(
        published.published_tolerance(1.6e12), 0.05e12 + 16e9
    )


class FlopsTest(absltest.TestCase):

  def test_forward_flops_match_xla_cost_analysis_for_a_dense_model(self):
    """XLA's own count of the compiled forward, for an independent check.

    XLA counts the masked half of causal attention too, and elementwise
    work (norms, softmax, RoPE), which the formula leaves out: a few %.
    """
    cfg = small_runs.SMALL_DSV3.replace(moe=None, dense_ffn_size=64)
    batch, seq = 2, 64
    model = model_lib.Transformer(
        cfg, compute_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
    cost = (
        forward.lower(state, jnp.zeros((batch, seq), jnp.int32))
        .compile()
        .cost_analysis()
    )
    if isinstance(cost, (list, tuple)):  # Older jax: one dict per device.
      cost = cost[0]
    if not cost or "flops" not in cost:
      self.skipTest(f"no XLA cost analysis in jax {jax.__version__}.")
    f = sizing.flops_per_token(cfg, seq)
    unmasked_attention = f["attention_forward"] * 2 * seq / (seq + 1)
    want = f["forward"] - f["attention_forward"] + unmasked_attention
    got = cost["flops"] / (batch * seq)
    self.assertBetween(got / want, 0.99, 1.10)

  def test_training_is_three_forwards(self):
    f = sizing.flops_per_token(presets.MIXTRAL_8X7B.model, 4096)
    self.assertEqual(f["train"], 3 * f["forward"])


class MemoryTest(absltest.TestCase):

  def test_expert_and_fsdp_axes_divide_every_weight_tensor_the_rest(self):
    # Routed experts over expert x fsdp; the rest over fsdp x expert too
    # (train.parallel.sharding: the expert axis is a data axis outside the MoE
    # blocks); data replicates.
    cfg = presets.QWEN3_30B_A3B.model
    one = sizing.memory_per_device(cfg, sizing.parse_mesh("data=1"), 8, 128)
    ep = sizing.memory_per_device(cfg, sizing.parse_mesh("expert=8"), 8, 128)
    dp = sizing.memory_per_device(cfg, sizing.parse_mesh("data=8"), 8, 128)
    counts = sizing.param_counts(cfg)
    self.assertEqual(one["weights"], 4.0 * counts.total)
    self.assertAlmostEqual(ep["weights"], 4.0 * counts.total / 8)
    self.assertEqual(dp["weights"], one["weights"])
    self.assertEqual(ep["tokens_per_device"], one["tokens_per_device"] / 8)

  def test_remat_orders_activation_memory(self):
    cfg = presets.TINY_DSV3.model
    mesh = sizing.parse_mesh("data=1")
    act = {
        r: sizing.memory_per_device(cfg, mesh, 16, 128, r)
        for r in sizing.REMAT_CHOICES
    }
    self.assertLess(act["full"]["activations"], act["save_moe"]["activations"])
    self.assertLess(act["save_moe"]["activations"], act["none"]["activations"])
    self.assertEqual(
        act["offload_moe"]["activations"], act["full"]["activations"]
    )
    self.assertAlmostEqual(
        act["offload_moe"]["activations_offloaded_to_host"],
        act["save_moe"]["activations"] - act["full"]["activations"],
    )

  def test_bad_mesh_is_refused(self):
    with self.assertRaisesRegex(ValueError, "AXIS=SIZE with AXIS in"):
      sizing.parse_mesh("pipeline=2")
    with self.assertRaisesRegex(ValueError, "positive int size"):
      sizing.parse_mesh("data=0")


class DryRunTest(absltest.TestCase):

  @flagsaver.flagsaver(
      model="deepseek_v3", dry_run=True, mesh="fsdp=4,expert=64"
  )
  def test_dry_run_prints_counts_without_allocating(self):
    before = len(jax.live_arrays())
    out = io.StringIO()
    text = main.dry_run(out)
    self.assertEqual(len(jax.live_arrays()), before)
    self.assertEqual(out.getvalue().strip(), text)
    # The printed counts are the preset's (their values are checked against
    # the published figures above and the built models in model_test).
    counts = sizing.param_counts(presets.DEEPSEEK_V3.model)
    self.assertIn(f"total {counts.total:,}", text)
    self.assertIn(
        "without the input embedding "
        f"{cost_report.human(counts.active_without_embedding)}",
        text,
    )
    self.assertIn("FLOPs per token", text)
    self.assertIn("256 devices", text)
    self.assertIn("AdamW state", text)

  @flagsaver.flagsaver(
      model="deepseek_v3",
      dry_run=True,
      mesh="fsdp=4,expert=64",
      batch_size=1024,
      seq_len=4096,
      microbatches=8,
      num_layers=4,
  )
  def test_dry_run_sizes_one_microbatch_and_names_the_full_depth(self):
    text = main.dry_run(io.StringIO(), compile_step=False)
    model = presets.DEEPSEEK_V3.model.replace(num_layers=4)
    mesh = sizing.parse_mesh("fsdp=4,expert=64")

    def activations(rows):
      mem = sizing.memory_per_device(model, mesh, rows, 4096, "none", 4)
      return cost_report.human_bytes(mem["activations"])

    # The activations of 128 rows, not of the whole batch (which differ).
    self.assertNotEqual(activations(128), activations(1024))
    self.assertIn(f"activations {activations(128)}", text)
    self.assertIn("in 8 microbatches (activations of one, 128 rows)", text)
    # The published counts are the 61-layer model's: named, not compared.
    self.assertIn("published, for all 61 layers (not this 4-layer", text)


if __name__ == "__main__":
  absltest.main()
