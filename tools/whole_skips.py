"""Lists the test targets of one `bazel test` whose tests all skipped.

Bazel reports a target whose every test method skipped as PASSED. This
reads the run's Build Event Protocol file (`bazel test
--build_event_json_file=FILE`: one JSON event a line) and each passed
target's JUnit files, prints every target that ran no test method as
"skipped wholly: //pkg:target (reason)", and exits 1 if one of them does
not declare it with a `skips-without-<what>` tag whose <what> this machine
lacks (docs/testing.md, "Compilation cache, skips and tags"). Usage:
  python tools/whole_skips.py BEP_FILE
"""

from __future__ import annotations

import collections
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET

TAG_PREFIX = "skips-without-"
# "[  SKIPPED ] Class.test_name - reason", a parameterized name with its
# parameters: "Class.test_name0 (True) - reason".
_SKIPPED = re.compile(r"^\[  SKIPPED \] \S+(?: \(.*?\))? - (.*)$", re.MULTILINE)
_PASSED = ("PASSED", "FLAKY")


def _module(name: str):
  """A probe: whether `name` can be imported here (not importing it)."""

  def probe() -> bool:
    try:
      return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # Its parent package is missing.
      return False

  return probe


def _jax_at_least(major: int, minor: int):
  """A probe: whether the installed jax is at least major.minor."""

  def probe() -> bool:
    try:
      version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
      return False
    return tuple(int(p) for p in version.split(".")[:2]) >= (major, minor)

  return probe


def _nvidia_gpu() -> bool:
  """Whether `nvidia-smi -L` lists a GPU."""
  if shutil.which("nvidia-smi") is None:
    return False
  try:
    done = subprocess.run(
        ["nvidia-smi", "-L"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
  except (OSError, subprocess.TimeoutExpired):
    return False
  return done.returncode == 0 and "GPU " in done.stdout


# <what> of a `skips-without-<what>` tag -> (what it is, probe: present here).
# The probes run in the interpreter that runs this script (tools/test.sh
# runs it with the leg's).
CONDITIONS = {
    "gpu": ("NVIDIA GPU", _nvidia_gpu),
    "torch": ("torch", _module("torch")),
    "transformers": ("transformers", _module("transformers")),
    "te": ("Transformer Engine", _module("transformer_engine")),
    "jax-triton": ("jax-triton", _module("jax_triton")),
    "jax-0.11": ("jax 0.11 or newer", _jax_at_least(0, 11)),
}


def _path(uri: str) -> str:
  return urllib.request.url2pathname(urllib.parse.urlparse(uri).path)


def read_events(bep_lines) -> tuple[dict, dict, dict]:
  """From BEP JSON lines: ({label: tags}, {label: overall status},
  {label: {(run, shard): {output name: path}}} of each shard's last
  attempt)."""
  tags, status, outputs = {}, {}, collections.defaultdict(dict)
  attempts = {}
  for line in bep_lines:
    if not line.strip():
      continue
    event = json.loads(line)
    ids = event.get("id", {})
    if "targetConfigured" in ids and "configured" in event:
      label = ids["targetConfigured"]["label"]
      tags[label] = event["configured"].get("tag", [])
    elif "testSummary" in ids and "testSummary" in event:
      label = ids["testSummary"]["label"]
      status[label] = event["testSummary"].get("overallStatus", "")
    elif "testResult" in ids and "testResult" in event:
      key = ids["testResult"]
      label, shard = key["label"], (key.get("run", 1), key.get("shard", 1))
      attempt = key.get("attempt", 1)
      if attempts.get((label, shard), 0) > attempt:
        continue
      attempts[label, shard] = attempt
      outputs[label][shard] = {
          o["name"]: _path(o["uri"])
          for o in event["testResult"].get("testActionOutput", [])
          if o.get("uri", "").startswith("file:")
      }
  return tags, status, dict(outputs)


def _read(path: str) -> str | None:
  try:
    with open(path, encoding="utf-8", errors="replace") as fh:
      return fh.read()
  except OSError:
    return None


def count_methods(xml_text: str) -> tuple[int, int]:
  """(test methods, skipped ones) of a JUnit file.

  absltest writes a skipped method as status="notrun".
  """
  root = ET.fromstring(xml_text)
  cases = list(root.iter("testcase"))
  skipped = sum(
      1
      for c in cases
      if c.get("status") == "notrun" or c.find("skipped") is not None
  )
  return len(cases), skipped


def whole_skip_reason(shards: dict) -> str | None:
  """Why every method of a target's shards skipped, or None if one ran (or
  its methods cannot be counted: no JUnit file).

  The reason is the one its log gives ("[  SKIPPED ] Class.test - reason").
  """
  total = skipped = 0
  reasons = collections.Counter()
  for files in shards.values():
    xml_text = _read(files.get("test.xml", ""))
    if xml_text is None:
      return None
    n, s = count_methods(xml_text)
    total, skipped = total + n, skipped + s
    reasons.update(_SKIPPED.findall(_read(files.get("test.log", "")) or ""))
  if skipped < total:
    return None
  if not reasons:
    return "ran no test method" if not total else "no reason in the log"
  (reason, _), *others = reasons.most_common()
  if others:
    reason += f"; and {len(others)} other reason(s)"
  return reason


def missing_here(target_tags, probes=None) -> tuple[list[str], list[str]]:
  """(the declared conditions this machine lacks, unknown ones)."""
  probes = CONDITIONS if probes is None else probes
  lacking, unknown = [], []
  for tag in target_tags:
    if not tag.startswith(TAG_PREFIX):
      continue
    what = tag[len(TAG_PREFIX) :]
    if what not in probes:
      unknown.append(tag)
    elif not probes[what][1]():
      lacking.append(f"{tag}: no {probes[what][0]} here")
  return lacking, unknown


def check(bep_lines, out=sys.stdout, probes=None) -> int:
  """Prints the whole skips of a run; 1 if one is not expected here.

  The Build Event Protocol lines name exactly the targets that run tested
  (the legs filter differently), cached ones included. For each target
  that passed, its shards' JUnit methods are counted; one that ran none is
  printed as

    skipped wholly: //pkg:target (reason)

  and is expected only where the target declares it: a tag
  `skips-without-<what>` (CONDITIONS) whose <what> this machine lacks. Any
  other whole skip, or a tag naming no known <what>, returns 1.
  """
  tags, status, outputs = read_events(bep_lines)
  unexpected = 0
  for label in sorted(outputs):
    if status.get(label) not in _PASSED:
      continue  # Bazel already failed the run for it.
    reason = whole_skip_reason(outputs[label])
    if reason is None:
      continue
    lacking, unknown = missing_here(tags.get(label, []), probes)
    print(f"skipped wholly: {label} ({reason})", file=out)
    if unknown:
      unexpected += 1
      print(f"  UNKNOWN tag {unknown}: known {sorted(CONDITIONS)}", file=out)
    elif lacking:
      print(f"  expected: {'; '.join(lacking)}", file=out)
    else:
      unexpected += 1
      print(
          f"  NOT EXPECTED here: it declares no {TAG_PREFIX}<what> tag "
          "naming something this machine lacks",
          file=out,
      )
  if unexpected:
    print(
        f"whole skips: {unexpected} target(s) passed without running a "
        "test, not declared for this machine (tools/whole_skips.py)",
        file=out,
    )
    return 1
  return 0


def main(argv) -> int:
  if len(argv) != 2:
    print(__doc__, file=sys.stderr)
    return 2
  with open(argv[1], encoding="utf-8") as fh:
    return check(fh)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
