"""The per-run lock: one process per run directory, released by the OS when its holder dies;
a run's state read from record.json and the lock; old runs moved aside, never deleted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
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
