"""One training run per --output_dir: an exclusive lock on a file in it.

`OutputDirLock.acquire` takes an exclusive `flock` on LOCK_FILE in the
directory and records the holder (host, pid, start time) there, so that a
second run is refused with a message naming the first; the operating
system drops the lock when its process ends, so a dead run never blocks
the next. On filesystems without file locks the record alone decides
(docs/training.md, "One run per output directory"). The lock file is
opened without following a symbolic link, and only a regular file of one
name that is empty or holds such a record is ever written: a file this
program did not write is refused (`OutputDirLockError`), never emptied.
"""

# Nothing from JAX is imported here: a test can take a lock from a
# subprocess in a fraction of a second.
from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
import stat

# In --output_dir; hidden, like the other bookkeeping files of a run.
LOCK_FILE = ".dropless_train.lock"

# flock's errors on filesystems without (working) file locks: NFS without
# lockd (ENOLCK), some FUSE and network filesystems (ENOSYS, EOPNOTSUPP).
_NO_LOCKS = frozenset((errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP))
# flock's errors when another open file holds the lock.
_HELD = frozenset((errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES))


# A holder's record is one short line of JSON; a longer file is not one.
_MAX_RECORD_BYTES = 4096


class OutputDirBusyError(ValueError):
  """Another training run holds the lock of the output directory."""


class OutputDirLockError(OSError):
  """The output directory's lock file cannot be used: the directory or the
  file cannot be created, opened or written, or the file is a symbolic
  link, not a regular file, another file's name too (a hard link), or holds
  something this program did not write. One line naming the directory, the
  file and the cause."""


@dataclasses.dataclass(frozen=True)
class Holder:
  """Who holds (or last held) a lock, as its lock file records it.

  Attributes:
    host: `socket.gethostname()` of the holder.
    pid: its process id on that host.
    since: when it took the lock (ISO 8601, local time).
  """

  host: str
  pid: int
  since: str

  @classmethod
  def this_process(cls) -> Holder:
    return cls(
        host=socket.gethostname(),
        pid=os.getpid(),
        since=datetime.datetime.now().isoformat(timespec="seconds"),
    )

  def describe(self) -> str:
    return f"pid {self.pid} on host {self.host} (since {self.since})"

  def on_this_host(self) -> bool:
    return self.host == socket.gethostname()


