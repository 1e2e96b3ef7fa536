"""Protocols and sweeps: validation, expansion, resume after SIGKILL, failures, `lab runs`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest
import yaml

from lab import records
from lab.cli import main as cli_main
from lab.cli import runs_table
from lab.config import field_names
from lab.notebook import notebook_defaults, read_values
from lab.sweep import (
    Protocol,
    ProtocolError,
    expand,
    kernel_env,
    load_protocol,
    plan,
    run_id_for,
    run_state,
    run_sweep,
)
from lab.train import ConvConfig

ROOT = Path(__file__).resolve().parents[1]
ECHO = ROOT / "tests" / "fixtures" / "notebooks" / "echo.ipynb"
TRAIN = ROOT / "notebooks" / "01-train-conv.ipynb"


def write_protocol(path: Path, **fields) -> Path:
    data = {"name": "t", "notebook": str(ECHO), "out": "runs", "grid": {"x": [1, 2]}}
    data.update(fields)
    path.write_text(yaml.safe_dump(data))
    return path


# ---------------------------------------------------------------------------
# protocol validation: one clear error each


@pytest.mark.parametrize("fields, message", [
    ({"notebook": "missing.ipynb"},
     r"notebook .*missing.ipynb does not exist; notebooks in .*: none"),
    ({"fixed": {"learning_rate": 0.1}},
     r"does not declare parameter\(s\) 'learning_rate'; declared: x, fail_on, write_record, "
     r"out_dir"),
    ({"grid": {"x": [1], "y": [2]}}, r"does not declare parameter\(s\) 'y'"),
    ({"grid": {}}, r"Protocol.grid is empty"),
    ({"grid": {"x": []}}, r"grid values must be non-empty lists; got x: \[\]"),
    ({"grid": {"x": 3}}, r"grid values must be non-empty lists; got x: 3"),
    ({"grid": {"x": [1, 1]}}, r"duplicate run ids: x-1 from \{\"x\": 1\} and \{\"x\": 1\}"),
    ({"overrides": {"y": {1: {"fail_on": 1}}}}, r"overrides\['y'\] must map values of the grid "
     r"key 'y'"),
    ({"overrides": {"x": {3: {"fail_on": 1}}}}, r"overrides\['x'\]\[3\] must be a mapping for "
     r"a value in grid\['x'\] = \[1, 2\]"),
    ({"overrides": {"x": {1: {"x": 2}}}}, r"overrides\['x'\]\[1\] sets grid key\(s\) x"),
    ({"overrides": {"x": {1: {"lr": 2}}}}, r"does not declare parameter\(s\) 'lr'"),
    ({"grid": {"x": ["a b", "a-b"]}}, r"duplicate run ids: x-a-b"),
    ({"fixed": {"x": 1}}, r"x are both fixed and in the grid"),
    ({"fixed": {"out_dir": "/tmp"}}, r"out_dir are set by the sweep"),
    ({"colour": "red"}, r"unknown key\(s\) colour; allowed: name, notebook, out, grid, fixed"),
    ({"workers": 0}, r"Protocol.workers=0 is out of range"),
    ({"name": "a/b"}, r"Protocol.name='a/b' is not allowed"),
])
def test_bad_protocols(tmp_path, fields, message):
    with pytest.raises(ProtocolError, match=message):
        load_protocol(write_protocol(tmp_path / "p.yaml", **fields))


def test_protocol_file_problems(tmp_path):
    with pytest.raises(ProtocolError, match=r"p.yaml is not valid YAML at line 3"):
        (tmp_path / "p.yaml").write_text("name: t\ngrid: [unclosed\n  x: 1\n")
        load_protocol(tmp_path / "p.yaml")
    with pytest.raises(ProtocolError, match=r"holds a list, not a mapping"):
        (tmp_path / "p.yaml").write_text("- 1\n- 2\n")
        load_protocol(tmp_path / "p.yaml")
    with pytest.raises(ProtocolError, match=r"missing key\(s\) notebook, out; required"):
        (tmp_path / "p.yaml").write_text("name: t\ngrid: {x: [1]}\n")
        load_protocol(tmp_path / "p.yaml")
    with pytest.raises(ProtocolError, match=r"nope.yaml does not exist"):
        load_protocol(tmp_path / "nope.yaml")
    (tmp_path / "b.yaml").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ProtocolError, match=r"cannot be read"):
        load_protocol(tmp_path / "b.yaml")


def test_paths_are_relative_to_the_protocol_file(tmp_path):
    (tmp_path / "sub").mkdir()
    rel = os.path.relpath(ECHO, tmp_path / "sub")
    protocol = load_protocol(write_protocol(tmp_path / "sub" / "p.yaml", notebook=rel))
    assert Path(protocol.notebook) == ECHO.resolve()
    assert Path(protocol.out) == (tmp_path / "sub" / "runs").resolve()


def test_overrides_apply_to_their_grid_value_only(tmp_path):
    path = write_protocol(tmp_path / "p.yaml", fixed={"fail_on": 0},
                          overrides={"x": {2: {"fail_on": 5}}})
    params = {spec.run_id: spec.params for spec in expand(load_protocol(path))}
    assert params == {"x-1": {"fail_on": 0, "x": 1}, "x-2": {"fail_on": 5, "x": 2}}


def test_expand_gives_stable_readable_ids():
    protocol = Protocol(name="t", notebook="nb", out="o", fixed={"epochs": 3},
                        grid={"seed": [0, 1], "rule": ["bp", "fa"]})
    specs = expand(protocol)
    assert [s.run_id for s in specs] == ["rule-bp_seed-0", "rule-bp_seed-1",
                                         "rule-fa_seed-0", "rule-fa_seed-1"]
    assert specs[1].params == {"epochs": 3, "rule": "bp", "seed": 1}
    assert specs[1].grid == {"rule": "bp", "seed": 1}
    assert run_id_for({"rule_params": {"scale": 0.5, "b": True}, "lr": 1e-3}) == \
        "lr-0.001_rule_params-b=true,scale=0.5"
    assert run_id_for({"dims": [1, 2], "name": "a/b c"}) == "dims-1+2_name-a-b-c"


def test_demo_protocol():
    protocol = load_protocol(ROOT / "protocols" / "demo.yaml")
    specs = expand(protocol)
    assert [s.run_id for s in specs] == ["rule-bp_seed-0", "rule-bp_seed-1"]
    assert specs[0].params["depth"] == 20 and specs[0].params["width"] == 16
    # The demo trains with the documented recipe: ConvConfig's default epochs.
    assert specs[0].params["epochs"] == ConvConfig().epochs
    assert Path(protocol.report).name == "10-summary.ipynb"


@pytest.mark.parametrize("path", sorted((ROOT / "protocols").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_protocol_builds_valid_configs(path):
    protocol = load_protocol(path)
    defaults = notebook_defaults(protocol.notebook)
    for spec in expand(protocol):
        params = {**defaults, **spec.params}
        ConvConfig(**{name: params[name] for name in field_names(ConvConfig)})


# ---------------------------------------------------------------------------
# run state


def _fake_run(run_dir: Path, status: str, finished: str | None, params=None):
    record = records.new_record(run_id=run_dir.name, kind="notebook", config={})
    record["status"] = status
    records.save_run(run_dir, record)
    if finished is not None:
        nb = nbformat.v4.new_notebook()
        nb.metadata["lab"] = {"status": finished, "params": params or {}}
        nbformat.write(nb, str(run_dir / "notebook.ipynb"))


def test_run_state(tmp_path):
    assert run_state(tmp_path / "none") == "missing"
    _fake_run(tmp_path / "a", "running", None)
    assert run_state(tmp_path / "a") == "running"
    # The record says complete, but the notebook never finished: not complete.
    _fake_run(tmp_path / "b", "complete", None)
    assert run_state(tmp_path / "b") == "unfinished"
    (tmp_path / "b" / "notebook.ipynb").write_text('{"cells": [')  # cut short by a kill
    assert run_state(tmp_path / "b") == "unfinished"
    _fake_run(tmp_path / "c", "complete", "complete", {"x": 1, "out_dir": "c"})
    assert run_state(tmp_path / "c", {"x": 1}) == "complete"
    assert run_state(tmp_path / "c", {"x": 2}) == "stale"
    _fake_run(tmp_path / "d", "failed", "failed")
    assert run_state(tmp_path / "d") == "failed"
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "record.json").write_text("{half")
    assert run_state(tmp_path / "e") == "failed"


# ---------------------------------------------------------------------------
# sweeps


def test_failing_run_is_reported_and_the_others_finish(tmp_path, capsys):
    path = write_protocol(tmp_path / "p.yaml", grid={"x": [1, 2, 3]}, fixed={"fail_on": 2})
    assert cli_main(["sweep", str(path), "--workers", "2", "-q"]) == 1
    out = capsys.readouterr().out
    assert "FAILED x-2: ValueError: asked to fail at x=2" in out
    assert "3 runs, 3 executed, 0 already complete, 1 failed" in out
    runs = tmp_path / "runs"
    assert records.load_record(runs / "x-1")["status"] == "complete"
    assert records.load_record(runs / "x-3")["status"] == "complete"
    failed = records.load_record(runs / "x-2")
    assert failed["status"] == "failed" and "asked to fail at x=2" in failed["error"]
    assert (runs / "x-2" / "notebook.ipynb").exists()
    # Listed by `lab runs`, with the error.
    table = runs_table(runs)
    assert dict(zip(table.run_id, table.status)) == {"x-1": "complete", "x-2": "failed",
                                                     "x-3": "complete"}
    assert "asked to fail" in table.set_index("run_id").loc["x-2", "error"]


def test_sweep_on_a_scheduler_address_and_resume_skips_finished_runs(tmp_path):
    from distributed import LocalCluster

    path = write_protocol(tmp_path / "p.yaml", grid={"x": [1, 2]}, threads_per_run=1)
    protocol = load_protocol(path)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster:
        report = run_sweep(protocol, scheduler=cluster.scheduler_address, progress=False)
        assert [(o.run_id, o.status, o.skipped) for o in report.outcomes] == [
            ("x-1", "complete", False), ("x-2", "complete", False)]
        meta = json.loads((tmp_path / "runs" / "x-1" / "notebook.ipynb").read_text())
        assert meta["metadata"]["lab"]["params"]["x"] == 1
        # The kernel gets the run's thread count, not the Dask nanny's malloc tuning.
        values = read_values(tmp_path / "runs" / "x-1" / "notebook.ipynb")
        assert values["omp_threads"] == "1"
        assert values["malloc_trim"] == kernel_env()["MALLOC_TRIM_THRESHOLD_"] != "65536"
        again = run_sweep(protocol, scheduler=cluster.scheduler_address, progress=False)
    assert all(o.skipped for o in again.outcomes) and not again.failed
    # A changed protocol does not silently reuse runs made with other parameters.
    changed = load_protocol(write_protocol(tmp_path / "p.yaml", grid={"x": [1, 2]},
                                           fixed={"fail_on": 7}))
    stale = run_sweep(changed, workers=1, progress=False)
    assert [o.status for o in stale.outcomes] == ["failed", "failed"]
    assert "fail_on: None there vs 7 now" in stale.outcomes[0].error


def _marked_processes(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _wait_until(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _values(run_dir: Path) -> str:
    record = records.without_timings(records.load_record(run_dir))
    return json.dumps([record["trajectory"], record["final"]], sort_keys=True)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_sigkill_mid_sweep_then_resume_equals_uninterrupted(tiny, tmp_path):
    fixed = {**tiny, "epochs": 5}
    grid = {"seed": [0, 1, 2, 3]}
    killed = write_protocol(tmp_path / "killed.yaml", notebook=str(TRAIN), out="killed",
                            fixed=fixed, grid=grid, threads_per_run=1)
    whole = write_protocol(tmp_path / "whole.yaml", notebook=str(TRAIN), out="whole",
                           fixed=fixed, grid=grid, threads_per_run=1)
    protocol = load_protocol(killed)
    marker = f"LAB_TEST_SWEEP_{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-m", "lab.cli", "sweep", str(killed), "-q",
                             "--workers", "2"], env={**os.environ, marker: "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        _wait_until(lambda: "complete" in plan(protocol)[1].values() or proc.poll() is not None,
                    180, "a first run to complete")
        assert proc.poll() is None, "the sweep finished before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI, the Dask scheduler and its workers
        proc.wait()
    # Kernels run in their own sessions; they exit once their worker is gone.
    _wait_until(lambda: not _marked_processes(marker), 30, "orphaned kernels to exit")

    states = plan(protocol)[1]
    done = sorted(rid for rid, state in states.items() if state == "complete")
    assert done and len(done) < len(states), states
    before = {rid: ((tmp_path / "killed" / rid / "record.json").stat().st_mtime_ns,
                    records.load_record(tmp_path / "killed" / rid)["created"])
              for rid in done}

    report = run_sweep(protocol, workers=2, progress=False)
    assert not report.failed
    assert sorted(o.run_id for o in report.outcomes if o.skipped) == done
    after = {rid: ((tmp_path / "killed" / rid / "record.json").stat().st_mtime_ns,
                   records.load_record(tmp_path / "killed" / rid)["created"])
             for rid in done}
    assert after == before, "runs finished before the kill were executed again"

    reference = run_sweep(load_protocol(whole), workers=2, progress=False)
    assert not reference.failed and not any(o.skipped for o in reference.outcomes)
    for spec in expand(protocol):
        assert _values(tmp_path / "killed" / spec.run_id) == \
            _values(tmp_path / "whole" / spec.run_id), spec.run_id


def test_lab_runs_lists_a_protocol_with_missing_runs(tmp_path, capsys):
    source = ROOT / "tests" / "fixtures" / "summary" / "protocol.yaml"
    assert cli_main(["runs", str(source)]) == 0
    out = capsys.readouterr().out
    assert "lr-0.05_rule-bp_seed-0" in out and "test_acc" in out and "complete" in out
    path = write_protocol(tmp_path / "p.yaml", grid={"x": [1, 2]})
    _fake_run(tmp_path / "runs" / "x-1", "complete", "complete")
    table = runs_table(path)
    assert dict(zip(table.run_id, table.status)) == {"x-1": "complete", "x-2": "missing"}
    assert cli_main(["runs", str(tmp_path / "nowhere")]) == 2
