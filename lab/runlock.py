"""One process at a time in a run directory: an OS file lock that dies with its holder.

A run directory is locked (an exclusive ``flock`` on ``<run>/.lock``) while a
process trains or executes in it, so two sweeps never run the same run and a
refused attempt cannot touch a finished one. The kernel releases the lock when
the holder dies, so a ``kill -9`` never leaves it stuck. The holder writes its
pid beside the lock, which lets ``lab runs`` tell a live run (``running``, pid)
from an interrupted one (the record says ``running`` but nobody holds the lock).

Readers (``lab runs``, a sweep's plan, ``lab report``) test the lock with a
*shared* flock for an instant; a writer that finds the lock taken tells a
reader's shared lock from another writer's exclusive one and waits out the
reader (:data:`READER_GRACE_S`), so a status check never makes a run fail.

A directory renamed (or deleted) while a process works in it would be made
again by the next write to its old path, splitting the run in two with no lock
held there; :class:`DirWatch` notices it first and :class:`RunMoved` names both
paths.

A parent that holds the lock for a child doing the work (the sweep holds it
while the notebook kernel trains) exports ``LAB_RUN_LOCK=<absolute run dir>``
to the child; :func:`hold` in the child then does not try to lock again.

:func:`inspect` tells what a run directory holds from its record.json (the
single source of a run's status) and its lock, without writing anything;
:func:`move_aside` keeps an old run under a new name instead of deleting it.
:func:`check_run_dir` (a run) and :func:`check_runs_dir` (a sweep's directory of runs)
refuse, before anything is made, a directory that cannot be written or that would mix
one run into another (a blank path, a run inside a run, a run over a directory of runs).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError

LOCK_FILE = ".lock"
PID_FILE = ".lock.pid"
ENV = "LAB_RUN_LOCK"
PARAMS_ENV = "LAB_NOTEBOOK_PARAMS"
# How long a writer waits for readers' instant shared locks to go before it gives up. A
# reader holds one for microseconds; this only bounds a pathological stream of them.
READER_GRACE_S = 2.0


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
    ``/proc/self/fd``, macOS ``F_GETPATH``), and compares (device, inode) of the
    path with the open directory's. A process that writes by path after a rename
    would re-create the old path and split the run in two.
    """

    def __init__(self, path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        self._id = _identity(os.fstat(self._fd))

    @property
    def fd(self) -> int | None:
        """The open directory (wherever it is now), or None once closed."""
        return self._fd

    def moved(self) -> bool:
        """True if the path no longer names the directory opened (renamed, deleted)."""
        if self._fd is None:
            return False
        try:
            return _identity(os.stat(self.path)) != self._id
        except OSError:
            return True

    def check(self) -> None:
        """RunMoved (naming both paths, where the new one can be found) if the directory
        left its path."""
        if not self.moved():
            return
        now = _fd_path(self._fd)
        where = (f"was moved to {now}" if now else "was moved or deleted")
        kept = (f" The rows saved so far are in {now}: give that directory to resume there"
                if now else "")
        raise RunMoved(f"run directory {self.path} {where} while the run worked in it; "
                       f"stopped without writing to {self.path}, so the run is not split in "
                       f"two.{kept}", now)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = None


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino


def _fd_path(fd: int) -> str | None:
    """The current path of an open file or directory, where the OS tells it."""
    with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
        if hasattr(fcntl, "F_GETPATH"):  # macOS
            return fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024)).split(b"\0", 1)[0].decode()
        link = os.readlink(f"/proc/self/fd/{fd}")  # Linux; "<path> (deleted)" when deleted
        return link if link.startswith("/") and not link.endswith(" (deleted)") else None
    return None


class RunLock:
    """A held lock on one run directory; ``release()`` (or leaving ``with``) frees it.

    ``fd`` is None when a parent process holds the lock for us (``LAB_RUN_LOCK``); the
    directory is watched either way (the lock moves with it if it is renamed).
    """

    def __init__(self, run_dir: Path, fd: int | None):
        self.run_dir, self._fd = run_dir, fd
        self.watch = DirWatch(run_dir)

    def check_in_place(self) -> None:
        """RunMoved if the locked directory was renamed or deleted since it was locked
        (writing by its old path would then make a second, unlocked directory there)."""
        self.watch.check()

    def release(self) -> None:
        if self._fd is not None:
            # The pid file only names the holder for `lab runs`: failing to remove it (a
            # directory made read-only meanwhile) must not hide the error that ended the run.
            # Removed through the open directory: if it was renamed meanwhile, the pid file
            # is in the new place, and the old path is not ours any more.
            with contextlib.suppress(OSError):
                os.unlink(PID_FILE, dir_fd=self.watch.fd)
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
        self.watch.close()
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


