"""pytest: list why tests were skipped, even without -rs."""

import collections


def pytest_terminal_summary(terminalreporter):
  reasons = collections.Counter()
  for report in terminalreporter.stats.get("skipped", []):
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reasons[reason.removeprefix("Skipped: ")] += 1
  if reasons:
    terminalreporter.write_sep("-", "skip reasons")
    for reason, count in reasons.most_common():
      terminalreporter.write_line(f"{count} tests: {reason}")
