"""One process at a time in a run directory: a ``filelock`` lock that dies with its holder.

A run directory is locked (``<run>/.lock``, an OS lock the kernel drops when the holder
dies, so a ``kill -9`` never leaves it stuck) while a process trains or executes in it:
two sweeps never run the same run, and a refused attempt cannot touch a finished one.
The holder writes its pid beside the lock (``.lock.pid``) so a refusal and ``lab runs``
can name it.

Readers (``lab runs``, a sweep's plan) test the lock by taking it for an instant. A
writer that finds it taken while no live holder is named waits that instant out
(:data:`READER_GRACE_S`), so a status check never makes a run fail to start.

A parent that holds the lock for a child doing the work (the notebook executor holds it
while the kernel trains) exports ``LAB_RUN_LOCK=<absolute run dir>``; :func:`hold` in
the child then does not lock again. :class:`DirWatch` notices a locked directory renamed
or deleted under a run (writing by its old path would split the run in two).

:func:`check_run_dir` and :func:`check_runs_dir` refuse, before anything is made, a
directory that cannot be written or that would nest one run in another. :func:`inspect`
reads a run's status from its lock and its record's JSON; the record's fields and rows
are ``lab.records``' to check (``lab.notebook.run_state``): this module imports neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from .config import ConfigError

LOCK_FILE = ".lock"
PID_FILE = ".lock.pid"
ENV = "LAB_RUN_LOCK"
PARAMS_ENV = "LAB_NOTEBOOK_PARAMS"
CODE_ENV = "LAB_NOTEBOOK_CODE"
RECORD_FILE = "record.json"  # lab.records.RECORD_FILE (records imports this module)
# What marks a run's directory from its first moment: the lock it takes first, then its
# checkpoint (lab.lifecycle.CHECKPOINT), row store (lab.records.ROWS_DIR) and record.
RUN_MARKERS = (RECORD_FILE, LOCK_FILE, "checkpoint.pt", "rows")
# How long a writer waits for a reader's instant check to end before it gives up.
READER_GRACE_S = 2.0
FINISHED = ("complete", "diverged")  # a run that must never be modified by a later attempt


class RunLocked(RuntimeError):
    """The run directory is held by another live process."""

    def __init__(self, run_dir: Path, pid: int | None):
        who = f"process {pid}" if pid else "another process"
        super().__init__(f"run directory {run_dir} is in use by {who}; wait for it to finish "
                         "(or stop that process) and run again")
        self.run_dir, self.pid = run_dir, pid


class RunMoved(OSError):
    """The run directory was renamed or deleted while a process worked in it; ``now`` is
    where it is now (None when the OS cannot tell, or it was deleted)."""

    def __init__(self, message: str, now: str | None = None):
        super().__init__(message)
        self.now = now


class DirWatch:
    """Notices that a directory is no longer at its path (renamed, deleted, replaced).

    It keeps the directory open, so the error can say where it went (Linux
    ``/proc/self/fd``), and compares (device, inode) of the path with the open one's.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.fd: int | None = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        self._id = _identity(os.fstat(self.fd))

    def moved(self) -> bool:
        """True if the path no longer names the directory opened (renamed, deleted)."""
        if self.fd is None:
            return False
        try:
            return _identity(os.stat(self.path)) != self._id
        except OSError:
            return True

    def check(self) -> None:
        """RunMoved, naming both paths where the new one can be found, if the directory
        left its path."""
        if not self.moved():
            return
        now = _fd_path(self.fd)
        where = f"was moved to {now}" if now else "was moved or deleted"
        kept = (f" The rows saved so far are in {now}: give that directory to resume there"
                if now else "")
        raise RunMoved(f"run directory {self.path} {where} while the run worked in it; "
                       f"stopped without writing to {self.path}, so the run is not split in "
                       f"two.{kept}", now)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.fd = None


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino


def _fd_path(fd: int) -> str | None:
    """The current path of an open directory where the OS tells it (Linux), else None."""
    with contextlib.suppress(OSError):
        link = os.readlink(f"/proc/self/fd/{fd}")  # "<path> (deleted)" when deleted
        return link if link.startswith("/") and not link.endswith(" (deleted)") else None
    return None