RECORD_FILE = "record.json"  # records.RECORD_FILE (records imports pandas; this stays light)


NAME_MAX = 255  # bytes in one path part: the limit of ext4, xfs, btrfs, APFS, NTFS (chars)


def check_writable_dir(out, name: str, purpose: str = "the run") -> None:
    """Refuse a directory that cannot be created or written, before anything runs;
    ``name`` is what the caller calls it (``--out``, ``out_dir``), ``purpose`` what the
    directory is for ("the run", "the reports")."""
    out = Path(out)
    what = f"{purpose} directory"
    for part in out.expanduser().parts:  # (stat would fail with ENAMETOOLONG first)
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
    # os.access trusts permission bits (all of them pass for root): a read-only mount or a
    # pseudo file system such as /proc refuses the write itself. One empty probe says.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lab-probe-", dir=existing))
    except OSError as err:
        where = what if existing == out else f"{existing} (where it would be made)"
        raise ConfigError(f"{name} {out}: nothing can be written in {where}: "
                          f"{err.strerror or err}; choose a directory you can write to") \
            from None


def check_run_dir(out, name: str = "out_dir") -> None:
    """Refuse a run directory that cannot be created or written, or that would mix runs,
    before anything runs; ``name`` is what the caller calls it (``--out``, ``out_dir``).

    A blank path (which would mean the working directory) is refused, as a protocol's
    blank ``out`` is. So is a directory inside another run's directory (that run would
    list it as its own and ``--force`` would move it aside with it), and one that already
    holds run directories (a directory of runs, such as a sweep's ``out``, is no run).
    The cost is one stat per ancestor and a walk of ``out`` at most ``HELD_DEPTH`` levels
    deep that stops at the first run and never enters one.
    """
    if isinstance(out, str) and not out.strip():
        raise ConfigError(f"{name} {out!r} is blank, which would mean the working directory; "
                          f"give the run directory (e.g. {name} runs/my-run)")
    check_writable_dir(out, name)
    here = Path(out).expanduser().resolve()
    parent = enclosing_run(here.parent)
    if parent is not None:
        raise ConfigError(f"{name} {out} lies inside the run directory {parent}, so the "
                          f"new run would be nested in that run (listed and moved aside "
                          f"with it); choose a directory outside {parent}")
    held = _a_run_inside(here) if here.is_dir() else None
    if held is not None:
        raise ConfigError(f"{name} {out} already holds run directories (e.g. {held}), so it "
                          f"is a directory of runs, not a run; give a new directory for the "
                          f"run (e.g. {name} {Path(out) / 'my-run'})")


def check_runs_dir(out, name: str = "out") -> None:
    """Refuse a directory of runs (a sweep's ``out``) that cannot be created or written,
    lies inside a run's directory, or is itself a run's directory; the runs it already
    holds are its own. Same cost as :func:`check_run_dir`."""
    if isinstance(out, str) and not out.strip():
        raise ConfigError(f"{name} {out!r} is blank, which would mean the working directory; "
                          f"give the directory for the runs (e.g. {name} runs/my-sweep)")
    check_writable_dir(out, name, "the runs")
    here = Path(out).expanduser().resolve()
    if (here / RECORD_FILE).is_file():
        raise ConfigError(f"{name} {out} is a run's directory (it holds a {RECORD_FILE}), not "
                          "a directory of runs; choose a directory outside it")
    parent = enclosing_run(here.parent)
    if parent is not None:
        raise ConfigError(f"{name} {out} lies inside the run directory {parent}, so its "
                          f"runs would be nested in that run (listed and moved aside with "
                          f"it); choose a directory outside {parent}")


def enclosing_run(path) -> Path | None:
    """The run directory ``path`` is or lies in (the nearest holding a record), or None:
    one stat per ancestor."""
    here = Path(path).expanduser().resolve()
    return next((p for p in (here, *here.parents) if (p / RECORD_FILE).is_file()), None)


