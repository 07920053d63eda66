"""The Mosaic GPU tile table: valid entries that fit Hopper, and the choice."""

import types
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

from backends.mosaic_gpu import backend
from backends.mosaic_gpu import kernels_sm100
from backends.mosaic_gpu import tiling
from moe_core import compat

# (num_lhs, num_rhs, accumulators, outputs) of the kernel each bucket serves;
# "two_acc" is the gated gate+up pass under differentiation (h, gate, up).
_USE = {
    "default": (1, 1, 1, 1),
    "few_rows": (1, 1, 1, 1),
    "two_acc": (1, 2, 2, 3),
}


class TableTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("_".join(key), key, tiles) for key, tiles in tiling.TABLE.items()
  )
  def test_shipped_entry_fits_hopper_unchanged(self, key, tiles):
    num_lhs, num_rhs, accs, outs = _USE[key[2]]
    self.assertLessEqual(
        tiles.smem_bytes(jnp.bfloat16, num_lhs, num_rhs, outs),
        tiling.SMEM_BYTES,
    )
    self.assertLessEqual(
        tiles.acc_regs_per_thread(accs), tiling.ACC_REGS_PER_THREAD
    )
    self.assertEqual(
        tiling.fit(tiles, jnp.bfloat16, num_lhs, num_rhs, accs, outs), tiles
    )

  @parameterized.named_parameters(
      ("_".join(key), tiles)
      for key, tiles in tiling.TABLE.items()
      if key[1] == "dgrad"
  )
  def test_dgrad_of_gate_up_is_fitted(self, tiles):
    # dX of gate+up: two products (dgate, dup) into one accumulator.
    fitted = tiling.fit(tiles, jnp.bfloat16, 2, 2, 1, 1)
    self.assertLessEqual(
        fitted.smem_bytes(jnp.bfloat16, 2, 2, 1), tiling.SMEM_BYTES
    )
    self.assertGreaterEqual(fitted.stages, 2)

  @parameterized.named_parameters(
      ("_".join(key), key, tiles)
      for key, tiles in tiling.TABLE.items()
      if key[0] == "sm100"
  )
  def test_sm100_entries_fit_tensor_memory(self, key, tiles):
    _, _, accs, _ = _USE[key[2]]
    kernels_sm100.check_tiles(tiles, accs)  # Raises if not.

  def test_choose_reads_the_generation_row(self):
    got = tiling.choose(
        tiling.TileConfig(),
        "fwd",
        32768,
        256,
        jnp.bfloat16,
        generation_name="sm100",
    )
    self.assertEqual(got, tiling.TABLE[("sm100", "fwd", "default")])
    with self.assertRaisesRegex(ValueError, "generation must be one of"):
      tiling.check_generation("sm80")

  def test_choose_uses_the_table_by_bucket(self):
    config = tiling.TileConfig()
    self.assertEqual(
        tiling.choose(config, "fwd", 32768, 256, jnp.bfloat16),
        tiling.TABLE[("sm90", "fwd", "default")],
    )
    self.assertEqual(
        tiling.choose(config, "fwd", 1024, 256, jnp.bfloat16),
        tiling.TABLE[("sm90", "fwd", "few_rows")],
    )
    self.assertEqual(
        tiling.choose(
            config,
            "fwd",
            32768,
            256,
            jnp.bfloat16,
            num_rhs=2,
            num_accs=2,
            num_outputs=2,
        ),
        tiling.TABLE[("sm90", "fwd", "two_acc")],
    )

  def test_caller_tiles_win(self):
    mine = tiling.Tiles(bm=64, bk=32, bn=64, stages=2)
    for config in (
        tiling.TileConfig.parse(mine),
        tiling.TileConfig.parse({"bm": 64, "bk": 32, "bn": 64, "stages": 2}),
        tiling.TileConfig.parse(
            {"fwd": {"bm": 64, "bk": 32, "bn": 64, "stages": 2}, "dgrad": None}
        ),
    ):
      self.assertEqual(
          tiling.choose(config, "fwd", 32768, 8, jnp.bfloat16), mine
      )

  def test_fit_shrinks_to_registers_then_shared_memory(self):
    big = tiling.Tiles(bm=256, bk=64, bn=256, stages=8)
    fitted = tiling.fit(big, jnp.bfloat16, 1, 2, 2, 3)
    self.assertLessEqual(
        fitted.acc_regs_per_thread(2), tiling.ACC_REGS_PER_THREAD
    )
    self.assertLessEqual(
        fitted.smem_bytes(jnp.bfloat16, 1, 2, 3), tiling.SMEM_BYTES
    )

  @parameterized.parameters(
      dict(bm=32),
      dict(bm=320),
      dict(bk=128),
      dict(bn=96),
      dict(stages=0),
      dict(bm=True),
  )
  def test_bad_tiles_name_the_field(self, **bad):
    (name,) = bad
    with self.assertRaisesRegex(ValueError, f"Tiles.{name} must be"):
      tiling.Tiles(**bad)

  def test_parse_refuses_unknown_keys(self):
    with self.assertRaisesRegex(
        ValueError, r"tiles as a dict must map each of the kinds"
    ):
      tiling.TileConfig.parse({"block_m": 64})
    with self.assertRaisesRegex(TypeError, "tiles must be None"):
      tiling.TileConfig.parse([64])


