"""What the te tests share: skipping, or failing, where TE is missing."""

from __future__ import annotations

import os

from backends.te import _te

# tools/test_te.sh sets it in TE's own environment: there a missing TE is a
# broken environment, not a reason to skip.
EXPECT_TE = "DROPLESS_EXPECT_TE"


def require_te(test) -> None:
  """Skips `test` (an absltest.TestCase) with the reason unless TE imports.

  Under DROPLESS_EXPECT_TE=1 (the TE step of CI) a missing TE is a failure,
  so a broken environment cannot pass as a row of skips.
  """
  ok, reason = _te.installed()
  if ok:
    return
  if os.environ.get(EXPECT_TE) == "1":
    test.fail(f"{EXPECT_TE}=1, but {reason}")
  test.skipTest(reason)