# How deep below a new run's directory a run is looked for: a sweep's runs lie one level
# below its out, and runs/ (the README's layout) holds sweeps' outs, so two; four leaves
# room for a grouping level or two.
HELD_DEPTH = 4


def _a_run_inside(directory: Path, depth: int = HELD_DEPTH) -> str | None:
    """The path, relative to ``directory``, of one run directory below it (it holds a
    record, or a live process holds its lock before the first record), at most ``depth``
    levels down, nearest level first; or None. Runs are not entered."""
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
                    if (child / RECORD_FILE).is_file() or \
                            ((child / LOCK_FILE).is_file() and holder(child) is not None):
                        return str(child.relative_to(directory))
                    if not entry.is_symlink():  # (a link may lead back up: not walked)
                        below.append(child)
        level = below
    return None


# Why flock with a shared/exclusive split, and not fcntl's F_GETLK (which tests a lock
# without taking it): F_GETLK sees only POSIX record locks, which are per process (any
# close() of the file by the holder drops them) and, on Linux, invisible to flock and
# vice versa; OFD locks (F_OFD_GETLK) fix that on Linux only. flock is per open file, is
# dropped by the kernel when the holder dies, and behaves the same on Linux and macOS; a
# reader's LOCK_SH never conflicts with another reader, and a writer can tell a reader's
# LOCK_SH (it can take LOCK_SH too) from a writer's LOCK_EX (it cannot).


def _flock(fd: int, how: int) -> bool:
    """Try ``flock(how | LOCK_NB)``; False if someone holds a conflicting lock."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return False
        raise
    return True


def _only_readers(path: Path) -> bool:
    """True if the lock at ``path`` is free or held only shared (by readers)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # gone (the directory moved aside): the retry opens it afresh
    try:
        return _flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)  # drops the shared lock just taken


def acquire(run_dir) -> RunLock:
    """Lock ``run_dir`` (created if missing) without waiting for another writer;
    RunLocked if one holds it. A reader's instant check is waited out."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    deadline = time.monotonic() + READER_GRACE_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if _flock(fd, fcntl.LOCK_EX) and _still_at(fd, path):
                (run_dir / PID_FILE).write_text(f"{os.getpid()}\n")
                return RunLock(run_dir, fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if not _only_readers(path) or time.monotonic() > deadline:
            raise RunLocked(run_dir, live_pid(run_dir))
        time.sleep(0.002)


def _still_at(fd: int, path: Path) -> bool:
    """False if the file open as ``fd`` left ``path`` (its directory was moved aside
    meanwhile): a lock on it guards nothing at ``path`` any more."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _pid(run_dir: Path) -> int | None:
    try:
        return int((run_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def live_pid(run_dir) -> int | None:
    """The pid in ``run_dir``'s pid file if that process is alive, else None (a pid file
    left by a killed holder names a dead process, or one that reuses its number later)."""
    pid = _pid(Path(run_dir))
    if not pid or pid < 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    except OSError:
        return None
    with contextlib.suppress(OSError, IndexError):  # Linux: a zombie holds no lock
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
    return pid


def holder(run_dir) -> int | None:
    """The pid of the live process holding ``run_dir`` (0 if unknown), or None if free.

    Tested with a shared lock held for an instant: a writer acquiring meanwhile waits it
    out (see :func:`acquire`), so this read never makes a run fail to start.
    """
    path = Path(run_dir).resolve() / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file (never locked), or unreadable: nobody trains there
        return None
    try:
        if _flock(fd, fcntl.LOCK_SH):
            return None
    finally:
        os.close(fd)
    return live_pid(path.parent) or 0


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
        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)  # (the parent may not have made it)
        lock = RunLock(run_dir, None)
    else:
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
    if status in FINISHED:
        # A finished run is "done" only with every counted row in its store: one whose store
        # lost or cut a part is what `lab runs` and `lab report` call unreadable, so a rerun
        # must not call it finished (--force replaces it). By line count, no JSON parsing.
        try:
            records.check_stored_rows(run_dir)
        except (records.RecordError, OSError) as err:
            return RunState("unreadable", error=str(err))
    return RunState(status, record=record)


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