def pid_alive(pid: int) -> bool:
  """Whether process `pid` exists on this host (signal 0 probes it)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # It exists, under another user.
  return True


def _read_holder(fd: int) -> Holder | None:
  """The record in the lock file open as `fd`; None if empty or unreadable.

  A holder writes its record right after it takes the lock, so a reader
  may find the file empty for that instant.
  """
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, _MAX_RECORD_BYTES)
    record = json.loads(data.decode()) if data.strip() else None
    if record is None:
      return None
    return Holder(
        host=str(record["host"]),
        pid=int(record["pid"]),
        since=str(record.get("since", "?")),
    )
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _not_ours(fd: int) -> str | None:
  """Why the file open as `fd` is not one this program may write (not a
  regular file, a hard link, or content other than a holder's record), or
  None. (`OutputDirLock._open` refuses a symbolic link.)

  Read under the lock, where one is held: a holder writes its record in
  one small write, so it is then whole or absent.
  """
  info = os.fstat(fd)
  if not stat.S_ISREG(info.st_mode):
    return "it is not a regular file"
  if info.st_nlink != 1:
    return (
        f"it has {info.st_nlink} names (hard links), so writing it would "
        "change another file"
    )
  if info.st_size == 0:
    return None
  if info.st_size > _MAX_RECORD_BYTES or _read_holder(fd) is None:
    return (
        f"it holds {info.st_size} bytes that are not a training run's "
        "record, so this program did not write it"
    )
  return None


def _write_holder(fd: int, holder: Holder) -> None:
  os.ftruncate(fd, 0)
  os.lseek(fd, 0, os.SEEK_SET)
  os.write(fd, (json.dumps(dataclasses.asdict(holder)) + "\n").encode())
  os.fsync(fd)


def _cause(error: OSError) -> str:
  """An OSError's cause in words, without its repeated file name."""
  return error.strerror or str(error)


class OutputDirLock:
  """The exclusive lock of one output directory.

      lock = output_lock.OutputDirLock(run.output_dir).acquire()
      ...  # only this process writes checkpoints/ and metrics.jsonl
      lock.release()

  Attributes:
    directory: the output directory.
    path: its lock file.
    note: after `acquire`, "" or one line about how the lock was taken
      (the filesystem has no file locks), for the run's log.
  """

  def __init__(self, directory: str):
    self.directory = directory
    self.path = os.path.join(directory, LOCK_FILE)
    self.note = ""
    self._fd: int | None = None

  @property
  def held(self) -> bool:
    return self._fd is not None

  def _busy(self, holder: Holder | None, *, checkable: bool = True):
    if holder is None:
      who = "a run that has not yet recorded its host and pid"
    else:
      who = holder.describe()
      if holder.on_this_host() and not pid_alive(holder.pid):
        # The lock is held, yet the recorded process is gone: a process it
        # forked (and that inherited the open file) still holds it.
        who += ", which has exited; a process it started still holds it"
    hint = "wait for that run to end or stop it, or pass another --output_dir"
    if not checkable:
      hint = (
          "this filesystem has no file locks, so whether that run still "
          f"runs cannot be checked from here: delete {self.path!r} if it "
          "has ended, or pass another --output_dir"
      )
    return OutputDirBusyError(
        f"--output_dir={self.directory!r} is in use by another training run: "
        f"{who} holds its lock {self.path!r}; {hint}."
    )

  def _unusable(self, cause: str, *, refused: bool = False):
    """The OutputDirLockError of `cause`: an OSError's words, or (with
    `refused`) why the file is not one this program may write."""
    hint = "pass another --output_dir"
    if refused:
      hint = (
          "this program never writes through a link or over a file it did "
          f"not write: move it away, or {hint}"
      )
    return OutputDirLockError(
        f"--output_dir={self.directory!r}: cannot take its lock "
        f"{self.path!r}: {cause}; {hint}."
    )

  def _open(self) -> int:
    """The lock file, created if absent, opened without following a link."""
    try:
      os.makedirs(self.directory, exist_ok=True)
      return os.open(
          self.path,
          os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
          0o644,
      )
    except OSError as e:
      if e.errno == errno.ELOOP and os.path.islink(self.path):
        raise self._unusable(
            f"it is a symbolic link (to {os.readlink(self.path)!r})",
            refused=True,
        ) from e
      raise self._unusable(_cause(e)) from e

  def acquire(self) -> OutputDirLock:
    """Takes the lock (creating the directory), or raises.

    Takes `flock(LOCK_EX | LOCK_NB)` on `<output_dir>/LOCK_FILE`, then writes
    the holder (host, pid, start time) into the file, for the message another
    run gets. The operating system drops the lock when its process ends,
    however it ends (SIGKILL, a crash, a power cut on a local disk), so a
    lock left by a dead run never blocks the next one; the record it left is
    just overwritten.

    Where the filesystem has no file locks (flock fails with one of
    `_NO_LOCKS`), the record alone decides: a holder on this host whose pid
    no longer runs is stale and taken over; a live one, or one on another
    host (whose pid cannot be checked from here), refuses the run, naming
    the file to delete once that run has ended. This fallback has a race
    (two runs started within the same instant may both go ahead); `note`
    says it is in use.

    Returns:
      self, now holding the lock.

    Raises:
      OutputDirBusyError: another run holds it; one line naming the
        directory and the holder (host, pid).
      OutputDirLockError: an OSError: the directory or lock file cannot be
        created, opened or written, or the lock file is a symbolic link,
        not a regular file, a hard link, or holds something else than a
        run's record (none of which is written); one line naming the
        directory, the file and the cause.
    """
    if self._fd is not None:
      return self
    fd = self._open()
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno in _HELD:
          raise self._busy(_read_holder(fd)) from None
        if e.errno not in _NO_LOCKS:
          raise self._unusable(_cause(e)) from e
        self._acquire_by_record(fd, e)
      why = _not_ours(fd)
      if why:
        raise self._unusable(why, refused=True)
      _write_holder(fd, Holder.this_process())
    except OSError as e:
      os.close(fd)
      if isinstance(e, OutputDirLockError):
        raise
      raise self._unusable(_cause(e)) from e
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd
    return self

  def _acquire_by_record(self, fd: int, error: OSError) -> None:
    """No file locks here: the recorded holder decides (see the module)."""
    holder = _read_holder(fd)
    if holder is not None:
      if not holder.on_this_host():
        raise self._busy(holder, checkable=False) from None
      if pid_alive(holder.pid):
        raise self._busy(holder) from None
    self.note = (
        f"note: {self.directory!r} is on a filesystem without file locks "
        f"({os.strerror(error.errno)}); the run is guarded only by the "
        f"host and pid recorded in {self.path!r}"
    )

  def release(self) -> None:
    """Empties the record and drops the lock; safe to repeat.

    The file is emptied before it is unlocked, so a record only survives a
    run that did not end cleanly.
    """
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)  # A clean end leaves no holder behind.
    except OSError:
      pass  # The lock goes with the file descriptor all the same.
    finally:
      os.close(fd)  # Closing drops the flock.

  def __enter__(self) -> OutputDirLock:
    return self.acquire()

  def __exit__(self, *exc_info) -> None:
    self.release()
