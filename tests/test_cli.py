"""The command line: bad input is one paragraph and exit 2 before anything starts; finished runs
are never modified; `lab runs` tells live from interrupted runs and survives unreadable ones;
kernels die with the `lab` process."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

import lab.cli
import lab.notebook
from lab import records, runlock
from lab.cli import main as cli_main
from lab.cli import runs_table
from lab.config import ConfigError
from lab.data import DataError, load_dataset, train_size
from lab.lifecycle import CHECKPOINT

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
    (tmp_path / "dir.yaml").mkdir()
    cases = [
        (["run", str(ECHO)], "binary.yaml", r"parameter file .*binary.yaml cannot be read as "
         r"text \('utf-8' codec can't decode byte 0xff"),
        (["train"], "bad.yaml", r"parameter file .*bad.yaml is not valid YAML at line 3, "
         r"column 5 \(expected ',' or '\]', but got ':'\)"),
        (["train"], "missing.yaml", r"parameter file .*missing.yaml does not exist"),
        (["run", str(ECHO)], "list.yaml", r"parameter file .*list.yaml holds a list, not a "
         r"mapping"),
        (["train"], "dir.yaml", r"parameter file .*dir.yaml is a directory; expected a YAML "
         r"mapping of parameter: value lines"),
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
    monkeypatch.setattr(runlock.os, "access", lambda path, mode: False)
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
    ("epochs", "-3", "ConvConfig.epochs=-3 is out of range; allowed: [1, inf)"),
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


@pytest.mark.parametrize("damage", ["deleted", "cut"])
def test_rerun_of_a_finished_run_missing_rows_is_refused_and_force_replaces_it(
        tiny, tmp_path, capsys, damage):
    # A complete run whose row store lost a part was "already complete; nothing to do"
    # for `lab train` / `lab run` / `lab sweep`, while `lab runs` and `lab report` called
    # it unreadable and told the user to rerun it.
    args = ["train", "--out", str(tmp_path / "T")]
    args += [a for k, v in {**tiny, "epochs": 2}.items() for a in ("-p", k, str(v))]
    assert cli_main(args) == 0
    capsys.readouterr()
    part = sorted((tmp_path / "T" / "rows" / "epoch").iterdir())[-1]
    if damage == "deleted":
        part.unlink()
    else:
        part.write_bytes(part.read_bytes()[:-3])
    before = _files(tmp_path / "T")
    assert cli_main(args) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert "already holds a run whose record cannot be read" in err and "--force" in err
    assert (f"{part} (rows 1 to 2, committed) is missing" if damage == "deleted"
            else f"{part}: ") in err
    assert _files(tmp_path / "T") == before
    assert cli_main(args + ["--force"]) == 0
    capsys.readouterr()
    (kept,) = tmp_path.glob("T.old-*")  # the damaged run, moved aside, still damaged
    with pytest.raises(records.RecordError, match="rows"):
        records.check_stored_rows(kept)
    records.check_stored_rows(tmp_path / "T")
    assert records.load_record(tmp_path / "T")["status"] == "complete"
    assert len(records.load_metrics(tmp_path / "T"))
    assert cli_main(["runs", str(tmp_path / "T")]) == 0


def test_train_refuses_other_parameters(tiny, tmp_path, capsys):
    args = ["train", "--out", str(tmp_path / "T")]
    args += [a for k, v in {**tiny, "epochs": 1}.items() for a in ("-p", k, str(v))]
    assert cli_main(args) == 0
    capsys.readouterr()
    before = _files(tmp_path / "T")
    assert cli_main(args) == 0
    assert "already complete with these parameters; nothing to do" in capsys.readouterr().out
    other = ["train", "--out", str(tmp_path / "T")]
    other += [a for k, v in {**tiny, "epochs": 2}.items() for a in ("-p", k, str(v))]
    assert cli_main(other) == 2
    assert "(epochs: 1 there vs 2 now)" in _one_paragraph(capsys.readouterr().err)
    assert _files(tmp_path / "T") == before
    # Refused before any data is read: no dataset cache appears in a new data_dir.
    elsewhere = ["train", "--out", str(tmp_path / "T"), "-p", "data_dir", str(tmp_path / "D")]
    elsewhere += [a for k, v in {**tiny, "epochs": 1}.items() if k != "data_dir"
                  for a in ("-p", k, str(v))]
    assert cli_main(elsewhere) == 2
    assert "data_dir" in _one_paragraph(capsys.readouterr().err)
    assert not (tmp_path / "D").exists()


def test_n_train_beyond_the_data_is_refused(tmp_path, capsys):
    available = len(load_dataset("mnist1d", val_fraction=0.1).train)
    with pytest.raises(DataError, match=rf"n_train=100000 but mnist1d has only {available} "
                       r"training examples available .*allowed: 0 \(all of them\) or 1 to "
                       rf"{available}"):
        load_dataset("mnist1d", val_fraction=0.1, n_train=100000)
    assert len(load_dataset("mnist1d", val_fraction=0.1, n_train=available).train) == available
    # Refused before anything runs (exit 2, nothing created), by lab train and lab run.
    for command in (["train"], ["run", str(TRAIN)]):
        assert cli_main([*command, "--out", str(tmp_path / "T"), "-p", "n_train", "100000"]) == 2
        err = capsys.readouterr().err
        assert f"error: ConvConfig: n_train=100000 but mnist1d has only {available}" in err
        assert "Traceback" not in err and not (tmp_path / "T").exists()
    assert train_size("mnist1d", val_fraction=0.1) == available
    assert train_size("mnist1d", val_fraction=0.1, n_train=7) == 7


@pytest.mark.parametrize("rule, params, message", [
    ("kp_traffic", {}, "kp_traffic: rule_params.traffic_calibration_examples=512 but the "
                       "training set has only 256 examples; allowed: 1 to 256"),
    ("kp_traffic", {"traffic_calibration_examples": 64, "predictor_batch": 300},
     "kp_traffic: rule_params.predictor_batch=300 but the training set has only 256"),
    ("sdil", {"calibration_batch": 400}, "sdil: rule_params.calibration_batch=400 but"),
    ("lhfa", {"calibration_batch": 257}, "lhfa: rule_params.calibration_batch=257 but"),
])
def test_what_a_rule_draws_from_the_training_set_is_checked_before_a_run(
        tmp_path, capsys, no_kernel, rule, params, message):
    args = ["run", str(TRAIN), "--out", str(tmp_path / "r"), "-p", "n_train", "256",
            "-p", "rule", rule, *[a for k, v in params.items()
                                  for a in ("-p", f"rule_params.{k}", str(v))]]
    assert cli_main(args) == 2
    assert message in _one_paragraph(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


def test_the_alignment_probe_must_fit_in_the_training_set(tmp_path, capsys, no_kernel):
    args = ["run", str(TRAIN), "--out", str(tmp_path / "r"), "-p", "n_train", "100",
            "-p", "alignment_every", "1"]
    assert cli_main(args) == 2
    assert ("ConvConfig.alignment_batch=256 but the training set has only 100 examples" in
            _one_paragraph(capsys.readouterr().err))
    assert cli_main([*args, "-p", "alignment_every", "0"]) == 2  # given twice: refused


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


def test_runs_of_one_run_names_its_directory(tmp_path, capsys):
    # `lab runs RUN_DIR` (or its record.json) showed "." as the run's dir.
    _record(tmp_path / "try-kp", "complete")
    for target in (tmp_path / "try-kp", tmp_path / "try-kp" / "record.json"):
        table, bad = runs_table(target)
        assert list(table["dir"]) == ["try-kp"] and bad == []
        assert cli_main(["runs", str(target)]) == 0
        assert "try-kp" in capsys.readouterr().out.split()
    _record(tmp_path / "other", "complete")  # a directory of runs: relative to it, as before
    assert sorted(runs_table(tmp_path)[0]["dir"]) == ["other", "try-kp"]


@pytest.mark.parametrize("command", [["runs", ""], ["sweep", ""],
                                     ["report", ""], ["run", "", "--out", "x"]])
def test_an_empty_path_to_read_is_refused(tmp_path, capsys, monkeypatch, command):
    # `lab runs "$DIR"` with DIR unset listed the working directory without a word.
    monkeypatch.chdir(tmp_path)
    _record(tmp_path / "a", "complete")
    with pytest.raises(SystemExit) as exit_:
        cli_main(command)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"an empty path ({command[1]!r}); give a path (is a shell variable unset?)" in err
    assert list(tmp_path.iterdir()) == [tmp_path / "a"]


def test_sweep_interrupted_names_a_command_to_paste(tmp_path, capsys, monkeypatch):
    # The resume hint after Ctrl-C must survive a copy-paste: a path with a space is quoted.
    import lab.sweep

    protocol = tmp_path / "my protocols" / "p.yaml"
    protocol.parent.mkdir()
    protocol.write_text("x")
    monkeypatch.setattr(lab.sweep, "load_protocol", lambda path: object())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(lab.sweep, "run_sweep", interrupted)
    assert cli_main(["sweep", str(protocol)]) == 130
    err = " ".join(capsys.readouterr().err.split())
    assert f"run `lab sweep '{protocol}'` again to finish the remaining runs" in err
    assert "workers go on" not in err
    # on an external cluster: the hint names it (a rerun without it would start a local
    # cluster on the client machine), and says its started runs go on
    assert cli_main(["sweep", str(protocol), "--scheduler", "tcp://h:8786",
                     "--workers", "2"]) == 130
    err = " ".join(capsys.readouterr().err.split())
    assert f"run `lab sweep '{protocol}' --scheduler tcp://h:8786 --workers 2` again to " \
           "finish the remaining runs (finished ones are kept)" in err
    assert "runs already started on tcp://h:8786's workers go on to the end (`lab runs " \
           f"'{protocol}'` shows them running)" in err


def test_a_run_linked_in_from_elsewhere_is_listed(tmp_path, capsys):
    # A run moved to another disk and symlinked back was left out of `lab runs DIR`,
    # load_runs and load_metrics (Path.glob("**") follows no links on 3.11), while the
    # sweep and the report counted it. A link to a parent must not loop.
    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    _record(runs / "a", "complete")
    _record(elsewhere / "b", "complete")
    (runs / "b").symlink_to(elsewhere / "b", target_is_directory=True)
    (runs / "a" / "up").symlink_to(runs, target_is_directory=True)  # a loop
    (runs / "gone").symlink_to(tmp_path / "nothing")  # dangling
    # a link to a tree that holds no runs (a dataset, /) is not walked
    (tmp_path / "data" / "deep" / "r").mkdir(parents=True)
    (tmp_path / "data" / "deep" / "r" / "record.json").write_text("{}")
    (runs / "data").symlink_to(tmp_path / "data", target_is_directory=True)
    # a linked directory of runs is
    _record(tmp_path / "other-out" / "c", "complete")
    (runs / "more").symlink_to(tmp_path / "other-out", target_is_directory=True)
    assert [p.parent.name for p in records.find_records(runs)] == ["a", "b", "c"]
    table, bad = runs_table(runs)
    assert list(table["dir"]) == ["a", "b", "more/c"] and set(table["status"]) == {"complete"}
    assert sorted(records.load_runs(runs)["run_id"]) == ["a", "b", "c"]
    assert cli_main(["runs", str(runs)]) == 0
    assert {"a", "b", "more/c"} <= set(capsys.readouterr().out.split())


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
    # Replaced with --force, the broken run is kept aside: shown, no longer a failure.
    (tmp_path / "b").rename(tmp_path / "b.old-20261130T170000Z")
    _record(tmp_path / "b", "complete")
    assert cli_main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 run(s) moved aside by --force could not be read (not counted):" in out
    assert "b.old-20261130T170000Z: " in out and "could not be read:\n" not in out


@pytest.mark.parametrize("cut", ["half a line", "a whole line", "emptied"])
def test_runs_lists_a_complete_run_with_a_cut_row_store_as_unreadable(tmp_path, capsys, cut):
    # `lab runs` read only record.json: a run whose rows were cut short showed
    # "complete", while load_metrics and `lab report` refused it.
    for name in ("good", "cut"):
        record = records.new_record(run_id=name, kind="notebook", config={"x": 1})
        record.update(status="complete", trajectory=[{"epoch": e, "loss": 1.0 / (e + 1)}
                                                     for e in range(3)])
        records.save_run(tmp_path / name, record)
    (part,) = (tmp_path / "cut" / "rows" / "epoch").iterdir()
    text = part.read_text()
    part.write_text({"half a line": text[:-5], "a whole line": "".join(
        text.splitlines(keepends=True)[:2]), "emptied": ""}[cut])
    with pytest.raises(records.RecordError):
        records.load_metrics(tmp_path / "cut")
    table, unreadable = runs_table(tmp_path)
    assert table["run_id"].tolist() == ["good"]
    assert [w for w, _ in unreadable] == ["cut"]
    (reason,) = [r for _, r in unreadable]
    lines = {"half a line": 2, "a whole line": 2, "emptied": 0}[cut]
    assert f"{part}: the row part holds {lines} complete lines" in reason
    assert "3 rows, as its name says (truncated? restore it, or replace the run: --force)" in reason
    assert cli_main(["runs", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "1 run(s) could not be read:" in out and "good" in out
    records.check_stored_rows(tmp_path / "good")  # the intact one passes
    # the library's run table gives the same verdict (a filter on status == "complete"
    # must not count it), for the run alone and for the directory of runs
    for root in (tmp_path / "cut", tmp_path):
        with pytest.raises(records.RecordError, match=rf"{part.name}: the row part holds "
                                                      rf"{lines} complete"):
            records.load_runs(root)
    assert records.load_runs(tmp_path / "good")["status"].tolist() == ["complete"]


def test_load_runs_refuses_a_finished_run_missing_a_row_part(tmp_path):
    record = records.new_record(run_id="r", kind="notebook", config={"x": 1})
    record.update(status="complete", trajectory=[{"epoch": e, "loss": 1.0} for e in range(3)])
    records.save_run(tmp_path / "r", record)
    (part,) = (tmp_path / "r" / "rows" / "epoch").iterdir()
    part.unlink()
    with pytest.raises(records.RecordError, match=r"rows\.epoch"):
        records.load_runs(tmp_path / "r")


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
    env = dict(os.environ)
    if not launcher:  # jupyter's own TCP kernel: its connection file stays where it was put
        env["TMPDIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, env=env)
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


# ---------------------------------------------------------------------------
# a new user's trial: what the CLI must refuse or say in one line


def test_a_parameter_given_twice_is_refused(tmp_path, capsys, no_kernel):
    assert cli_main(["run", str(TRAIN), "--out", str(tmp_path / "r"), "-p", "epochs", "1",
                     "-p", "epochs", "2"]) == 2
    assert "-p epochs is given twice ('1' and '2'); give each parameter once" in \
        capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_yaml_files_read_1e_minus_3_as_a_float(tmp_path):
    from lab.cli import collect_params
    from lab.config import load_yaml

    path = tmp_path / "p.yaml"
    path.write_text("lr: 1e-3\nweight_decay: 5E-4\nlist: [1e-3, 2.5e+2, 1_000]\nname: x1e3\n")
    assert collect_params(None, [str(path)]) == {"lr": 0.001, "weight_decay": 0.0005,
                                                 "list": [0.001, 250.0, "1_000"],
                                                 "name": "x1e3"}  # YAML 1.2: no "_" in ints
    assert load_yaml("a: 1e3") == {"a": 1000.0} and isinstance(load_yaml("a: 1e3")["a"], float)
    import yaml  # PyYAML's own safe loader is left as it is
    assert yaml.safe_load("a: 1e-3") == {"a": "1e-3"}


def test_yaml_numbers_and_dates_follow_yaml_1_2(tmp_path):
    # YAML 1.1 (PyYAML's) read 010 as eight, 1:30 as ninety and 2026-11-30 as a date that
    # JSON cannot hold; a file and -p must read a value alike.
    from lab.cli import collect_params, parse_value
    from lab.config import load_yaml

    text = "a: 010\nb: 1:30\nc: 2026-11-30\nd: 0o17\ne: 0x1F\nf: -7\ng: 0b101\nh: 12:30:00"
    want = {"a": 10, "b": "1:30", "c": "2026-11-30", "d": 15, "e": 31, "f": -7, "g": "0b101",
            "h": "12:30:00"}
    assert load_yaml(text) == want
    (tmp_path / "p.yaml").write_text(text)
    assert collect_params([[k, str(v)] for k, v in load_yaml(text.replace(": ", ": '")
                                                               .replace("\n", "'\n") + "'")
                           .items()], None) == want
    assert collect_params(None, [str(tmp_path / "p.yaml")]) == want
    assert type(load_yaml("a: 010")["a"]) is int and type(load_yaml("a: 1.")["a"]) is float
    # What YAML would read as nothing stays the text given; only null and ~ are None.
    assert parse_value("") == "" and parse_value("#cache") == "#cache"
    assert parse_value("null") is None and parse_value("~") is None
    assert math.isinf(parse_value("inf")) and math.isnan(parse_value("nan"))


def test_yaml_booleans_are_true_and_false_only():
    from lab.cli import parse_value
    from lab.config import load_yaml

    assert load_yaml("a: off\nb: yes\nc: on\nd: no\ne: true\nf: False\ng: Y") == {
        "a": "off", "b": "yes", "c": "on", "d": "no", "e": True, "f": False, "g": "Y"}
    assert parse_value("off") == "off" and parse_value("true") is True


def test_a_key_given_twice_in_a_file_is_refused(tmp_path, capsys, no_kernel):
    from lab.config import YAMLError, load_yaml

    with pytest.raises(YAMLError, match=r"key 'a' is given twice \(line 1\)"):
        load_yaml("{a: 1, a: 2}")
    with pytest.raises(YAMLError, match=r"key 'lr' is given twice \(lines 2 and 3\)"):
        load_yaml("fixed:\n  lr: 1\n  lr: 2\n")
    assert load_yaml("a: {x: 1}\nb: {x: 2}") == {"a": {"x": 1}, "b": {"x": 2}}
    (tmp_path / "dup.yaml").write_text("epochs: 2\nepochs: 3\n")
    assert cli_main(["train", "--out", str(tmp_path / "r"), "-f", str(tmp_path / "dup.yaml")]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert "parameter file " in err and ("dup.yaml is not valid YAML at line 2, column 1 (key "
                                         "'epochs' is given twice (lines 1 and 2); give each "
                                         "key once)") in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("workers", ["-2", "0", "two"])
def test_sweep_workers_must_be_positive(workers, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["sweep", str(ROOT / "protocols" / "demo.yaml"), "--workers", workers])
    assert exit_.value.code == 2
    assert f"--workers {workers!r}: give a whole number >= 1" in capsys.readouterr().err


def test_an_unreachable_scheduler_is_one_line(capsys):
    assert cli_main(["sweep", str(ROOT / "protocols" / "demo.yaml"), "--scheduler",
                     "bogus", "-q"]) == 2
    err = capsys.readouterr().err
    assert "error: cannot reach the Dask scheduler 'bogus' (" in err
    assert "Traceback" not in err


def test_a_refused_or_unknown_scheduler_address_is_said_at_once(capsys):
    # A port where nothing listens was reported as a timeout, after 20 s of retries.
    import socket

    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    protocol = str(ROOT / "protocols" / "demo.yaml")
    for address, why in [(f"tcp://127.0.0.1:{port}", f"nothing listens on port {port} of "
                                                      "127.0.0.1 (connection refused)"),
                         ("tcp://no-such-host.invalid:8786", "no host named "
                                                             "'no-such-host.invalid': ")]:
        start = time.perf_counter()
        assert cli_main(["sweep", protocol, "--scheduler", address, "-q"]) == 2
        assert time.perf_counter() - start < 10
        assert capsys.readouterr().err.startswith(
            f"error: cannot reach the Dask scheduler {address!r} ({why}")


def test_a_scheduler_that_never_answers_or_has_no_workers_is_one_line(capsys, monkeypatch,
                                                                       tmp_path):
    # A port where something else listens (an HTTP server) hung past the connect timeout;
    # a scheduler without workers left the sweep at 0 % for ever, saying nothing.
    import socket

    from distributed import LocalCluster

    import lab.sweep

    monkeypatch.setattr(lab.sweep, "CONNECT_S", 1)
    monkeypatch.setattr(lab.sweep, "WORKER_WAIT_S", 1)
    protocol = str(ROOT / "protocols" / "demo.yaml")
    with socket.socket() as mute:  # accepts connections, never says a word
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        address = f"tcp://127.0.0.1:{mute.getsockname()[1]}"
        assert cli_main(["sweep", protocol, "--scheduler", address, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the Dask scheduler {address!r} (") and \
        "Traceback" not in err
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        assert cli_main(["sweep", protocol, "--scheduler", cluster.scheduler_address,
                         "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the Dask scheduler {cluster.scheduler_address!r} has no "
                          "workers (none joined in 1 s); start one (`dask worker")


def test_ctrl_c_during_a_run_is_one_line(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lab.notebook, "execute", interrupted)
    out = tmp_path / "r"
    # Stopped before the run directory was made: nothing to resume, and it says so.
    assert cli_main(["run", str(TRAIN), "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip() == \
        f"interrupted before the run started; nothing was made in {out}"
    out.mkdir()
    # Before a checkpoint (checkpoint_every 0 saves only at the end): it starts afresh. It
    # said "resume ... from its last checkpoint" with none on disk.
    assert cli_main(["run", str(TRAIN), "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip() == (
        f"interrupted before the run's first checkpoint; the same command again starts {out} "
        "from the beginning (checkpoint_every sets how often a run saves)")
    (out / CHECKPOINT).write_bytes(b"")
    assert cli_main(["run", str(TRAIN), "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == (f"interrupted; run the same command again to resume {out} from its "
                           "last checkpoint")
    monkeypatch.setattr("lab.train.train_conv", interrupted)
    assert cli_main(["train", "--out", str(out), "-p", "epochs", "1"]) == 130
    assert "interrupted; run the same command again" in capsys.readouterr().err


def test_the_clis_checkpoint_name_is_the_lifecycles():
    import lab.cli

    assert lab.cli._CHECKPOINT == CHECKPOINT


def test_sigterm_during_a_run_is_ctrl_c_with_exit_143(tmp_path, capsys, monkeypatch):
    # SIGTERM killed `lab run` / `lab sweep` silently (exit -15, Dask's leaked semaphores).
    seen = []

    def terminated(*args, **kwargs):
        seen.append(signal.getsignal(signal.SIGTERM))
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, in this frame
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the run")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(lab.notebook, "execute", terminated)
    out = tmp_path / "r"
    out.mkdir()
    (out / CHECKPOINT).write_bytes(b"")
    assert cli_main(["run", str(TRAIN), "--out", str(out)]) == 143
    assert capsys.readouterr().err.strip() == (
        f"interrupted; run the same command again to resume {out} from its last checkpoint")
    assert seen and seen[0] is not before  # lab's handler while the command ran
    assert signal.getsignal(signal.SIGTERM) is before  # and the caller's after it
    # Ctrl-C itself still exits 130 after a SIGTERM in an earlier call
    monkeypatch.setattr(lab.notebook, "execute", lambda *a, **k: (_ for _ in ()).throw(
        KeyboardInterrupt))
    assert cli_main(["run", str(TRAIN), "--out", str(out)]) == 130


def test_ctrl_c_while_starting_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    # A Ctrl-C in the first second of `lab ...` (importing) printed Python's traceback.
    # While a command imports its modules (here: `lab runs` reading a table):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lab.cli, "_runs", interrupted)
    assert cli_main(["runs", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip() == (
        "interrupted; `lab runs` stopped before it changed any run or report")
    # While the console script imports lab.cli itself:
    import builtins

    import lab.__main__ as entry

    real_import = builtins.__import__

    def importing(name, *args, **kwargs):
        if name == "lab.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", importing)
    assert entry.main() == 130
    assert capsys.readouterr().err.strip() == (
        "interrupted while lab was starting; nothing was done")


def test_runs_moved_aside_are_left_out_of_load_runs_and_load_metrics(tmp_path):
    for name, loss in (("r", 1.0), ("r.old-20261130T170000Z", 2.0)):
        record = records.new_record(run_id="r", kind="notebook", config={"x": loss})
        record["final"] = {"loss": loss}
        record["status"] = "complete"
        records.save_run(tmp_path / name, record)
    assert list(records.load_runs(tmp_path)["final.loss"]) == [1.0]
    assert list(records.load_metrics(tmp_path)["value"]) == [1.0]
    # Included on request, under their directory's name: the two runs stay apart.
    both = records.load_runs(tmp_path, include_old=True)
    assert dict(zip(both["run_id"], both["final.loss"])) == {"r": 1.0,
                                                             "r.old-20261130T170000Z": 2.0}
    both = records.load_metrics(tmp_path, include_old=True)
    assert dict(zip(both["run_id"], both["value"])) == {"r": 1.0, "r.old-20261130T170000Z": 2.0}
    # Asked for by its own path, an old run loads.
    old = tmp_path / "r.old-20261130T170000Z"
    assert list(records.load_runs(old)["final.loss"]) == [2.0]


def test_onecycle_with_too_few_steps_is_refused_not_run_constant(tmp_path, capsys, no_kernel):
    # 1 epoch x ceil(256 / 128) = 2 steps: torch's one-cycle cannot run; a constant rate
    # recorded as 'onecycle' would be a record that lies.
    args = ["run", str(TRAIN), "--out", str(tmp_path / "r"), "-p", "n_train", "256",
            "-p", "epochs", "1", "-p", "batch_size", "128"]
    assert cli_main(args) == 2
    assert ("ConvConfig.schedule='onecycle' needs at least 4 optimizer steps; this run has 2 "
            "(epochs=1 x ceil(256 training examples / batch_size=128)); use "
            "schedule='constant' or 'cosine'") in _one_paragraph(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()
    from lab.train import ConvConfig, train_conv

    with pytest.raises(ConfigError, match=r"this run has 2 "):
        train_conv(ConvConfig(n_train=256, epochs=1, batch_size=128), tmp_path / "py")
    assert not (tmp_path / "py").exists()


def test_a_finished_run_whose_data_file_changed_is_not_done(tmp_path):
    # Same parameters, other data: rerunning must not say "nothing to do".
    from lab.data.identity import changed_files, file_identity
    from lab.notebook import Resolved, RunConflict, decide

    data = tmp_path / "prices.csv"
    data.write_text("close\n1\n2\n")
    run = tmp_path / "run"
    record = records.new_record(run_id="run", kind="notebook", config={"x": 1})
    record["status"] = "complete"
    record["data"] = {"csv": file_identity(data), "split": {"n_train": 2}}
    records.save_run(run, record)
    resolved = Resolved({}, {"x": 1}, full=False)
    assert decide(run, resolved, "never")[0] == "done"
    data.write_text("close\n1\n3\n")  # same size, other content
    assert changed_files(record["data"]) == [f"{data}: same size, other content (sha256)"]
    with pytest.raises(RunConflict, match=r"already holds a complete run whose data changed "
                                          r"since \(.*prices.csv: same size, other content"):
        decide(run, resolved, "never")
    assert decide(run, resolved, "always")[0] == "replace"  # --force moves it aside
    data.write_text("close\n1\n2\n3\n")
    assert changed_files(record["data"]) == [f"{data}: size 10 then, 12 now"]
    data.unlink()
    assert changed_files(record["data"]) == [f"{data}: the file is gone"]


def test_a_finished_run_on_the_default_data_dir_sees_where_it_points_now(tmp_path,
                                                                          monkeypatch):
    # data_dir "" with $LAB_DATA_DIR moved to other data: the run's own directory is
    # untouched, but these parameters would now train on what the new one holds.
    from test_train_conv import _shuffle_mnist1d_cache

    from lab.data import content_identity, default_data_dir
    from lab.notebook import Resolved, RunConflict, decide

    used, other = tmp_path / "used", tmp_path / "other"
    for d in (used, other):
        shutil.copytree(default_data_dir() / "mnist1d", d / "mnist1d")
    _shuffle_mnist1d_cache(other)
    run = tmp_path / "run"
    record = records.new_record(run_id="run", kind="notebook", config={"data_dir": ""})
    record["status"] = "complete"
    record["data"] = content_identity("mnist1d", used)
    records.save_run(run, record)
    resolved = Resolved({}, {"data_dir": ""}, full=False)
    monkeypatch.setenv("LAB_DATA_DIR", str(used))
    assert decide(run, resolved, "never")[0] == "done"
    monkeypatch.setenv("LAB_DATA_DIR", str(other))
    with pytest.raises(RunConflict, match=r"already holds a complete run whose data changed "
                                          rf"since \(mnist1d in {re.escape(str(other))} "
                                          r"\(data_dir '' now: \$LAB_DATA_DIR"):
        decide(run, resolved, "never")


def test_report_of_another_notebook_does_not_overwrite_the_protocols_own(tmp_path, capsys):
    fixture = tmp_path / "summary"
    shutil.copytree(ROOT / "tests" / "fixtures" / "summary", fixture)
    summary = ROOT / "notebooks" / "10-summary.ipynb"
    text = (fixture / "protocol.yaml").read_text().replace(
        "../../../notebooks/01-train-conv.ipynb", str(ROOT / "notebooks" / "01-train-conv.ipynb"))
    (fixture / "protocol.yaml").write_text(f"{text}report: {summary}\n")
    other = tmp_path / "my-summary.ipynb"
    shutil.copy(summary, other)
    reports = tmp_path / "reports"
    protocol = str(fixture / "protocol.yaml")
    # A run of an older grid in the protocol's out: left out of the report, and said so.
    shutil.copytree(fixture / "runs" / "lr-0.05_rule-bp_seed-0", fixture / "runs" / "lr-0.5")
    assert cli_main(["report", protocol, "--out", str(reports)]) == 0
    assert ("note: 1 run directory in the protocol's out is not among its runs (lr-0.5): a "
            "grid value removed since, or another protocol's? `lab runs` on the directory "
            "lists them; the report leaves it out") in capsys.readouterr().err
    assert cli_main(["report", protocol, "--notebook", str(other), "--out", str(reports)]) == 0
    assert f"report: {(reports / 'fixture.my-summary.html').resolve()}" in capsys.readouterr().out
    assert sorted(p.name for p in reports.iterdir() if not p.name.startswith(".")) == [
        "fixture", "fixture.html", "fixture.my-summary", "fixture.my-summary.html"]
    # --runs elsewhere: reported, with a note that its values were not checked
    shutil.copytree(fixture / "runs", tmp_path / "elsewhere")
    assert cli_main(["report", protocol, "--runs", str(tmp_path / "elsewhere"), "--out",
                     str(tmp_path / "r3")]) == 0
    assert (f"note: --runs {tmp_path / 'elsewhere'} is not the protocol's out "
            f"({fixture / 'runs'}): its runs are checked for presence and completeness, not "
            "against the protocol's values") in capsys.readouterr().err
    # --runs naming no directory is refused before anything executes
    assert cli_main(["report", protocol, "--runs", str(tmp_path / "nope"), "--out",
                     str(tmp_path / "r2")]) == 2
    assert f"--runs {tmp_path / 'nope'}: no such directory of runs" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()


def test_report_of_another_protocol_with_the_same_name_is_refused(tmp_path, capsys):
    # A protocol copied and edited without a new `name:` wrote the same report file as
    # the original, silently replacing its report.
    fixture = tmp_path / "summary"
    shutil.copytree(ROOT / "tests" / "fixtures" / "summary", fixture)
    text = (fixture / "protocol.yaml").read_text().replace(
        "../../../notebooks/01-train-conv.ipynb", str(ROOT / "notebooks" / "01-train-conv.ipynb"))
    (fixture / "protocol.yaml").write_text(
        f"{text}report: {ROOT / 'notebooks' / '10-summary.ipynb'}\n")
    copy = fixture / "copy.yaml"
    shutil.copy(fixture / "protocol.yaml", copy)
    reports = tmp_path / "reports"
    assert cli_main(["report", str(fixture / "protocol.yaml"), "--out", str(reports)]) == 0
    made = (reports / "fixture.html").read_bytes()
    capsys.readouterr()
    assert cli_main(["report", str(copy), "--out", str(reports)]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert f"{reports / 'fixture'}.html is the report of {fixture / 'protocol.yaml'}, another " \
           f"protocol with the name 'fixture'; a report of {copy} would replace it. Give one " \
           "of the two protocols its own `name:`" in err
    assert (reports / "fixture.html").read_bytes() == made  # untouched
    # the same protocol again, and after the original is gone, the copy, replace it
    assert cli_main(["report", str(fixture / "protocol.yaml"), "--out", str(reports)]) == 0
    (fixture / "protocol.yaml").rename(fixture / "old.yaml.bak")
    assert cli_main(["report", str(copy), "--out", str(reports)]) == 0


def test_lab_runs_into_a_closed_pipe_is_quiet():
    """`lab runs ... | head`: the reader leaves early; no BrokenPipeError traceback."""
    code = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); "
            "from lab.cli import main; sys.exit(main(['runs', sys.argv[1]]))")
    done = subprocess.run([sys.executable, "-c", code,
                           str(ROOT / "tests" / "fixtures" / "summary" / "protocol.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_dotted_key_and_its_whole_dict_together_are_refused():
    from lab.cli import collect_params

    for pairs in ([["rule_params", "{traffic_ratio: 2}"], ["rule_params.traffic_ratio", "3"]],
                  [["rule_params.traffic_ratio", "3"], ["rule_params", "{traffic_ratio: 2}"]]):
        with pytest.raises(ConfigError, match=r"^rule_params.traffic_ratio \(given as -p\) sets "
                                              r"a key inside rule_params, which is given whole "
                                              r"there too \('\{traffic_ratio: 2\}'\); give "
                                              r"either"):
            collect_params(pairs, None)
    assert collect_params([["rule_params.a", "1"], ["rule_params.b", "2"]], None) == {
        "rule_params.a": 1, "rule_params.b": 2}


def test_a_later_layer_wins_over_a_files_dotted_or_whole_dict(tmp_path):
    # -p comes after -f: a whole dict given later replaces the file's dotted leaves (it
    # was dropped without a word, the file's leaf applied last); a later dotted key
    # still wins over an earlier whole dict. One file holding both is refused.
    from lab.cli import collect_params
    from lab.notebook import apply_params

    dotted, whole, both = (tmp_path / n for n in ("dotted.yaml", "whole.yaml", "both.yaml"))
    dotted.write_text("rule: fa\nrule_params.feedback_scale: 2.0\n")
    whole.write_text("rule_params: {feedback_scale: 2.0, feedback_seed: 4}\n")
    both.write_text("rule_params: {feedback_scale: 2.0}\nrule_params.feedback_seed: 4\n")
    params = collect_params([["rule_params", "{feedback_scale: 0.5}"]], [str(dotted)])
    assert params == {"rule": "fa", "rule_params": {"feedback_scale": 0.5}}
    assert apply_params({}, params)["rule_params"] == {"feedback_scale": 0.5}
    params = collect_params([["rule_params.feedback_scale", "0.5"]], [str(whole)])
    assert apply_params({}, params)["rule_params"] == {"feedback_scale": 0.5,
                                                       "feedback_seed": 4}
    params = collect_params(None, [str(dotted), str(whole)])  # the later file, whole
    assert params == {"rule": "fa", "rule_params": {"feedback_scale": 2.0, "feedback_seed": 4}}
    with pytest.raises(ConfigError, match=rf"^rule_params.feedback_seed \(given in {both}\) "
                                          r"sets a key inside rule_params, which is given "
                                          r"whole there too \(\{'feedback_scale': 2.0\}\)"):
        collect_params(None, [str(both)])


def test_runs_table_prints_counts_as_counts(tmp_path, capsys):
    for name, updates, acc in (("a", 60, 1.0), ("b", 58, 0.5)):
        record = records.new_record(run_id=name, kind="notebook", config={"x": 1})
        record.update(status="complete", final={"ep_updates": updates, "val_acc": acc,
                                                "val_loss": 2.0, "ratio": 0.25})
        records.save_run(tmp_path / name, record)
    table, _ = runs_table(tmp_path)
    assert str(table["ep_updates"].dtype) == "Int64" and table["ep_updates"].tolist() == [60, 58]
    # Accuracies and losses stay numbers with decimals even where they happen to be whole.
    assert table["val_acc"].dtype.kind == table["val_loss"].dtype.kind == "f"
    assert cli_main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert " 60 " in out and "60.0000" not in out and "1.0000" in out


def test_lab_runs_of_a_protocol_edited_to_a_bad_value_is_one_line(tmp_path, capsys):
    # Comparing the recorded runs with the protocol resolves its parameters: a bad value
    # found there is the same one-line error as `lab sweep` gives, not a traceback.
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "01-train-conv.ipynb"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "notebook": str(notebook), "out": "runs",
                                    "fixed": {"lr": -1}, "grid": {"seed": [0]}}))
    record = records.new_record(run_id="seed-0", kind="conv", config={"seed": 0})
    record["status"] = "complete"
    records.save_run(tmp_path / "runs" / "seed-0", record)
    assert cli_main(["runs", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: protocol ") and "Traceback" not in err
    assert "ConvConfig.lr=-1 is out of range; allowed: (0.0, inf) (run seed-0)" in err


def _reported_protocol(tmp_path: Path, seeds: list[int]) -> Path:
    """A conv protocol over ``seeds`` with 10-summary as its report, runs in tmp_path/runs."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({
        "name": "p", "notebook": str(TRAIN), "out": "runs",
        "report": str(ROOT / "notebooks" / "10-summary.ipynb"), "grid": {"seed": seeds}}))
    return path


