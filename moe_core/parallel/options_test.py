"""Tests of the EP options and buffer sizing: pure Python, no devices."""

import itertools
import math

from absl.testing import absltest
from absl.testing import parameterized

from moe_core import parallel


class BufferBoundTest(parameterized.TestCase):

  @parameterized.product(num_experts=[4, 6, 8], ep=[1, 2], top_k=[1, 2, 3])
  def test_safe_slots_is_the_most_one_token_can_send_a_device(
      self, num_experts, ep, top_k
  ):
    if num_experts % ep or top_k > num_experts:
      self.skipTest("not a valid layout")
    local = num_experts // ep
    # Every set of K distinct experts a token could choose; count those on
    # device 0 (experts [0, local)), the same for every device by symmetry.
    most = max(
        sum(e < local for e in chosen)
        for chosen in itertools.combinations(range(num_experts), top_k)
    )
    for tokens in (1, 5):
      self.assertEqual(
          parallel.safe_slots_per_peer(tokens, top_k, local), tokens * most
      )

  def test_bounded_buffers_never_exceed_the_safe_ones(self):
    for factor in (0.25, 1.0, 1.5, 100.0):
      slots, rows = parallel.buffer_sizes(12, 3, 16, 4, factor)
      safe_slots, safe_rows = parallel.buffer_sizes(12, 3, 16, 4, None)
      self.assertLessEqual(slots, safe_slots)
      self.assertLessEqual(rows, safe_rows)
      self.assertGreaterEqual(
          slots, math.ceil(min(factor * 12 * 3 / 4, safe_slots))
      )
    self.assertEqual(
        parallel.buffer_sizes(12, 3, 16, 4, 100.0),
        parallel.buffer_sizes(12, 3, 16, 4, None),
    )

  @parameterized.parameters(None, 0.5, 2.0)
  def test_each_exchange_sizes_its_buffer_as_documented(self, factor):
    slots, rows = parallel.buffer_sizes(12, 3, 16, 4, factor)
    for name, want in (
        ("padded", slots),
        ("ragged", rows),
        ("ragged_emulated", rows),
    ):
      got = parallel.get_exchange(name).capacity(12, 3, 16, 4, factor)
      self.assertEqual(got, want, name)


class OptionsTest(absltest.TestCase):

  def test_options_are_validated(self):
    cases = [
        (dict(exchange="nccl"), r"exchange must be one of .*got 'nccl'"),
        (dict(overflow="ignore"), r"overflow must be one of .*got 'ignore'"),
        (
            dict(buffer_factor=0),
            r"buffer_factor must be None \(drop-free\) "
            r"or a finite number > 0, got 0",
        ),
        (dict(num_chunks=0), r"num_chunks must be a positive int, got 0"),
    ]
    for kwargs, message in cases:
      with (
          self.subTest(str(kwargs)),
          self.assertRaisesRegex(ValueError, message),
      ):
        parallel.EPOptions(**kwargs)

  def test_auto_picks_ragged_where_xla_has_it(self):
    for platform in ("gpu", "cuda", "rocm", "tpu"):
      self.assertEqual(parallel.resolve_exchange("auto", platform), "ragged")
    self.assertEqual(parallel.resolve_exchange("auto", "cpu"), "padded")
    self.assertEqual(
        parallel.resolve_exchange("ragged_emulated", "tpu"), "ragged_emulated"
    )

  def test_every_exchange_name_has_its_class(self):
    self.assertEqual(parallel.EXCHANGES[0], "auto")
    for name in parallel.EXCHANGES[1:]:
      with self.subTest(name):
        exchange = parallel.get_exchange(name)
        self.assertIsInstance(exchange, parallel.Exchange)
        self.assertEqual(exchange.name, name)

  def test_a_package_registers_its_exchange(self):
    self.addCleanup(parallel.EXCHANGE_CLASSES.pop, "toy_padded", None)
    with self.assertRaisesRegex(
        ValueError, r"exchange must be one of \('auto', 'ragged'.*'toy_padded'"
    ):
      parallel.EPOptions(exchange="toy_padded")
    parallel.register_exchange(
        "toy_padded", "moe_core.parallel.padded:PaddedExchange"
    )
    self.assertIn("toy_padded", parallel.exchange_names())
    self.assertNotIn("toy_padded", parallel.EXCHANGES)  # The core's only.
    self.assertEqual(
        parallel.EPOptions(exchange="toy_padded").exchange, "toy_padded"
    )
    self.assertIsInstance(
        parallel.get_exchange("toy_padded"), parallel.Exchange
    )
    # "auto" picks the core's exchanges only.
    self.assertEqual(parallel.resolve_exchange("auto", "gpu"), "ragged")
    # The same target again is a no-op; another needs overwrite=True.
    parallel.register_exchange(
        "toy_padded", "moe_core.parallel.padded:PaddedExchange"
    )
    with self.assertRaisesRegex(ValueError, "already registered"):
      parallel.register_exchange(
          "toy_padded", "moe_core.parallel.ragged:RaggedExchange"
      )

  def test_register_exchange_checks_its_arguments(self):
    for name, target, why in (
        ("auto", "m:C", "not 'auto'"),
        ("", "m:C", "non-empty"),
        ("x", "no_colon", "'module:Class'"),
    ):
      with (
          self.subTest(name=name, target=target),
          self.assertRaisesRegex(ValueError, why),
      ):
        parallel.register_exchange(name, target)

  def test_auto_is_not_an_exchange_class(self):
    with self.assertRaisesRegex(ValueError, r"resolve 'auto' first"):
      parallel.get_exchange("auto")


if __name__ == "__main__":
  absltest.main()