class RunLock:
    """A held lock on one run directory; ``release()`` (or leaving ``with``) frees it.

    ``lock`` is None when a parent process holds the lock for us (``LAB_RUN_LOCK``); the
    directory is watched either way (the lock moves with it if it is renamed).
    """

    def __init__(self, run_dir: Path, lock: FileLock | None, watch: DirWatch):
        self.run_dir, self._lock, self.watch = run_dir, lock, watch

    def check_in_place(self) -> None:
        """RunMoved if the locked directory was renamed or deleted since it was locked."""
        self.watch.check()

    def release(self) -> None:
        if self._lock is not None:
            # The pid file only names the holder: failing to remove it (a directory made
            # read-only meanwhile) must not hide the error that ended the run. Removed
            # through the open directory, which may have been renamed meanwhile.
            with contextlib.suppress(OSError):
                os.unlink(PID_FILE, dir_fd=self.watch.fd)
            self._lock.release()
        self.watch.close()
        self._lock = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _file_lock(path: Path) -> FileLock:
    # One lock object per attempt, shared by the threads of the process that holds it.
    return FileLock(path, thread_local=False)


def acquire(run_dir) -> RunLock:
    """Lock ``run_dir`` (created if missing) without waiting for another writer;
    RunLocked if one holds it. A reader's instant check is waited out."""
    run_dir = Path(run_dir).resolve()
    deadline = time.monotonic() + READER_GRACE_S
    while True:
        run_dir.mkdir(parents=True, exist_ok=True)
        watch = DirWatch(run_dir)
        lock = _file_lock(run_dir / LOCK_FILE)
        try:
            lock.acquire(blocking=False)
        except Timeout:
            watch.close()
            # A writer names itself at once; a lock held with no live holder named is a
            # reader's instant check (or a writer about to name itself): wait it out.
            pid = live_pid(run_dir)
            if pid or time.monotonic() > deadline:
                raise RunLocked(run_dir, pid) from None
            time.sleep(0.002)
            continue
        except BaseException:
            watch.close()
            raise
        if watch.moved():  # moved aside while we took it: that lock guards the old run
            lock.release()
            watch.close()
            continue
        try:
            (run_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        except BaseException:
            lock.release()
            watch.close()
            raise
        return RunLock(run_dir, lock, watch)


def live_pid(run_dir) -> int | None:
    """The pid in ``run_dir``'s pid file if that process is alive, else None (a pid file
    left by a killed holder names a dead process)."""
    try:
        pid = int((Path(run_dir) / PID_FILE).read_text().strip())
        os.kill(pid, 0)
    except PermissionError:
        return pid  # alive, another user's
    except (OSError, ValueError, OverflowError):
        return None
    return pid if pid > 0 else None


def holder(run_dir) -> int | None:
    """The pid of the live process holding ``run_dir`` (0 if unknown), or None if free.

    Tested by taking the lock for an instant (a writer acquiring meanwhile waits it out,
    see :func:`acquire`); a directory without a lock file is free and is not touched.
    """
    path = Path(run_dir).resolve() / LOCK_FILE
    if not path.is_file():
        return None
    probe = _file_lock(path)
    try:
        probe.acquire(blocking=False)
    except Timeout:
        return live_pid(path.parent) or 0
    except OSError:  # unreadable (another user's run): nobody can be told to train there
        return None
    probe.release()
    return None


def held_by_parent(run_dir) -> bool:
    """True when a parent process holds ``run_dir``'s lock for us (``LAB_RUN_LOCK``)."""
    given = os.environ.get(ENV)
    return bool(given) and Path(given).resolve() == Path(run_dir).resolve()


def _from_parent(run_dir, variable: str):
    text = os.environ.get(variable) if held_by_parent(run_dir) else None
    return json.loads(text) if text else None


def notebook_params(run_dir) -> dict | None:
    """The parameters a parent notebook run declares beyond its config class
    (``LAB_NOTEBOOK_PARAMS``, JSON), for the run directory it holds for us; else None.
    They are part of what the run was asked: the trainer's record keeps them."""
    return _from_parent(run_dir, PARAMS_ENV)


def notebook_code(run_dir) -> dict | None:
    """The identity of the parent notebook's code (``LAB_NOTEBOOK_CODE``, JSON: see
    ``lab.notebook.code_identity``) for the run directory it holds for us; else None.
    A trainer's record keeps it as ``code`` from its first write."""
    return _from_parent(run_dir, CODE_ENV)


@contextlib.contextmanager
def hold(run_dir):
    """Hold ``run_dir`` for the block, unless a parent already holds it for this process."""
    if held_by_parent(run_dir):
        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)  # (the parent may not have made it)
        lock = RunLock(run_dir, None, DirWatch(run_dir))
    else:
        lock = acquire(run_dir)
    try:
        yield lock
    finally:
        lock.release()