def test_report_checks_the_protocols_own_runs_however_runs_is_spelled(tmp_path, capsys):
    # `--runs <the protocol's out>` skipped the stale check and reported old runs, exit 0.
    path = _reported_protocol(tmp_path, [0])
    record = records.new_record(run_id="seed-0", kind="conv", config={"seed": 0})
    record["status"] = "complete"
    records.save_run(tmp_path / "runs" / "seed-0", record)
    for extra in ([], ["--runs", str(tmp_path / "runs")], ["--runs", str(tmp_path / "runs/.")]):
        assert cli_main(["report", str(path), "--out", str(tmp_path / "rep"), *extra]) == 2
        err = capsys.readouterr().err
        assert "1 run(s) of" in err and "are not what the protocol asks now" in err
    assert not (tmp_path / "rep").exists()


def test_a_finished_run_on_a_read_only_disk_is_nothing_to_do(tmp_path, capsys, monkeypatch):
    # A complete run on a read-only mount: the same command said "not writable" (exit 2),
    # though it needs no write. Other parameters or --force still need one: refused.
    args = ["train", "--out", str(tmp_path / "r"), "-p", "dataset", "mnist1d", "-p", "n_train",
            "256", "-p", "depth", "8", "-p", "width", "4", "-p", "epochs", "1", "-p",
            "schedule", "constant", "-p", "progress", "false"]
    assert cli_main(args) == 0
    capsys.readouterr()

    def read_only(out, name, purpose="the run"):
        raise ConfigError(f"{name} {out}: nothing can be written in the run directory: "
                          "[Errno 30] Read-only file system")

    monkeypatch.setattr(runlock, "check_writable_dir", read_only)
    assert cli_main(args) == 0
    assert "r: already complete with these parameters; nothing to do" in capsys.readouterr().out
    assert cli_main(args + ["--force"]) == 2
    assert "Read-only file system" in capsys.readouterr().err
    assert cli_main(args + ["-p", "lr", "0.2"]) == 2
    assert "with other parameters (lr: " in capsys.readouterr().err
    assert cli_main(["run", str(TRAIN), "--out", str(tmp_path / "new")]) == 2
    assert "Read-only file system" in capsys.readouterr().err


