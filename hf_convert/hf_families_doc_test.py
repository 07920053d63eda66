"""docs/hf_families.md agrees with hf_convert/families.py.

The page is written by hand from the table; this test keeps the two from
drifting: one row per family, in the table's order, with its block class
and whether it is converted, and the headline counts. No torch needed.
"""

from __future__ import annotations

import os

from absl.testing import absltest

from hf_convert import families

_DOC = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "docs", "hf_families.md"
)


def _doc_text() -> str:
  with open(_DOC, encoding="utf-8") as f:
    return f.read()


def _family_rows(text: str) -> list[list[str]]:
  """The cells of each row of the '## The families' table."""
  section = text.split("## The families", 1)[1]
  rows = []
  for line in section.splitlines():
    if not line.startswith("| ") or line.startswith("| model_type"):
      continue
    rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
  return rows


class FamiliesPageTest(absltest.TestCase):

  def test_one_row_per_family_in_the_tables_order(self):
    rows = _family_rows(_doc_text())
    self.assertEqual(
        [row[0] for row in rows], [f.model_type for f in families.FAMILIES]
    )

  def test_block_class_and_converted_column_match(self):
    rows = {row[0]: row for row in _family_rows(_doc_text())}
    for family in families.FAMILIES:
      with self.subTest(family.model_type):
        row = rows[family.model_type]
        self.assertEqual(row[1], f"`{family.block}`")
        converted = row[-1]
        if family.supported:
          self.assertTrue(
              converted.startswith("yes"), f"{family.model_type}: {converted}"
          )
        else:
          self.assertTrue(
              converted.startswith("**no**"),
              f"{family.model_type}: {converted}",
          )
          for lack in family.lacks:
            self.assertIn(lack, converted)

  def test_headline_counts(self):
    text = _doc_text()
    supported = sum(f.supported for f in families.FAMILIES)
    total = len(families.FAMILIES)
    self.assertIn(f"holds {total} families", text)
    self.assertIn(f"**{supported} are converted exactly**", text)
    refused = total - supported
    self.assertIn(f"**{refused} need a switch dropless lacks.**", text)


if __name__ == "__main__":
  absltest.main()