def _device(platform="gpu", capability="9.0", kind="NVIDIA H100", cores=132):
  return types.SimpleNamespace(
      platform=platform,
      device_kind=kind,
      compute_capability=capability,
      core_count=cores,
  )


class TargetTest(parameterized.TestCase):
  """The kernels, SMs and availability of the GPU the program targets."""

  # wgmma is Hopper's (sm_90), tcgen05 Blackwell's (sm_100, and sm_103 on
  # Blackwell Ultra); an A100 (sm_80) has neither.
  @parameterized.parameters(
      ("NVIDIA H100 80GB HBM3", 132, "sm90"),
      ("NVIDIA H200", 132, "sm90"),
      ("NVIDIA B200", 148, "sm100"),
      ("NVIDIA GB200", 152, "sm100"),
      ("NVIDIA B300", 148, "sm100"),
      ("NVIDIA A100-SXM4-80GB", 108, None),
  )
  def test_an_aot_target_sets_generation_and_sms(self, kind, cores, want):
    # A local GPU of another model is not what the program is built for.
    local = _device(capability="8.0", kind="NVIDIA A100", cores=108)
    with (
        mock.patch.object(jax, "devices", return_value=[local]),
        compat.abstract_gpu_mesh(kind, num_cores=cores),
    ):
      self.assertEqual(tiling.generation(), want)
      self.assertEqual(tiling.num_sms(), cores)

  @parameterized.parameters(
      (_device(), "sm90", 132),
      (_device(capability="10.0", kind="NVIDIA B200", cores=148), "sm100", 148),
      (_device(capability="8.0", cores=108), None, 108),
      # Off a GPU: the Hopper kernels (the interpreter's), an H100's SMs.
      (_device(platform="cpu", capability=None, cores=None), "sm90", 132),
  )
  def test_without_a_target_the_local_device(self, device, want, sms):
    with mock.patch.object(jax, "devices", return_value=[device]):
      self.assertEqual(tiling.generation(), want)
      self.assertEqual(tiling.num_sms(), sms)
    self.assertEqual(tiling.generation(device), want)

  def test_a_gpu_without_an_sm_count_gets_an_h100s(self):
    self.assertEqual(tiling.num_sms(_device(cores=None)), 132)

  @parameterized.parameters(("9.0", ""), ("10.0", ""))
  def test_supported_capabilities_are_available(self, capability, want):
    self.assertEqual(
        backend.gpu_unavailable_reason(_device(capability=capability)), want
    )

  @parameterized.parameters(("8.0", "has 8.0"), ("10.3", "has 10.3"))
  def test_other_capabilities_say_which(self, capability, has):
    reason = backend.gpu_unavailable_reason(_device(capability=capability))
    self.assertIn("compute capability 9.0 or 10.0", reason)
    self.assertIn(f"NVIDIA H100 {has}.", reason)

  def test_off_a_gpu_says_to_interpret(self):
    reason = backend.gpu_unavailable_reason(_device(platform="cpu"))
    self.assertIn("this device is cpu", reason)
    self.assertIn("interpret=True", reason)


if __name__ == "__main__":
  absltest.main()