# ---------------------------------------------------------------------------
# where a run may be made

NAME_MAX = 255  # bytes in one path part: the limit of ext4, xfs, btrfs, APFS


def check_writable_dir(out, name: str, purpose: str = "the run") -> None:
    """Refuse a directory that cannot be created or written, before anything runs;
    ``name`` is what the caller calls it (``--out``, ``out_dir``), ``purpose`` what the
    directory is for ("the run", "the reports")."""
    out = Path(out)
    what = f"{purpose} directory"
    for part in out.expanduser().parts:
        size = len(os.fsencode(part))
        if size > NAME_MAX:
            raise ConfigError(f"{name} {str(out)[:60]}...: its part {part[:24]}... is {size} "
                              f"bytes long, and a file system takes names of at most "
                              f"{NAME_MAX} bytes; choose a shorter name")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{name} {out} is a file; give a directory for {purpose}")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{name} {out}: {existing} is a file, so {what} cannot "
                          "be made there; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = what if existing == out else f"{existing}, where it would be made,"
        raise ConfigError(f"{name} {out}: {where} is not writable; choose a directory you can "
                          "write to")
    # The permission bits pass for root: a read-only mount or /proc refuses the write
    # itself. One empty probe says.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lab-probe-", dir=existing))
    except OSError as err:
        where = what if existing == out else f"{existing} (where it would be made)"
        raise ConfigError(f"{name} {out}: nothing can be written in {where}: "
                          f"{err.strerror or err}; choose a directory you can write to") \
            from None


def run_marker(directory) -> str | None:
    """The first of :data:`RUN_MARKERS` that ``directory`` holds (it is a run's
    directory, perhaps one killed before its first record), or None."""
    directory = Path(directory)
    return next((name for name in RUN_MARKERS if _marks(directory / name)), None)


def _marks(path: Path) -> bool:
    with contextlib.suppress(OSError):
        if path.name == LOCK_FILE:  # ours is empty; other tools' (pytest's) hold a pid
            return path.is_file() and path.stat().st_size == 0
        return path.is_dir() if path.name == RUN_MARKERS[-1] else path.is_file()
    return False


def enclosing_run(path) -> Path | None:
    """The run directory ``path`` is or lies in (the nearest holding a run's marker), or
    None: a few stats per ancestor."""
    here = Path(path).expanduser().resolve()
    return next((p for p in (here, *here.parents) if run_marker(p)), None)


def _refuse_blank(out, name: str, example: str) -> None:
    if isinstance(out, str) and not out.strip():
        raise ConfigError(f"{name} {out!r} is blank, which would mean the working directory; "
                          f"give {example}")


def check_run_dir(out, name: str = "out_dir") -> None:
    """Refuse a run directory that cannot be created or written, or that would mix runs,
    before anything runs; ``name`` is what the caller calls it (``--out``, ``out_dir``).

    A blank path is refused; so is a directory inside another run's directory (that run
    would list it as its own and ``--force`` would move it aside with it), and one that
    already holds run directories (a directory of runs is no run).
    """
    _refuse_blank(out, name, f"the run directory (e.g. {name} runs/my-run)")
    check_writable_dir(out, name)
    here = Path(out).expanduser().resolve()
    parent = enclosing_run(here.parent)
    if parent is not None:
        raise ConfigError(f"{name} {out} lies inside the run directory {parent}, so the "
                          f"new run would be nested in that run (listed and moved aside with "
                          f"it); choose a directory outside {parent} (it holds "
                          f"{run_marker(parent)}: a run's, perhaps one killed before its "
                          f"first record)")
    held = _a_run_inside(here) if here.is_dir() else None
    if held is not None:
        raise ConfigError(f"{name} {out} already holds run directories (e.g. {held}), so it "
                          f"is a directory of runs, not a run; give a new directory for the "
                          f"run (e.g. {name} {Path(out) / 'my-run'})")


