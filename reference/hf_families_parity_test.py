"""The table of transformers MoE families against transformers itself.

`reference/hf_convert/families.py` lists every family of transformers 5.24
whose modeling file has routed experts; these tests check that it names
them all, and that each row's block and config classes exist.
"""

from __future__ import annotations

from absl.testing import absltest

from reference.hf_convert import families
from reference.hf_convert import parity


class HfFamiliesTableTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if parity.IMPORT_ERROR is not None:
      self.skipTest(parity.SKIP_REASON)

  def test_every_family_names_its_block_and_config_classes(self):
    for family in families.FAMILIES:
      with self.subTest(family.model_type):
        modeling = parity.modeling_module(family.model_type)
        configuration = parity.configuration_module(family.model_type)
        self.assertTrue(hasattr(modeling, family.block), family.block)
        self.assertTrue(hasattr(configuration, family.config), family.config)

  def test_table_covers_every_transformers_moe_family(self):
    self.assertEqual(
        sorted(parity.transformers_moe_families()),
        sorted(f.model_type for f in families.FAMILIES),
    )


if __name__ == "__main__":
  absltest.main()
