"""One process at a time in a run directory: an OS file lock that dies with its holder.

A run directory is locked (``fcntl``-style lock through the ``filelock``
library) while a process trains or executes in it, so two sweeps never run
the same run and a refused attempt cannot touch a finished one. The kernel
releases the lock when the holder dies, so a ``kill -9`` never leaves it
stuck. The holder writes its pid beside the lock, which lets ``lab runs`` tell
a live run (``running``, pid) from an interrupted one (the record says
``running`` but nobody holds the lock).

A parent that holds the lock for a child doing the work (the sweep holds it
while the notebook kernel trains) exports ``LAB_RUN_LOCK=<absolute run dir>``
to the child; :func:`hold` in the child then does not try to lock again.

:func:`inspect` tells what a run directory holds from its record.json (the
single source of a run's status) and its lock, without writing anything;
:func:`move_aside` keeps an old run under a new name instead of deleting it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from .config import ConfigError

LOCK_FILE = ".lock"
PID_FILE = ".lock.pid"
ENV = "LAB_RUN_LOCK"
PARAMS_ENV = "LAB_NOTEBOOK_PARAMS"


class RunLocked(RuntimeError):
    """The run directory is held by another live process."""

    def __init__(self, run_dir: Path, pid: int | None):
        who = f"process {pid}" if pid else "another process"
        super().__init__(f"run directory {run_dir} is in use by {who}; wait for it to finish "
                         "(or stop that process) and run again")
        self.run_dir, self.pid = run_dir, pid


class RunLock:
    """A held lock on one run directory; ``release()`` (or leaving ``with``) frees it."""

    def __init__(self, run_dir: Path, lock: FileLock | None):
        self.run_dir, self._lock = run_dir, lock

    def release(self) -> None:
        if self._lock is not None and self._lock.is_locked:
            # The pid file only names the holder for `lab runs`: failing to remove it (a
            # directory made read-only meanwhile) must not hide the error that ended the run.
            with contextlib.suppress(OSError):
                (self.run_dir / PID_FILE).unlink(missing_ok=True)
            self._lock.release()
        self._lock = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_run_dir(out: Path, name: str = "out_dir") -> None:
    """Refuse a run directory that cannot be created or written, before anything runs;
    ``name`` is what the caller calls it (``--out``, ``out_dir``)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{name} {out} is a file; give a directory for the run")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{name} {out}: {existing} is a file, so the run directory cannot "
                          "be made there; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "the run directory" if existing == out else f"{existing}, where it would be made,"
        raise ConfigError(f"{name} {out}: {what} is not writable; choose a directory you can "
                          "write to")


def _file_lock(run_dir: Path) -> FileLock:
    # thread_local=False: a sweep worker may take and release it from different threads.
    return FileLock(run_dir / LOCK_FILE, thread_local=False)


def acquire(run_dir) -> RunLock:
    """Lock ``run_dir`` (created if missing) without waiting; RunLocked if it is held."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = _file_lock(run_dir)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise RunLocked(run_dir, _pid(run_dir)) from None
    (run_dir / PID_FILE).write_text(f"{os.getpid()}\n")
    return RunLock(run_dir, lock)


def _pid(run_dir: Path) -> int | None:
    try:
        return int((run_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def holder(run_dir) -> int | None:
    """The pid of the live process holding ``run_dir`` (0 if unknown), or None if free."""
    run_dir = Path(run_dir).resolve()
    if not (run_dir / LOCK_FILE).exists():
        return None
    lock = _file_lock(run_dir)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return _pid(run_dir) or 0
    except OSError:  # a read-only directory: nobody can be training in it
        return None
    lock.release()
    return None


def notebook_params(run_dir) -> dict | None:
    """The parameters a parent notebook run declares beyond its config class
    (``LAB_NOTEBOOK_PARAMS``, JSON), for the run directory it holds for us; else None.

    A notebook may declare parameters of its own (a note, a plot setting); they are part
    of what the run was asked, so the trainer's record keeps them (``notebook_params``)
    and a rerun with other values is not "the same parameters".
    """
    if not held_by_parent(run_dir):
        return None
    text = os.environ.get(PARAMS_ENV)
    return json.loads(text) if text else None


def held_by_parent(run_dir) -> bool:
    """True when a parent process holds ``run_dir``'s lock for us (``LAB_RUN_LOCK``)."""
    given = os.environ.get(ENV)
    return bool(given) and Path(given).resolve() == Path(run_dir).resolve()


@contextlib.contextmanager
def hold(run_dir):
    """Hold ``run_dir`` for the block, unless a parent already holds it for this process."""
    if held_by_parent(run_dir):
        yield RunLock(Path(run_dir).resolve(), None)
        return
    lock = acquire(run_dir)
    try:
        yield lock
    finally:
        lock.release()


# ---------------------------------------------------------------------------
# a run's state, read without touching the run


FINISHED = ("complete", "diverged")  # a run that must never be modified by a later attempt


@dataclass(frozen=True)
class RunState:
    """What a run directory holds, decided from record.json and the lock alone.

    ``status``: missing (no record) | running (a live process holds the lock;
    ``pid``) | interrupted (the record says running, nobody holds the lock:
    resumable) | complete | diverged | failed (the record's status) |
    unreadable (``error`` says why).
    """

    status: str
    pid: int | None = None
    record: dict | None = None
    error: str | None = None


def inspect(run_dir, *, locked: bool = False) -> RunState:
    """The state of ``run_dir``; reads only, never creates anything. ``locked``:
    the caller holds the lock itself (so it is not asked who does)."""
    from . import records  # numpy/pandas: only when a record is read

    run_dir = Path(run_dir)
    pid = holder(run_dir) if run_dir.is_dir() and not locked else None
    if pid is not None:
        return RunState("running", pid)
    if not (run_dir / records.RECORD_FILE).exists():
        return RunState("missing")
    try:
        record = records.load_record(run_dir, rows=False)  # status and config only
    except (records.RecordError, OSError) as err:
        return RunState("unreadable", error=str(err))
    status = "interrupted" if record["status"] == "running" else record["status"]
    return RunState(status, record=record)


def move_aside(run_dir) -> Path:
    """Rename ``run_dir`` to ``<name>.old-<UTC time>`` beside it (never deletes);
    RunLocked if a live process works in it. Returns the new path."""
    run_dir = Path(run_dir).resolve()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())  # records.MOVED_ASIDE reads it
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    with acquire(run_dir):
        # The held lock file moves with the directory, so nobody starts in it meanwhile.
        run_dir.rename(target)
        (target / PID_FILE).unlink(missing_ok=True)
    return target