def test_report_before_any_run_is_refused_at_once(tmp_path, capsys):
    # It started a kernel (16 s) to list every run as missing, and left a failed report.
    path = _reported_protocol(tmp_path, [0, 1])
    assert cli_main(["report", str(path), "--out", str(tmp_path / "rep")]) == 2
    assert capsys.readouterr().err == (
        f"error: none of the 2 run(s) of {path} has a record in {tmp_path / 'runs'} yet, so no "
        f"report was made: run `lab sweep {path}` first\n")
    assert not (tmp_path / "rep").exists()


def test_report_while_a_run_trains_is_refused_at_once(tmp_path, capsys):
    # It ran the whole analysis notebook (50 s under load), then failed on the running run.
    path = _reported_protocol(tmp_path, [0, 1])
    run = tmp_path / "runs" / "seed-1"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli_main(["report", str(path), "--out", str(tmp_path / "rep")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: 1 run(s) of {path} are still training, so no report "
                              "was made (let the sweep finish, then report again):\n"
                              f"  - seed-1: held by pid {holder.pid}\n"), err
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "rep").exists()


def test_lab_runs_refuses_a_protocol_the_sweep_refuses(tmp_path, capsys):
    # With no runs yet, a bad value made every run read "missing" (exit 0).
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "01-train-conv.ipynb"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "notebook": str(notebook), "out": "runs",
                                    "fixed": {"nesterov": "yes"}, "grid": {"seed": [0]}}))
    assert cli_main(["runs", str(path)]) == 2
    err = capsys.readouterr().err
    assert "ConvConfig.nesterov must be bool, got 'yes'" in err and "missing" not in err


