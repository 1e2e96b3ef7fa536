"""The per-run lock: one process per run directory, released by the OS when its holder dies;
a run's state read from record.json and the lock; old runs moved aside, never deleted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lab import records, runlock

HOLD = textwrap.dedent("""
    import sys, time
    from lab import runlock
    lock = runlock.acquire(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def other_holder(tmp_path):
    """Start another process holding a run directory's lock; yields (run_dir, process)."""
    started = []

    def start(run_dir: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "held"
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _record(run_dir: Path, status: str, config=None, created=None) -> dict:
    record = records.new_record(run_id=run_dir.name, kind="notebook", config=config or {"x": 1})
    record["status"] = status
    if created:
        record["created"] = created
    records.save_run(run_dir, record)
    return record


def test_another_process_is_refused_and_named(tmp_path, other_holder):
    run_dir = tmp_path / "run"
    proc = other_holder(run_dir)
    assert runlock.holder(run_dir) == proc.pid
    with pytest.raises(runlock.RunLocked, match=rf"{run_dir} is in use by process {proc.pid}"):
        runlock.acquire(run_dir)
    with pytest.raises(runlock.RunLocked):
        with runlock.hold(run_dir):
            pass


def test_a_killed_holder_leaves_no_stuck_lock(tmp_path, other_holder):
    run_dir = tmp_path / "run"
    proc = other_holder(run_dir)
    assert runlock.holder(run_dir) == proc.pid
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert runlock.holder(run_dir) is None
    with runlock.acquire(run_dir):
        assert (run_dir / runlock.PID_FILE).read_text().strip() == str(os.getpid())
    assert runlock.holder(run_dir) is None
    assert not (run_dir / runlock.PID_FILE).exists()


def test_hold_is_a_no_op_when_the_parent_holds_it(tmp_path, monkeypatch, other_holder):
    run_dir = tmp_path / "run"
    other_holder(run_dir)  # stands for the sweep worker holding it for its kernel
    monkeypatch.setenv(runlock.ENV, str(run_dir))
    with runlock.hold(run_dir):
        pass
    monkeypatch.setenv(runlock.ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(runlock.RunLocked):
        with runlock.hold(run_dir):
            pass


def test_inspect_tells_live_from_interrupted_runs(tmp_path, other_holder):
    assert runlock.inspect(tmp_path / "none").status == "missing"
    assert not (tmp_path / "none").exists()  # inspecting creates nothing
    _record(tmp_path / "done", "complete")
    state = runlock.inspect(tmp_path / "done")
    assert state.status == "complete" and state.record["config"] == {"x": 1}
    assert not (tmp_path / "done" / runlock.LOCK_FILE).exists()
    _record(tmp_path / "dead", "running")  # its process was killed
    assert runlock.inspect(tmp_path / "dead").status == "interrupted"
    _record(tmp_path / "live", "running")
    proc = other_holder(tmp_path / "live")
    state = runlock.inspect(tmp_path / "live")
    assert (state.status, state.pid) == ("running", proc.pid)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / records.RECORD_FILE).write_text("{half")
    state = runlock.inspect(tmp_path / "bad")
    assert state.status == "unreadable" and "not valid JSON" in state.error


def test_move_aside_keeps_the_old_run(tmp_path, other_holder):
    run_dir = tmp_path / "run"
    _record(run_dir, "complete", created="2020-01-02T03:04:05+00:00")
    before = (run_dir / records.RECORD_FILE).read_bytes()
    moved = runlock.move_aside(run_dir)
    assert moved.parent == tmp_path and moved.name.startswith("run.old-")
    assert not run_dir.exists()
    assert (moved / records.RECORD_FILE).read_bytes() == before
    _record(run_dir, "complete")
    again = runlock.move_aside(run_dir)
    assert again != moved and moved.exists() and again.exists()
    # The loaders leave moved-aside runs out by this pattern: both names must match it.
    assert records.MOVED_ASIDE.search(moved.name) and records.MOVED_ASIDE.search(again.name)
    _record(run_dir, "running")
    other_holder(run_dir)
    with pytest.raises(runlock.RunLocked):
        runlock.move_aside(run_dir)
    assert (run_dir / records.RECORD_FILE).exists()


@pytest.mark.parametrize("name", ["r" * 250, "é" * 125, "r" * 230 + "é" * 12])
def test_move_aside_keeps_a_long_name_within_the_limit(tmp_path, name):
    # A run named near the 255-byte limit: ".old-<time>" would push it over (OSError:
    # File name too long, and --force could not replace the run). Its start and a hash
    # of the whole name are kept instead; two such moves still land apart.
    run_dir = tmp_path / name
    _record(run_dir, "complete")
    moved = runlock.move_aside(run_dir)
    _record(run_dir, "complete")
    again = runlock.move_aside(run_dir)
    for m in (moved, again):
        assert len(os.fsencode(m.name)) <= runlock.NAME_MAX and m.exists()
        assert records.MOVED_ASIDE.search(m.name) and m.name.startswith(name[:100])
    assert again != moved and not run_dir.exists()
    # two long names differing only at their end stay apart too
    other = tmp_path / (name[:-1] + "x")
    _record(other, "complete")
    assert runlock.move_aside(other).name.split("~")[1] != moved.name.split("~")[1]
    # a short name is unchanged
    _record(tmp_path / "short", "complete")
    assert runlock.move_aside(tmp_path / "short").name.startswith("short.old-")


def test_release_survives_an_unremovable_pid_file(tmp_path):
    # A run directory made read-only mid-run: the pid file cannot be removed. The
    # release must still free the lock and must not raise (it would hide the error
    # that ended the run). A directory in the pid file's place fails the unlink
    # even for root.
    lock = runlock.acquire(tmp_path)
    pid_file = tmp_path / runlock.PID_FILE
    pid_file.unlink()
    (pid_file / "x").mkdir(parents=True)
    with pytest.raises(OSError):
        pid_file.unlink()
    lock.release()
    assert runlock.holder(tmp_path) is None  # free for the next process


def test_runs_table_shows_a_live_run_before_its_first_record(tmp_path, other_holder):
    from lab.cli import runs_table

    other_holder(tmp_path / "runs" / "a")
    proc = other_holder(tmp_path / "runs" / "b")
    _record(tmp_path / "runs" / "c", "complete")
    (tmp_path / "runs" / "d").mkdir()  # a lock file nobody holds is not a run
    runlock.acquire(tmp_path / "runs" / "d").release()
    table, bad = runs_table(tmp_path / "runs")
    status = dict(zip(table["dir"], table["status"]))
    assert status["b"] == f"running (pid {proc.pid})" and status["c"] == "complete"
    assert status["a"].startswith("running (pid ") and "d" not in status and not bad
    assert runs_table(tmp_path / "runs" / "b")[0]["status"].tolist() == [
        f"running (pid {proc.pid})"]
    proc.kill()
    proc.wait()
    assert "b" not in set(runs_table(tmp_path / "runs")[0]["dir"])


POLL = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from lab import runlock
    run_dir, stop = sys.argv[1], Path(sys.argv[2])
    n = 0
    print("polling", flush=True)
    while not stop.exists():  # what `lab runs` / a sweep's plan do, in a tight loop
        runlock.holder(run_dir)
        n += 1
    print(n, flush=True)
""")


def test_a_status_check_in_a_tight_loop_never_refuses_a_writer(tmp_path):
    run_dir, stop = tmp_path / "run", tmp_path / "stop"
    runlock.acquire(run_dir).release()
    poller = subprocess.Popen([sys.executable, "-c", POLL, str(run_dir), str(stop)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert poller.stdout.readline().strip() == "polling"
        refused = 0
        for _ in range(300):
            try:
                runlock.acquire(run_dir).release()
            except runlock.RunLocked:
                refused += 1
    finally:
        stop.touch()
        checks = int(poller.stdout.readline())
        poller.wait()
    assert checks > 100  # the reader really polled while the writer acquired
    assert refused == 0


def test_a_writer_waits_out_a_readers_check_held_open(tmp_path):
    # Deterministic form of the race: a reader's instant check (the lock taken, no holder
    # named) is held open while the writer acquires; the writer must wait for it, not be
    # refused.
    import threading

    from filelock import FileLock

    run_dir = tmp_path / "run"
    runlock.acquire(run_dir).release()
    reader = FileLock(run_dir / runlock.LOCK_FILE, thread_local=False)
    reader.acquire()
    threading.Timer(0.3, reader.release).start()
    start = time.monotonic()
    with runlock.acquire(run_dir):
        waited = time.monotonic() - start
        assert runlock.holder(run_dir) == os.getpid()
    assert 0.25 < waited < runlock.READER_GRACE_S


def test_another_writer_is_refused_at_once_not_after_the_reader_grace(tmp_path, other_holder):
    run_dir = tmp_path / "run"
    proc = other_holder(run_dir)
    start = time.monotonic()
    with pytest.raises(runlock.RunLocked, match=f"in use by process {proc.pid};"):
        runlock.acquire(run_dir)
    assert time.monotonic() - start < runlock.READER_GRACE_S / 2


def test_a_stale_pid_file_is_not_named(tmp_path):
    import fcntl

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir = tmp_path / "run"
    runlock.acquire(run_dir).release()
    # A holder between taking the lock and writing its pid, with the pid file of an
    # earlier holder that was killed -9 still there.
    (run_dir / runlock.PID_FILE).write_text(f"{dead.pid}\n")
    fd = os.open(run_dir / runlock.LOCK_FILE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert runlock.live_pid(run_dir) is None
        assert runlock.holder(run_dir) == 0  # running, pid unknown
        with pytest.raises(runlock.RunLocked, match="in use by another process;") as err:
            runlock.acquire(run_dir)
        assert str(dead.pid) not in str(err.value) and err.value.pid is None
        (run_dir / runlock.PID_FILE).write_text(f"{os.getpid()}\n")  # a live one is named
        with pytest.raises(runlock.RunLocked, match=f"in use by process {os.getpid()};"):
            runlock.acquire(run_dir)
    finally:
        os.close(fd)


def test_a_renamed_or_deleted_run_directory_is_noticed(tmp_path):
    import shutil

    old, new = tmp_path / "a", tmp_path / "b"
    lock = runlock.acquire(old)
    lock.check_in_place()  # still there: nothing to say
    old.rename(new)
    with pytest.raises(runlock.RunMoved, match=rf"run directory {old} was moved to {new} .*"
                                               rf"stopped without writing to {old}"):
        lock.check_in_place()
    old.mkdir()  # another directory now at the old path is not the one locked
    with pytest.raises(runlock.RunMoved, match=f"was moved to {new} "):
        lock.check_in_place()
    lock.release()
    assert not (new / runlock.PID_FILE).exists() and list(old.iterdir()) == []
    watch = runlock.DirWatch(new)
    shutil.rmtree(new)
    with pytest.raises(runlock.RunMoved, match=f"run directory {new} was moved or deleted while "):
        watch.check()
    watch.close()


def test_check_run_dir_refuses_a_blank_path_a_nested_run_and_a_directory_of_runs(tmp_path):
    from lab.config import ConfigError

    assert runlock.RECORD_FILE == records.RECORD_FILE
    for blank in ("", " "):
        with pytest.raises(ConfigError, match=rf"out_dir {blank!r} is blank, which would mean "
                                              "the working directory"):
            runlock.check_run_dir(blank)
    run = tmp_path / "run"
    records.save_run(run, records.new_record(run_id="run", kind="notebook", config={}))
    runlock.check_run_dir(run)  # the run's own directory: deciding about it is not nesting
    runlock.check_run_dir(tmp_path / "beside")
    for inner in (run / "sub", run / "rows" / "epoch", run / "a" / "b" / "c"):
        with pytest.raises(ConfigError, match=rf"out_dir {inner} lies inside the run "
                                              rf"directory {run}, so"):
            runlock.check_run_dir(inner)
    with pytest.raises(ConfigError, match=rf"out_dir {tmp_path} already holds run directories "
                                          r"\(e.g. run\)"):
        runlock.check_run_dir(tmp_path)
    # A run that a live process holds before its first record counts; a lock left by a
    # dead attempt alone does not.
    starting = tmp_path / "sweep" / "a"
    runlock.acquire(starting).release()
    runlock.check_run_dir(tmp_path / "sweep")
    with runlock.acquire(starting), \
            pytest.raises(ConfigError, match=r"already holds run directories \(e.g. a\)"):
        runlock.check_run_dir(tmp_path / "sweep")


def test_check_run_dir_finds_runs_levels_below_but_not_too_deep(tmp_path):
    # runs/ as the README lays it out holds sweeps' outs, which hold the runs: a run
    # two levels down makes runs/ a directory of runs as surely as one level down.
    from lab.config import ConfigError

    def run_at(*parts):
        where = tmp_path.joinpath(*parts)
        records.save_run(where, records.new_record(run_id=parts[-1], kind="notebook",
                                                   config={}))

    run_at("runs", "demo", "rule-bp_seed-0")
    (tmp_path / "runs" / "empty" / "deeper").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"out_dir \S+/runs already holds run directories "
                                          r"\(e.g. demo/rule-bp_seed-0\)"):
        runlock.check_run_dir(tmp_path / "runs")
    # nearest level first; runs are not entered (a run's own files are no runs)
    run_at("runs", "near")
    with pytest.raises(ConfigError, match=r"\(e.g. near\)"):
        runlock.check_run_dir(tmp_path / "runs")
    run_at("far", *"abc", "run")  # HELD_DEPTH levels down: found
    assert runlock.HELD_DEPTH == 4
    with pytest.raises(ConfigError, match=r"\(e.g. a/b/c/run\)"):
        runlock.check_run_dir(tmp_path / "far")
    run_at("farther", *"abcd", "run")  # beyond: not walked
    runlock.check_run_dir(tmp_path / "farther")
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "up").symlink_to(tmp_path / "loop")  # a link back up: not walked
    runlock.check_run_dir(tmp_path / "loop")


def test_check_writable_dir_probes_a_write_the_permission_bits_allow(tmp_path):
    # /proc passes os.access for root, yet nothing can be made there.
    import os

    from lab.config import ConfigError

    said = (r"nothing can be written in /proc \(where it would be made\): [^;]+; choose"
            if os.access("/proc", os.W_OK | os.X_OK)  # (root; otherwise the bits say)
            else r"/proc, where it would be made, is not writable")
    with pytest.raises(ConfigError, match=rf"^--out /proc/lab-x: {said}"):
        runlock.check_writable_dir("/proc/lab-x", "--out")
    runlock.check_writable_dir(tmp_path / "new" / "run", "--out")
    assert [p.name for p in tmp_path.iterdir()] == []  # the probe leaves nothing


def test_run_moved_names_where_the_directory_is_now(tmp_path):
    old, new = tmp_path / "a", tmp_path / "b"
    watch = runlock.DirWatch(old.mkdir() or old)
    old.rename(new)
    with pytest.raises(runlock.RunMoved) as caught:
        watch.check()
    assert caught.value.now == str(new)
    new.rmdir()
    with pytest.raises(runlock.RunMoved) as caught:
        watch.check()
    assert caught.value.now is None
    watch.close()


def test_check_runs_dir_takes_a_directory_of_runs_but_not_one_inside_a_run(tmp_path):
    from lab.config import ConfigError

    sweep = tmp_path / "sweep"
    records.save_run(sweep / "a", records.new_record(run_id="a", kind="notebook", config={}))
    runlock.check_runs_dir(sweep)  # its own runs are what a sweep's out holds
    runlock.check_runs_dir(tmp_path / "new" / "sweep")
    with pytest.raises(ConfigError, match=rf"out {sweep / 'a'} is a run's directory \(it holds "
                                          r"a record.json\), not a directory of runs"):
        runlock.check_runs_dir(sweep / "a")
    with pytest.raises(ConfigError, match=rf"out {sweep / 'a' / 'x'} lies inside the run "
                                          rf"directory {sweep / 'a'}, so its runs would be"):
        runlock.check_runs_dir(sweep / "a" / "x")
    with pytest.raises(ConfigError, match=r"out '' is blank, which would mean the working "):
        runlock.check_runs_dir("")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"is a file; give a directory for the runs"):
        runlock.check_runs_dir(tmp_path / "file")
