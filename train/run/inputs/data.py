"""Byte-level text data: the embedded pydoc_data corpus or any file.

The default corpus is the standard library's `pydoc_data.topics` (the
Python language reference's topics, ~0.46 MB of English prose and code),
which ships with every CPython, so training works offline on a fresh
machine. Tokens are the UTF-8 bytes (vocabulary 256).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from pydoc_data import topics

import numpy as np

VOCAB_SIZE = 256
HELD_OUT_EVERY = 10  # One chunk in ten is held out.
CHUNK_BYTES = 4096  # The text is cut into chunks of this many bytes.


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Train and held-out byte streams.

  Attributes:
    name: where the text came from.
    train: [N] uint8 bytes.
    held_out: [M] uint8 bytes.
    sha256: hex SHA-256 of the whole text (both splits): what a checkpoint
      records, so that a resume can tell changed contents under the same
      name ("" where unknown).
  """

  name: str
  train: np.ndarray
  held_out: np.ndarray
  sha256: str = ""


def _split(raw: bytes, name: str) -> Corpus:
  """Cuts `raw` into CHUNK_BYTES chunks; every HELD_OUT_EVERY-th is held out.

  Interleaving (rather than taking the tail) spreads both splits over the
  whole text, so the held-out loss is not about one topic.
  """
  chunks = [raw[i : i + CHUNK_BYTES] for i in range(0, len(raw), CHUNK_BYTES)]
  if len(chunks) < HELD_OUT_EVERY:
    raise ValueError(
        f"text {name!r} has {len(raw)} bytes; a held-out split needs at "
        f"least {HELD_OUT_EVERY * CHUNK_BYTES}."
    )
  held = [i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for i in range(len(chunks))]
  join = lambda parts: np.frombuffer(b"".join(parts), np.uint8).copy()
  return Corpus(
      name=name,
      train=join([c for c, h in zip(chunks, held) if not h]),
      held_out=join([c for c, h in zip(chunks, held) if h]),
      # About 1 GB/s: a second per GB of text, once per run.
      sha256=hashlib.sha256(raw).hexdigest(),
  )


def load_pydoc_topics() -> Corpus:
  """The embedded corpus: every pydoc_data topic, by name, blank-line joined."""
  text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
  return _split(text.encode("utf-8"), "pydoc_data.topics")


def load_text_file(path: str) -> Corpus:
  """Any file, read as bytes."""
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"--data must name a readable text file, got " f"{path!r} (not a file)."
    )
  with open(path, "rb") as f:
    return _split(f.read(), path)


def load(path: str | None = None) -> Corpus:
  return load_text_file(path) if path else load_pydoc_topics()


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy of the byte distribution of `tokens`, in nats per byte."""
  counts = np.bincount(tokens, minlength=VOCAB_SIZE).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def unigram_cross_entropy(train: np.ndarray, held_out: np.ndarray) -> float:
  """Held-out loss of the best context-free model fitted on `train`.

  Add-one smoothing keeps bytes unseen in train finite. This is the loss a
  language model must beat to have learned anything beyond byte frequencies.
  """
  counts = np.bincount(train, minlength=VOCAB_SIZE).astype(np.float64) + 1.0
  log_p = np.log(counts / counts.sum())
  return float(-log_p[held_out].mean())


class BatchSampler:
  """Deterministic, resumable batches of windows [B, seq_len + 1].

  Each epoch shuffles the non-overlapping windows of the stream (starting at
  a per-epoch random shift) with a generator seeded by (seed, epoch). The
  position (epoch, index) is all the state there is: `state()` and
  `restore()` make a resumed run draw exactly the batches the uninterrupted
  run would have.
  """

  def __init__(
      self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int
  ):
    window = seq_len + 1
    if len(tokens) < window * batch_size + window:
      raise ValueError(
          f"the training text has {len(tokens)} bytes; batch_size="
          f"{batch_size} x (seq_len + 1)={window} needs at least "
          f"{window * (batch_size + 1)}."
      )
    self.tokens = tokens
    self.batch_size = batch_size
    self.window = window
    self.seed = seed
    self.epoch = 0
    self.index = 0
    self._order = self._epoch_order(0)

  def _epoch_order(self, epoch: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, epoch])
    shift = int(rng.integers(self.window))
    starts = np.arange(shift, len(self.tokens) - self.window + 1, self.window)
    return rng.permutation(starts)

  @property
  def batches_per_epoch(self) -> int:
    return len(self._order) // self.batch_size

  def next_starts(self) -> np.ndarray:
    """The next batch's window starts [B] (offsets into the token stream).

    Cheap: it reads no text, so each process of a multi-process run can
    draw the whole batch's positions and `read` only its own rows.
    """
    if self.index + self.batch_size > len(self._order):
      self.epoch += 1
      self.index = 0
      self._order = self._epoch_order(self.epoch)
    starts = self._order[self.index : self.index + self.batch_size]
    self.index += self.batch_size
    return starts

  def read(self, starts: np.ndarray) -> np.ndarray:
    """The windows at `starts` [n] as int32 [n, seq_len + 1]."""
    if not len(starts):
      return np.zeros((0, self.window), np.int32)
    return np.stack([self.tokens[s : s + self.window] for s in starts]).astype(
        np.int32
    )

  def next(self) -> np.ndarray:
    """[B, seq_len + 1] int32; the last partial batch of an epoch is skipped."""
    return self.read(self.next_starts())

  def state(self) -> dict[str, int]:
    return {"epoch": self.epoch, "index": self.index}

  def restore(self, state: dict[str, int]) -> None:
    self.epoch = int(state["epoch"])
    self.index = int(state["index"])
    self._order = self._epoch_order(self.epoch)


def eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int
) -> list[np.ndarray]:
  """Fixed held-out batches: windows evenly spread over the held-out text."""
  window = seq_len + 1
  available = (len(tokens) - window) // window + 1
  count = min(available, max_batches * batch_size)
  if count < 1:
    raise ValueError(
        f"the held-out text has {len(tokens)} bytes, fewer than "
        f"seq_len + 1 = {window}."
    )
  starts = np.linspace(0, len(tokens) - window, count).astype(np.int64)
  windows = np.stack([tokens[s : s + window] for s in starts]).astype(np.int32)
  n = math.ceil(count / batch_size)
  return [windows[i * batch_size : (i + 1) * batch_size] for i in range(n)]