# ---------------------------------------------------------------------------
# trial 6: `lab runs` lists runs made elsewhere; -p takes any YAML number; -p dicts


def _conv_protocol(tmp_path: Path, fixed: dict) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "notebook": str(TRAIN), "out": "runs",
                                    "fixed": fixed, "grid": {"seed": [0]}}))
    return path


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_lab_runs_lists_runs_made_on_a_gpu_machine_but_sweep_refuses(tmp_path, capsys):
    from lab.notebook import resolve_parameters

    fixed = {"epochs": 1, "device": "cuda"}
    path = _conv_protocol(tmp_path, fixed)
    # The run as a GPU machine made it: its whole resolved config, device cuda.
    config = resolve_parameters(TRAIN, {**fixed, "seed": 0}, preflight=False).config
    assert config["device"] == "cuda"
    record = records.new_record(run_id="seed-0", kind="conv", config=config)
    record["status"] = "complete"
    records.save_run(tmp_path / "runs" / "seed-0", record)
    assert cli_main(["runs", str(path)]) == 0
    out = capsys.readouterr().out
    assert "seed-0" in out and "complete" in out and "missing" not in out
    # A sweep would start runs here: this machine's check still applies.
    assert cli_main(["sweep", str(path), "-q"]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert "1 of 1 runs have parameters the notebook refuses, so none was started: " in err
    assert "cuda" in err


def test_lab_runs_lists_runs_whose_csv_exists_only_where_they_were_made(tmp_path, capsys):
    # The file check was in the config's construction, so `lab runs` refused to list
    # them ("does not exist") though `lab report` rendered them.
    from lab.notebook import resolve_parameters

    cfc = ROOT / "notebooks" / "03-train-cfc-aux.ipynb"
    fixed = {"steps": 10, "source": "csv", "csv_path": "/cluster/data/prices.csv",
             "column": "close"}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "notebook": str(cfc), "out": "runs",
                                    "fixed": fixed, "grid": {"seed": [0]}}))
    config = resolve_parameters(cfc, {**fixed, "seed": 0}, preflight=False).config
    record = records.new_record(run_id="seed-0", kind="cfc_aux", config=config)
    record["status"] = "complete"
    records.save_run(tmp_path / "runs" / "seed-0", record)
    assert cli_main(["runs", str(path)]) == 0
    assert "complete" in capsys.readouterr().out
    assert cli_main(["sweep", str(path), "-q"]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert "so none was started: CfCAuxConfig.csv_path='/cluster/data/prices.csv' does not " \
        "exist or is not a file" in err


def test_lab_runs_still_refuses_a_bad_type_in_its_own_words(tmp_path, capsys):
    path = _conv_protocol(tmp_path, {"nesterov": "on"})
    assert cli_main(["runs", str(path)]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert "so its runs cannot be listed: ConvConfig.nesterov must be bool, got 'on' (str); " \
        "write true or false" in err
    assert "started" not in err


@pytest.fixture
def captured(monkeypatch):
    """The parameters `lab run` would execute with, without running anything."""
    seen = {}

    def execute(notebook, out, params, **kwargs):
        seen.update(params)
        raise ConfigError("captured")

    monkeypatch.setattr(lab.notebook, "execute", execute)
    return seen


@pytest.mark.parametrize("text, value", [("-1e-3", -0.001), ("-1E+2", -100.0),
                                         ("-.5e-1", -0.05), ("-5", -5), ("-0.25", -0.25),
                                         ("-inf", -math.inf)])
def test_a_negative_number_is_a_p_value(tmp_path, capsys, captured, text, value):
    assert cli_main(["run", str(ECHO), "--out", str(tmp_path / "r"), "-p", "x", text,
                     "--param", "fail_on", text]) == 2
    assert "captured" in capsys.readouterr().err  # the command line let it through
    assert captured == {"x": value, "fail_on": value}
    assert type(captured["x"]) is type(value)


def test_a_negative_number_reaches_the_config_through_lab_train(tmp_path, capsys, no_kernel):
    for args, message in ((["-p", "lr", "-1e-3"], "ConvConfig.lr=-0.001 is out of range"),
                          (["-p", "epochs", "-1E+2"],
                           "ConvConfig.epochs must be int, got -100.0 (float)"),
                          (["-p", "momentum", "-.5e-1"], "ConvConfig.momentum=-0.05 is out of "
                                                         "range")):
        assert cli_main(["train", "--out", str(tmp_path / "r"), *args]) == 2
        assert message in _one_paragraph(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", [["train"], ["run", str(ECHO)]])
def test_an_option_where_a_p_value_belongs_is_named(tmp_path, capsys, no_kernel, command):
    for option in ("--force", "-f", "--out"):
        assert cli_main([*command, "--out", str(tmp_path / "r"), "-p", "x", option]) == 2
        err = _one_paragraph(capsys.readouterr().err)
        assert f"error: -p x has no value: next comes '{option}', which is read as an " \
            "option; give -p KEY VALUE" in err
    assert not (tmp_path / "r").exists()


def test_a_text_value_with_a_leading_space_is_the_word(tmp_path, capsys, captured):
    # The way out the error names: ' -abc' is the text -abc.
    assert cli_main(["run", str(ECHO), "--out", str(tmp_path / "r"), "-p", "x", " -abc"]) == 2
    assert captured == {"x": "-abc"}


def test_a_key_given_twice_inside_a_p_dict_is_refused(tmp_path, capsys, no_kernel):
    from lab.cli import parse_value

    cases = [(["train"], "rule_params", "{traffic_rule: raw, traffic_rule: none}",
              "error: -p rule_params '{traffic_rule: raw, traffic_rule: none}': key "
              "'traffic_rule' is given twice (line 1); give each key once"),
             (["run", str(ECHO)], "opts", "{scale: 2, scale: 3}",
              "error: -p opts '{scale: 2, scale: 3}': key 'scale' is given twice (line 1); "
              "give each key once")]
    for command, key, value, message in cases:
        assert cli_main([*command, "--out", str(tmp_path / "r"), "-p", key, value]) == 2
        assert _one_paragraph(capsys.readouterr().err).strip() == message
        assert not (tmp_path / "r").exists()
    # Text that is not YAML at all is still the text itself, for the config to judge.
    assert parse_value("[fast") == "[fast" and parse_value("{a: 1, b: 2}") == {"a": 1, "b": 2}


def test_yes_and_a_tuple_as_text_say_how_to_write_them(tmp_path, capsys, no_kernel):
    assert cli_main(["train", "--out", str(tmp_path / "r"), "-p", "nesterov", "yes"]) == 2
    assert "ConvConfig.nesterov must be bool, got 'yes' (str); write true or false" in \
        _one_paragraph(capsys.readouterr().err)
    cfc = ROOT / "notebooks" / "03-train-cfc-aux.ipynb"
    assert cli_main(["run", str(cfc), "--out", str(tmp_path / "r"), "-p", "horizons",
                     "(1,5)"]) == 2
    assert "CfCAuxConfig.horizons must be tuple, got '(1,5)' (str); give a YAML list such as " \
        "[1, 5, 20]" in _one_paragraph(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


def test_resuming_an_interrupted_run_on_changed_data_is_refused_before_a_kernel(tmp_path,
                                                                                  capsys):
    # It started a kernel, failed there ("trained on other data") and rewrote the
    # interrupted run's record as `failed`; a finished run was already refused up front.
    csv = tmp_path / "p.csv"
    csv.write_text("close\n" + "".join(f"{100 + (i % 13) * 0.7 + i * 0.02:.2f}\n"
                                       for i in range(400)))
    cfc = ROOT / "notebooks" / "03-train-cfc-aux.ipynb"
    args = ["run", str(cfc), "--out", str(tmp_path / "r"), "-p", "source", "csv", "-p",
            "csv_path", str(csv), "-p", "column", "close", "-p", "steps", "4", "-p", "threads", "1"]
    assert cli_main(args) == 0
    capsys.readouterr()
    record_path = tmp_path / "r" / records.RECORD_FILE
    record = json.loads(record_path.read_text())
    record["status"] = "running"  # as a kill -9 leaves it: nobody holds the lock
    record_path.write_text(json.dumps(record))
    assert runlock.inspect(tmp_path / "r").status == "interrupted"
    before = record_path.read_bytes()
    with open(csv, "a") as f:
        f.write("151.00\n")
    start = time.perf_counter()
    assert cli_main(args) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert f"{tmp_path / 'r'} already holds an interrupted run whose data changed since " \
           f"({csv}: size 2806 then, 2813 now); resuming it would train on other data " \
           "(restore the file to resume it); nothing was changed." in err, err
    assert time.perf_counter() - start < 5  # no kernel was started
    assert record_path.read_bytes() == before


def test_a_run_killed_before_its_first_record_is_listed_interrupted(tmp_path, capsys):
    # What `kill -9` of `lab run` during imports leaves: the lock (nobody holds it) and
    # the executed notebook papermill wrote first, no record.json.
    def killed_early(run_dir: Path) -> None:
        runlock.acquire(run_dir).release()
        shutil.copy(ECHO, run_dir / lab.notebook.OUTPUT_NOTEBOOK)

    killed_early(tmp_path / "kd7")
    (tmp_path / "refused").mkdir()  # a lock alone is not a run
    runlock.acquire(tmp_path / "refused").release()
    _record(tmp_path / "done", "complete")
    table, bad = runs_table(tmp_path)
    assert not bad
    assert dict(zip(table["dir"], table["status"])) == {"done": "complete",
                                                         "kd7": "interrupted"}
    assert "before its first record" in table.set_index("dir").loc["kd7", "error"]
    for target in (tmp_path / "kd7", tmp_path):
        assert cli_main(["runs", str(target)]) == 0
        out = capsys.readouterr().out
        assert "no runs under" not in out
        assert ("kd7 . interrupted" if target.name == "kd7" else "kd7 kd7 interrupted") \
            in " ".join(out.split())
    # A protocol's run killed that way is interrupted, not missing.
    path = _conv_protocol(tmp_path, {"epochs": 1})
    killed_early(tmp_path / "runs" / "seed-0")
    table, _ = runs_table(path)
    assert table[["run_id", "status"]].values.tolist() == [["seed-0", "interrupted"]]


def test_quoted_tilde_paths_are_expanded(tmp_path, monkeypatch, capsys):
    # The shell expands ~ only unquoted; `lab` expands it in every path argument.
    from lab.train.synthetic import SyntheticConfig, train_synthetic

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    train_synthetic(SyntheticConfig(steps=2), tmp_path / "home" / "runs" / "a")
    assert cli_main(["runs", "~/runs"]) == 0
    assert "complete" in capsys.readouterr().out
    assert cli_main(["run", "~/nb.ipynb", "--out", "~/runs/e"]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert str(tmp_path / "home" / "nb.ipynb") in err, err
    assert not (tmp_path / "cwd" / "~").exists() and not (tmp_path / "home" / "runs" / "e").exists()


# ---------------------------------------------------------------------------
# trial 9 (cli): kinds, unwritable reports, blank and nested --out, swapped runs, messages


def _summary_protocol(tmp_path: Path) -> str:
    fixture = tmp_path / "summary"
    shutil.copytree(ROOT / "tests" / "fixtures" / "summary", fixture)
    text = (fixture / "protocol.yaml").read_text().replace(
        "../../../notebooks/01-train-conv.ipynb", str(TRAIN))
    (fixture / "protocol.yaml").write_text(
        f"{text}report: {ROOT / 'notebooks' / '10-summary.ipynb'}\n")
    return str(fixture / "protocol.yaml")


@pytest.mark.parametrize("kind", ["cfc_aux", "ep"])
def test_train_on_another_trainers_run_is_one_line_naming_both_kinds(
        tiny, tmp_path, capsys, no_kernel, kind):
    out = tmp_path / "other"
    record = records.new_record(run_id="other", kind=kind, config={"steps": 40})
    record["status"] = "complete"
    records.save_run(out, record)
    before = _files(out)
    args = [a for k, v in tiny.items() for a in ("-p", k, str(v))]
    assert cli_main(["train", "--out", str(out), *args]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    article = "an" if kind == "ep" else "a"
    assert f"{out} holds {article} {kind} run; `lab train` makes conv runs: give it another " \
           "--out" in err
    assert "there vs" not in err  # not a diff of every field
    assert _files(out) == before


def test_report_into_an_unwritable_out_is_one_line_before_anything_runs(
        tmp_path, capsys, no_kernel, monkeypatch):
    protocol = _summary_protocol(tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    # Root may write anywhere: what os.access says about ro is what is exercised.
    monkeypatch.setattr(runlock.os, "access", lambda path, mode: False if
                        Path(path) == ro else real(path, mode))
    assert cli_main(["report", protocol, "--out", str(ro)]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert f"--out {ro}: the reports directory is not writable; choose a directory you can " \
           "write to" in err
    assert cli_main(["report", protocol, "--out", str(ro / "rep")]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert f"--out {ro / 'rep'}: {ro}, where it would be made, is not writable" in err
    assert list(ro.iterdir()) == []


def test_report_out_blank_or_inside_a_run_is_refused(tmp_path, capsys, no_kernel,
                                                     monkeypatch):
    # A blank --out wrote the report into the working directory; one inside a run would be
    # moved aside with that run.
    protocol = _summary_protocol(tmp_path)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert cli_main(["report", protocol, "--out", ""]) == 2
    assert "--out '' is blank, which would mean the working directory" in \
        _one_paragraph(capsys.readouterr().err)
    run = tmp_path / "a-run"
    run.mkdir()
    (run / "record.json").write_text("{}")
    for out in (run, run / "rows"):
        assert cli_main(["report", protocol, "--out", str(out)]) == 2
        assert f"--out {out} lies in the run directory {run}; give a reports directory " \
            "outside every run" in _one_paragraph(capsys.readouterr().err)
    assert sorted(p.name for p in run.iterdir()) == ["record.json"]
    assert list((tmp_path / "cwd").iterdir()) == []


@pytest.mark.parametrize("fails", ["mkdir", "lock"])
def test_report_permission_error_from_the_lock_or_mkdir_is_one_line(
        tmp_path, capsys, no_kernel, monkeypatch, fails):
    # The directory passes the check, then refuses the write (e.g. chattr +i as root).
    protocol = _summary_protocol(tmp_path)
    out = tmp_path / "reports"
    denied = out if fails == "mkdir" else out / ".fixture.report.lock"

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(denied))

    if fails == "mkdir":
        real = Path.mkdir
        monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: refuse() if self == out
                            else real(self, *a, **k))
    else:
        monkeypatch.setattr(__import__("filelock").FileLock, "acquire", refuse)
    assert cli_main(["report", protocol, "--out", str(out)]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert f"--out {out}: {denied} is not writable (Operation not permitted); choose a " \
           "directory you can write to" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [["train"], ["run", str(ECHO)]])
def test_a_blank_out_is_refused_not_the_working_directory(tmp_path, capsys, no_kernel,
                                                          monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    for blank in ("", "  "):
        assert cli_main([*command, "--out", blank]) == 2
        err = _one_paragraph(capsys.readouterr().err)
        assert f"--out {blank!r} is blank, which would mean the working directory; give the " \
               "run directory" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["train"], ["run", str(ECHO)]])
def test_an_out_nested_in_a_run_or_holding_runs_is_refused(tmp_path, capsys, no_kernel,
                                                           command):
    _record(tmp_path / "t1", "complete")
    _record(tmp_path / "sweep" / "a", "complete")
    before = _files(tmp_path)
    for inner in (tmp_path / "t1" / "rows" / "epoch", tmp_path / "t1" / "sub"):
        assert cli_main([*command, "--out", str(inner)]) == 2
        err = _one_paragraph(capsys.readouterr().err)
        assert f"--out {inner} lies inside the run directory {tmp_path / 't1'}, so the new " \
               "run would be nested in that run" in err
    assert cli_main([*command, "--out", str(tmp_path / "sweep")]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert f"--out {tmp_path / 'sweep'} already holds run directories (e.g. a), so it is a " \
           "directory of runs, not a run" in err
    assert _files(tmp_path) == before
    # A listing of the outer runs still shows each once (records.load_runs untouched).
    assert list(records.load_runs(tmp_path)["run_id"]) == ["a", "t1"]


def _swapped_runs(tmp_path: Path) -> tuple[str, Path, Path]:
    """The summary protocol with the directories of its two lr-0.05 runs swapped."""
    protocol = _summary_protocol(tmp_path)
    runs = Path(protocol).parent / "runs"
    a, b = runs / "lr-0.05_rule-bp_seed-0", runs / "lr-0.05_rule-bp_seed-1"
    a.rename(runs / "tmp")
    b.rename(a)
    (runs / "tmp").rename(b)
    return protocol, a, b


def test_lab_runs_marks_each_row_for_the_directory_it_shows(tmp_path):
    protocol, a, b = _swapped_runs(tmp_path)
    table, unreadable = runs_table(protocol)
    assert not unreadable
    rows = {d: (rid, status, error) for d, rid, status, error in
            zip(table["dir"], table["run_id"], table["status"], table["error"])}
    # Directory seed-1 holds the seed-0 run: named as such (it said "seed: 0 there vs 1
    # now ... rerun with --force", which would replace a good run).
    assert rows[b.name][:2] == ("lr-0.05_rule-bp_seed-0", "stale")
    assert rows[b.name][2].startswith("its record's run_id is 'lr-0.05_rule-bp_seed-0', not "
                                      "'lr-0.05_rule-bp_seed-1', the run the protocol expects "
                                      "in this directory (a run copied or renamed into place?)")
    assert rows[a.name][:2] == ("lr-0.05_rule-bp_seed-1", "stale")
    assert rows[a.name][2].startswith("its record's run_id is 'lr-0.05_rule-bp_seed-1', not "
                                      "'lr-0.05_rule-bp_seed-0'")
    assert [rows[d][1] for d in ("lr-0.2_rule-bp_seed-0", "lr-0.2_rule-bp_seed-1")] == \
        ["complete", "complete"]
    assert "missing" not in set(table["status"])


def test_lab_runs_prints_a_cut_message_whole_below_the_table(tmp_path, capsys):
    # The table cut each message at 60 characters, mid-word, before the values that differ.
    protocol, a, b = _swapped_runs(tmp_path)
    why = runs_table(protocol)[0].set_index("dir")["error"]
    assert cli_main(["runs", protocol]) == 0
    out = capsys.readouterr().out
    table, _, below = out.partition("\n2 message(s) in full:\n")
    assert " [...]" in table and "copied or renamed into place" not in table
    assert below.splitlines() == [f"  lr-0.05_rule-bp_seed-0: {why[b.name]}",
                                  f"  lr-0.05_rule-bp_seed-1: {why[a.name]}"]
    assert "(a run copied or renamed into place?)" in below


def test_run_given_a_directory_as_notebook_says_it_is_one(tmp_path, capsys, no_kernel):
    assert cli_main(["run", str(ROOT / "notebooks"), "--out", str(tmp_path / "x")]) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert f"notebook {ROOT / 'notebooks'} is a directory; give the notebook (.ipynb)" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("how", ["renamed", "deleted"])
def test_a_run_dir_moved_mid_run_is_named_where_it_is_now(tmp_path, capsys, monkeypatch, how):
    out, moved = tmp_path / "m1", tmp_path / "m1-moved"

    def papermill(notebook, target, *args, **kwargs):  # the user's `mv` while it trains
        record = records.new_record(run_id="m1", kind="notebook", config={"x": 1})
        records.save_run(Path(target).parent, record)  # a trainer's first record: running
        if how == "renamed":
            Path(target).parent.rename(moved)
        else:
            shutil.rmtree(Path(target).parent)

    monkeypatch.setattr(lab.notebook, "_papermill", papermill)
    assert cli_main(["run", str(ECHO), "--out", str(out)]) == 1
    captured = capsys.readouterr()
    summary = captured.out.strip().splitlines()[-1]
    assert str(out / "notebook.ipynb") not in summary
    if how == "renamed":
        assert summary.endswith(f"-> {moved / 'notebook.ipynb'} (the run directory moved "
                                "there; resume it there)")
        # the word `lab runs` gives the run in its new place (it said "failed" here)
        assert summary.startswith("m1: interrupted in ")
        assert cli_main(["runs", str(moved)]) == 0
        assert " interrupted " in capsys.readouterr().out
    else:
        assert summary.endswith(f"-> {out} (the run directory was moved or deleted)")
    assert "while the run worked in it" in captured.err
    assert not out.exists()


def test_lab_runs_names_another_trainers_run_in_a_protocols_out(tmp_path, capsys):
    # It listed ~40 fields "there vs now"; lab sweep says it in one line.
    protocol = _summary_protocol(tmp_path)
    runs = Path(protocol).parent / "runs"
    victim = sorted(p for p in runs.iterdir() if (p / "record.json").is_file())[0]
    record = records.load_record(victim, rows=False)
    records.write_record(victim, {**record, "kind": "ep"})
    cli_main(["runs", protocol])
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.lstrip().startswith(victim.name))
    whole = next(row for row in out.splitlines() if row.startswith(f"  {victim.name}: "))
    assert "stale" in line and "(it holds an ep run," in whole and "there vs" not in out, out
    from lab.sweep import load_protocol, stale_runs

    assert stale_runs(load_protocol(protocol))[victim.name] == (
        "it holds an ep run, and the protocol's notebook makes conv runs")


@pytest.mark.parametrize("target", [3, None, ["runs"]])
def test_runs_table_names_a_target_that_is_not_a_path(target):
    from lab.cli import runs_table

    with pytest.raises(TypeError, match=rf"^runs_table: target must be a path \(a directory of "
                                        rf"runs, .*got {re.escape(repr(target))} "):
        runs_table(target)


def test_an_analysis_notebook_is_not_a_run(tmp_path, capsys):
    # `lab run 10-summary.ipynb` called a conv run directory "already complete", or started a
    # kernel that summarised the notebook's default protocol and left a failed "run".
    summary = ROOT / "notebooks" / "10-summary.ipynb"
    out = tmp_path / "z"
    assert cli_main(["run", str(summary), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {summary} is an analysis notebook (it takes protocol and "
                          "runs_dir and trains nothing), not a run; execute it for a protocol "
                          f"with `lab report <protocol.yaml> --notebook {summary}`")
    assert not out.exists()
    protocol = tmp_path / "p.yaml"
    protocol.write_text(f"name: p\nnotebook: {summary}\nout: {tmp_path / 'runs'}\n"
                        "grid:\n  runs_dir: [a, b]\n")
    assert cli_main(["sweep", str(protocol), "-q"]) == 2
    assert "is an analysis notebook" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_warning_is_one_line(tmp_path, monkeypatch):
    # It printed "/.../cfc_aux.py:191: UserWarning: ..." and the source line under it.
    import warnings

    seen = []

    def warns(args):  # the text Python prints for a warning while a command runs
        seen.append(warnings.formatwarning("val_fraction=0.2 cannot be honoured",
                                           UserWarning, "/x/cfc_aux.py", 191, "warn(...)"))
        seen.append(warnings.formatwarning("old", DeprecationWarning, "/x/y.py", 3))
        return 0

    monkeypatch.setattr(lab.cli, "_runs", warns)
    before = warnings.formatwarning
    assert cli_main(["runs", str(tmp_path)]) == 0
    assert seen == ["warning: val_fraction=0.2 cannot be honoured\n",
                    "warning (DeprecationWarning): old\n"]
    assert warnings.formatwarning is before  # the caller's format is back


def test_report_with_a_training_or_missing_notebook_makes_nothing(tmp_path, capsys):
    # Found only after the reports directory had been made and locked (a lock file left).
    path = _reported_protocol(tmp_path, [0])
    out = tmp_path / "rep"
    assert cli_main(["report", str(path), "--notebook", str(TRAIN), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: {TRAIN} is not an analysis notebook: it does not declare the 'protocol' "
        "parameter `lab report` sets (it declares ")
    assert cli_main(["report", str(path), "--notebook", str(tmp_path / "nope.ipynb"),
                     "--out", str(out)]) == 2
    assert "nope.ipynb does not exist" in capsys.readouterr().err
    assert not out.exists()


def test_a_notebook_path_starting_with_a_dash_is_read_as_a_file(tmp_path, monkeypatch, capsys):
    # papermill reads a path starting with "-" as standard input: `./-nb.ipynb` (which
    # arrives as "-nb.ipynb") failed with a traceback, "Notebook does not appear to be JSON".
    shutil.copy(ECHO, tmp_path / "-nb.ipynb")
    monkeypatch.chdir(tmp_path)
    assert cli_main(["run", "./-nb.ipynb", "--out", "r", "-p", "x", "3"]) == 0
    assert records.load_record(tmp_path / "r")["status"] == "complete"
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "run"])
def test_an_out_with_a_name_too_long_for_the_file_system_is_refused(command, tmp_path, capsys):
    # A part over 255 bytes: a traceback ending in "OSError: File name too long", exit 1.
    out = tmp_path / "a" / ("n" * 300)
    args = ["train", "--out", str(out)] if command == "train" else [
        "run", str(ECHO), "--out", str(out)]
    assert cli_main(args) == 2
    err = _one_paragraph(capsys.readouterr().err)
    assert "is 300 bytes long, and a file system takes names of at most 255 bytes; choose a " \
           "shorter name" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists()