def check_runs_dir(out, name: str = "out") -> None:
    """Refuse a directory of runs (a sweep's ``out``) that cannot be created or written,
    lies inside a run's directory, or is itself a run's directory; the runs it already
    holds are its own."""
    _refuse_blank(out, name, f"the directory for the runs (e.g. {name} runs/my-sweep)")
    check_writable_dir(out, name, "the runs")
    here = Path(out).expanduser().resolve()
    marker = run_marker(here)
    if marker is not None:
        raise ConfigError(f"{name} {out} is a run's directory (it holds a {marker}), not "
                          "a directory of runs; choose a directory outside it")
    parent = enclosing_run(here.parent)
    if parent is not None:
        raise ConfigError(f"{name} {out} lies inside the run directory {parent}, so its "
                          f"runs would be nested in that run (listed and moved aside with "
                          f"it); choose a directory outside {parent}")


# How deep below a new run's directory a run is looked for: a sweep's runs lie one level
# below its out, and runs/ holds sweeps' outs, so two; four leaves room for grouping.
HELD_DEPTH = 4


def _a_run_inside(directory: Path, depth: int = HELD_DEPTH) -> str | None:
    """The path, relative to ``directory``, of one run directory below it (a run's marker,
    but a lock only while a live process holds it: a lock alone is left by an attempt
    that never started), at most ``depth`` levels down, nearest first; or None."""
    level = [Path(directory)]
    for _ in range(depth):
        below = []
        for folder in level:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:  # unreadable: check_writable_dir has said what it can
                continue
            for entry in entries:
                with contextlib.suppress(OSError):
                    if not entry.is_dir():
                        continue
                    child = Path(entry.path)
                    marker = run_marker(child)
                    if marker not in (None, LOCK_FILE) or \
                            (marker == LOCK_FILE and holder(child) is not None):
                        return str(child.relative_to(directory))
                    if not entry.is_symlink():  # (a link may lead back up: not walked)
                        below.append(child)
        level = below
    return None


# ---------------------------------------------------------------------------
# a run's state, read without touching the run


@dataclass(frozen=True)
class RunState:
    """What a run directory holds: ``status`` missing (no record) | running (a live
    process holds the lock; ``pid``) | interrupted (the record says running, nobody holds
    the lock) | complete | diverged | failed (the record's) | unreadable (``error``)."""

    status: str
    pid: int | None = None
    record: dict | None = None
    error: str | None = None


def inspect(run_dir, *, locked: bool = False) -> RunState:
    """The state of ``run_dir`` from its lock and record.json's status, read as plain
    JSON (``lab.notebook.run_state`` also checks the record's fields and row store);
    creates nothing. ``locked``: the caller holds the lock itself."""
    run_dir = Path(run_dir)
    pid = holder(run_dir) if run_dir.is_dir() and not locked else None
    if pid is not None:
        return RunState("running", pid)
    path = run_dir / RECORD_FILE
    if not path.exists():
        return RunState("missing")
    try:
        record = json.loads(path.read_bytes())
    except ValueError as err:
        return RunState("unreadable", error=f"{path} is not valid JSON ({err})")
    except OSError as err:
        return RunState("unreadable", error=f"{path} cannot be read ({err})")
    status = record.get("status") if isinstance(record, dict) else None
    if not isinstance(status, str):
        return RunState("unreadable", error=f"{path} holds no run status")
    return RunState("interrupted" if status == "running" else status, record=record)


# ---------------------------------------------------------------------------
# moving a run aside


def _aside_name(name: str, suffix: str) -> str:
    """``name + suffix``, within NAME_MAX bytes: a name near the limit keeps its start
    and gets 8 hex digits of its hash, so two long names stay apart."""
    if len(os.fsencode(name + suffix)) <= NAME_MAX:
        return name + suffix
    digest = "~" + hashlib.sha1(os.fsencode(name)).hexdigest()[:8]
    room = NAME_MAX - len(os.fsencode(digest + suffix))
    head = os.fsencode(name)[:room].decode(errors="ignore")  # whole characters only
    return head + digest + suffix


def move_aside(run_dir) -> Path:
    """Rename ``run_dir`` to ``<name>.old-<UTC time>`` beside it (never deletes);
    RunLocked if a live process works in it. Returns the new path."""
    run_dir = Path(run_dir).resolve()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())  # records.MOVED_ASIDE reads it
    target = run_dir.with_name(_aside_name(run_dir.name, f".old-{stamp}"))
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(_aside_name(run_dir.name, f".old-{stamp}-{n}"))
    with acquire(run_dir):
        # The held lock file moves with the directory, so nobody starts in it meanwhile.
        run_dir.rename(target)
        (target / PID_FILE).unlink(missing_ok=True)
    return target
