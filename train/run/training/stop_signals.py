"""SIGINT and SIGTERM deferred: they ask a run to stop after its step.

A run stops between steps, checkpointed and resumable, instead of in the
middle of one. A second Ctrl-C is not deferred: it raises
KeyboardInterrupt at once.
"""

from __future__ import annotations

import contextlib
import signal


class StopSignals:
  """Defers SIGINT and SIGTERM (`deferring`); `received` is the number of
  the last one that arrived meanwhile, or None."""

  def __init__(self):
    self.received: int | None = None
    self._deferring = False

  def _on_signal(self, signum, frame):
    """Asks the loop to stop after the current step (then it checkpoints).

    A second Ctrl-C is not deferred: it raises KeyboardInterrupt at once.
    """
    del frame
    self.received = signum
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)

  @contextlib.contextmanager
  def deferring(self):
    """Inside, SIGINT and SIGTERM set `received` instead of stopping.

    The previous handlers come back on exit. Nested uses are one. Main
    thread only.
    """
    if self._deferring:
      yield
      return
    previous = {
        sig: signal.signal(sig, self._on_signal)
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    self._deferring = True
    try:
      yield
    finally:
      self._deferring = False
      for sig, handler in previous.items():
        signal.signal(sig, handler)
