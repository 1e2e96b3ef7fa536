"""The command line: bad input is one paragraph and exit 2 before anything starts; finished runs
are never modified; `lab runs` tells live from interrupted runs and survives unreadable ones;
kernels die with the `lab` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import lab.cli
import lab.notebook
from lab import records, runlock
from lab.cli import main as cli_main
from lab.cli import runs_table
from lab.data import DataError, load_dataset

ROOT = Path(__file__).resolve().parents[1]
ECHO = ROOT / "tests" / "fixtures" / "notebooks" / "echo.ipynb"
SLOW = ROOT / "tests" / "fixtures" / "notebooks" / "slow.ipynb"
TRAIN = ROOT / "notebooks" / "01-train-conv.ipynb"


@pytest.fixture
def no_kernel(monkeypatch):
    monkeypatch.setattr(lab.notebook, "_papermill", lambda *a, **k: pytest.fail("kernel started"))


def _one_paragraph(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


# ---------------------------------------------------------------------------
# fault 5: messages, not tracebacks


def test_parameter_files_that_cannot_be_used(tmp_path, capsys, no_kernel):
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00binary")
    (tmp_path / "bad.yaml").write_text("epochs: 2\nlr: [0.1\nseed: 1\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    cases = [
        (["run", str(ECHO)], "binary.yaml", r"parameter file .*binary.yaml cannot be read as "
         r"text \('utf-8' codec can't decode byte 0xff"),
        (["train"], "bad.yaml", r"parameter file .*bad.yaml is not valid YAML at line 3, "
         r"column 5 \(expected ',' or '\]', but got ':'\)"),
        (["train"], "missing.yaml", r"parameter file .*missing.yaml does not exist"),
        (["run", str(ECHO)], "list.yaml", r"parameter file .*list.yaml holds a list, not a "
         r"mapping"),
    ]
    for command, name, message in cases:
        out = tmp_path / "out"
        assert cli_main([*command, "--out", str(out), "-f", str(tmp_path / name)]) == 2
        err = _one_paragraph(capsys.readouterr().err)
        assert pytest.importorskip("re").search(message, err), err
        assert "<unicode string>" not in err and "Traceback" not in err
        assert not out.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to a read-only directory")
def test_read_only_out_directory(tmp_path, capsys, no_kernel):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        for command in (["train"], ["run", str(ECHO)]):
            assert cli_main([*command, "--out", str(locked / "r")]) == 2
            assert "is not writable" in _one_paragraph(capsys.readouterr().err)
    finally:
        locked.chmod(0o755)


def test_unwritable_out_is_refused_before_anything_runs(tmp_path, capsys, no_kernel,
                                                        monkeypatch):
    # Root may write anywhere, so the check is exercised through what os.access says.
    monkeypatch.setattr(lab.cli.os, "access", lambda path, mode: False)
    for command in (["train"], ["run", str(ECHO)]):
        assert cli_main([*command, "--out", str(tmp_path / "r")]) == 2
        err = _one_paragraph(capsys.readouterr().err)
        assert f"--out {tmp_path / 'r'}: {tmp_path}, where it would be made, is not writable" \
            in err
        assert not (tmp_path / "r").exists()


def test_out_below_a_file(tmp_path, capsys, no_kernel):
    (tmp_path / "file").write_text("x")
    for command in (["train"], ["run", str(ECHO)]):
        assert cli_main([*command, "--out", str(tmp_path / "file" / "r")]) == 2
        assert "is a file, so the run directory cannot be made there" in \
            _one_paragraph(capsys.readouterr().err)


# ---------------------------------------------------------------------------
# fault 4: bad values exit 2 before a kernel starts, creating nothing


@pytest.mark.parametrize("key, value, message", [
    ("epochs", "-3", "ConvConfig.epochs=-3 is out of range; allowed: [1, inf]"),
    ("rule", "nosuch", "ConvConfig.rule='nosuch' is unknown; known rules: "),
    ("lr", "abc", "ConvConfig.lr must be float, got 'abc' (str)"),
    ("lr", "[fast", "ConvConfig.lr must be float, got '[fast' (str)"),
    ("n_train", "1.5", "ConvConfig.n_train must be int, got 1.5 (float)"),
])
def test_bad_values_exit_2_without_a_kernel(tmp_path, capsys, no_kernel, key, value, message):
    for command in (["run", str(TRAIN)], ["train"]):
        start = time.perf_counter()
        assert cli_main([*command, "--out", str(tmp_path / "r"), "-p", key, value]) == 2
        assert message in _one_paragraph(capsys.readouterr().err)
        assert time.perf_counter() - start < 5  # refused at once, not after a kernel start
        assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------------------
# fault 1 through the CLI: refused attempts change nothing; --force keeps the old run


def _files(run_dir: Path) -> dict:
    return {p.relative_to(run_dir).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_run_refuses_other_parameters_and_force_moves_the_old_run_aside(tmp_path, capsys):
    out = tmp_path / "R"
    assert cli_main(["run", str(ECHO), "--out", str(out), "-p", "x", "1"]) == 0
    capsys.readouterr()
    before = _files(out)
    assert cli_main(["run", str(ECHO), "--out", str(out), "-p", "x", "2"]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert "already holds a complete run with other parameters (x: 1 there vs 2 now)" in err
    assert "use another run directory" in err and "--force" in err
    assert _files(out) == before
    assert records.load_record(out)["status"] == "complete"
    assert cli_main(["run", str(ECHO), "--out", str(out), "-p", "x", "2", "--force"]) == 0
    printed = capsys.readouterr().out
    (kept,) = tmp_path.glob("R.old-*")
    assert f"the old run is kept in {kept}" in printed
    assert {k: v for k, v in _files(kept).items() if not k.startswith(".lock")} == \
        {k: v for k, v in before.items() if not k.startswith(".lock")}
    assert records.load_record(out)["config"]["x"] == 2


def test_train_refuses_other_parameters(tiny, tmp_path, capsys):
    args = ["train", "--out", str(tmp_path / "T")]
    args += [a for k, v in {**tiny, "epochs": 1}.items() for a in ("-p", k, str(v))]
    assert cli_main(args) == 0
    capsys.readouterr()
    before = _files(tmp_path / "T")
    assert cli_main(args) == 0
    assert "already complete with these parameters; nothing to do" in capsys.readouterr().out
    assert cli_main([*args, "-p", "epochs", "2"]) == 2
    assert "(epochs: 1 there vs 2 now)" in _one_paragraph(capsys.readouterr().err)
    assert _files(tmp_path / "T") == before


def test_n_train_beyond_the_data_is_refused(tmp_path, capsys):
    available = len(load_dataset("mnist1d", val_fraction=0.1).train)
    with pytest.raises(DataError, match=rf"n_train=100000 but mnist1d has only {available} "
                       r"training examples available .*allowed: 0 \(all of them\) or 1 to "
                       rf"{available}"):
        load_dataset("mnist1d", val_fraction=0.1, n_train=100000)
    assert len(load_dataset("mnist1d", val_fraction=0.1, n_train=available).train) == available
    assert cli_main(["train", "--out", str(tmp_path / "T"), "-p", "n_train", "100000"]) == 1
    err = capsys.readouterr().err
    assert f"error: DataError: n_train=100000 but mnist1d has only {available}" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------
# faults 8 and 9: `lab runs`


def _record(run_dir: Path, status: str, run_id: str | None = None) -> None:
    record = records.new_record(run_id=run_id or run_dir.name, kind="notebook", config={"x": 1})
    record["status"] = status
    records.save_run(run_dir, record)


HOLD = textwrap.dedent("""
    import sys, time
    from lab import runlock
    lock = runlock.acquire(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


def test_runs_tells_live_from_interrupted_and_shows_directories(tmp_path, capsys):
    _record(tmp_path / "demo" / "rule-bp_seed-0", "complete")
    _record(tmp_path / "rules" / "rule-bp_seed-0", "running")  # same id, another protocol
    _record(tmp_path / "rules" / "rule-kp_seed-0", "running")
    holder = subprocess.Popen([sys.executable, "-c", HOLD,
                               str(tmp_path / "rules" / "rule-kp_seed-0")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        table, unreadable = runs_table(tmp_path)
        assert not unreadable
        assert list(zip(table["dir"], table["status"])) == [
            ("demo/rule-bp_seed-0", "complete"),
            ("rules/rule-bp_seed-0", "interrupted"),
            ("rules/rule-kp_seed-0", f"running (pid {holder.pid})")]
        assert cli_main(["runs", str(tmp_path / "rules")]) == 0
        out = capsys.readouterr().out
        assert "rule-bp_seed-0 interrupted" in " ".join(out.split())
    finally:
        holder.kill()
        holder.wait()


def test_one_unreadable_record_does_not_hide_the_table(tmp_path, capsys):
    _record(tmp_path / "a", "complete")
    _record(tmp_path / "c", "failed")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "record.json").write_text('{"schema_version": ')
    assert cli_main(["runs", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "a" in out.split() and "complete" in out and "failed" in out
    assert "1 run(s) could not be read:" in out
    assert "b: " in out and "not valid JSON" in out


def test_runs_on_a_file(tmp_path, capsys):
    _record(tmp_path / "a", "complete")
    (tmp_path / "notes.txt").write_text("x")
    assert cli_main(["runs", str(tmp_path / "notes.txt")]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert "notes.txt is a file; give a directory of runs, a run's record.json, or a " \
           "protocol (.yaml)" in err
    assert cli_main(["runs", str(tmp_path / "a" / "record.json")]) == 0
    assert "complete" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# fault 2: a kernel dies with the process that started it


def _kill_lab_run(tmp_path: Path, launcher: bool) -> tuple[int, float]:
    """Start `lab run` of the slow notebook, SIGKILL its process group while the
    kernel writes, and return (lines written after the kill, seconds they went on)."""
    out = tmp_path / ("bound" if launcher else "orphan")
    patch = "" if launcher else "lab.notebook._papermill_options = lambda: {}\n"
    code = (f"import sys, lab.notebook\n{patch}from lab.cli import main\n"
            f"sys.exit(main(['run', {str(SLOW)!r}, '--out', {str(out)!r}, '-p', 'ticks', "
            "'400', '-p', 'tick_s', '0.01']))")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    trace = out / "trace.log"
    deadline = time.time() + 120
    while not (trace.exists() and trace.read_text().count("tick") >= 3):
        assert time.time() < deadline and proc.poll() is None, "the run never started"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = time.time()
    time.sleep(1.5)
    times = [float(line.split()[2]) for line in trace.read_text().splitlines()]
    late = [t for t in times if t > killed_at]
    return len(late), (max(late) - killed_at if late else 0.0)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_the_kernel_dies_with_lab_run(tmp_path):
    # The control reproduces the fault: without the launcher the orphaned kernel
    # keeps writing after `lab` is killed (ipykernel notices its parent is gone
    # only about a second later).
    late, span = _kill_lab_run(tmp_path, launcher=False)
    assert late > 5 and span > 0.2, (late, span)
    assert _kill_lab_run(tmp_path, launcher=True) == (0, 0.0)
    assert runlock.holder(tmp_path / "bound") is None
