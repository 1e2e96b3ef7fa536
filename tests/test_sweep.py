"""Protocols and sweeps: validation, expansion, resume after SIGKILL, failures, `lab runs`."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

import lab.notebook
from lab import records, runlock
from lab.cli import main as cli_main
from lab.cli import runs_table
from lab.config import field_names, from_dict
from lab.notebook import notebook_defaults, read_values
from lab.sweep import (
    Protocol,
    ProtocolError,
    SweepReport,
    expand,
    kernel_env,
    load_protocol,
    plan,
    run_id_for,
    run_sweep,
)
from lab.train import ConvConfig, train_conv

ROOT = Path(__file__).resolve().parents[1]
ECHO = ROOT / "tests" / "fixtures" / "notebooks" / "echo.ipynb"
SLOW = ROOT / "tests" / "fixtures" / "notebooks" / "slow.ipynb"
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
     r"Protocol.fixed \(learning_rate: 0.1\): notebook .* does not declare parameter\(s\) "
     r"'learning_rate'; declared: x, fail_on, write_record, opts$"),
    ({"grid": {"x": [1], "y": [2]}}, r"Protocol.grid \(y: \[2\]\): notebook .* does not "
     r"declare parameter\(s\) 'y'"),
    ({"grid": {}}, r"Protocol.grid is empty"),
    ({"grid": {"x": []}}, r"grid values must be non-empty lists; got x: \[\]"),
    ({"grid": {"x": 3}}, r"grid values must be non-empty lists; got x: 3"),
    ({"grid": {"x": [1, 1]}}, r"the grid gives 1 duplicate run id\(s\) \(x: 1 and 1 give one "
     r"id \(x-1\)\): x-1 from \{\"x\": 1\} and \{\"x\": 1\}; make the grid values distinct"),
    ({"overrides": {"y": {1: {"fail_on": 1}}}}, r"overrides\['y'\]: 'y' is not a grid key; "
     r"overrides are keyed by grid keys: x$"),
    ({"overrides": {"x": [1]}}, r"overrides\['x'\] is a list; it must map values of "
     r"grid\['x'\] to parameter mappings$"),
    ({"overrides": {"x": {3: {"fail_on": 1}}}}, r"overrides\['x'\]\[3\]: 3 is not a value of "
     r"grid\['x'\] = \[1, 2\], so it would never apply$"),
    ({"overrides": {"x": {1: 5}}}, r"overrides\['x'\]\[1\] is 5 \(int\); it must be a mapping "
     r"of parameter: value$"),
    ({"overrides": {"x": {1: {"x": 2}}}}, r"overrides\['x'\]\[1\] sets grid key\(s\) x"),
    ({"overrides": {"x": {1: {"lr": 2}}}}, r"Protocol.overrides\['x'\]\[1\] \(lr: 2\): "
     r"notebook .* does not declare parameter\(s\) 'lr'"),
    ({"fixed": {"x": 1}}, r"x are both fixed and in the grid"),
    ({"fixed": {"out_dir": "/tmp"}}, r"out_dir are set by the sweep"),
    ({"grid": {"out_dir.x": [1]}}, r"out_dir are set by the sweep"),
    ({"grid": {"nope.scale": [1]}}, r"does not declare parameter\(s\) 'nope.scale'"),
    ({"grid": {"x.scale": [1]}}, r"1 of 1 runs have parameters the notebook refuses, so none "
     r"was started: x.scale=1 sets a key inside x, but x is 1"
     r" \(int\), not a dict"),
    ({"colour": "red"}, r"unknown key\(s\) colour; allowed: name, notebook, out, grid, fixed"),
    # keys YAML reads as numbers or null gave AttributeError / TypeError tracebacks
    ({"fixed": {5: 1}}, r"Protocol.fixed has key\(s\) that are not parameter names: 5; a key "
                        r"is the name of a notebook parameter"),
    ({"fixed": {None: 1}}, r"Protocol.fixed has key\(s\) that are not parameter names: None"),
    ({"grid": {"x": [1], 1: [2]}}, r"Protocol.grid has key\(s\) that are not parameter names: 1"),
    ({"overrides": {"x": {1: {7: 1}}}}, r"Protocol.overrides\['x'\]\[1\] has key\(s\) that "
                                        r"are not parameter names: 7"),
    # a grid of 10**7 points made `lab sweep` check every run first, silently, for hours
    ({"grid": {f"k{i}": list(range(10)) for i in range(7)}},
     r"Protocol.grid makes 10,000,000 runs \(10 k0 x 10 k1 x .* x 10 k6\); a protocol "
     r"holds at most 10,000: split it"),
    # one leaf given twice in one mapping: the dotted key won without a word
    ({"fixed": {"opts": {"scale": 2.0}, "opts.scale": 0.5}},
     r"Protocol.fixed sets opts.scale, a key inside opts, which it also gives whole "
     r"\(\{'scale': 2.0\}\); give either the whole opts or its dotted keys"),
    ({"overrides": {"x": {1: {"opts.scale": 0.5, "opts": {"scale": 3.0}}}}},
     r"Protocol.overrides\['x'\]\[1\] sets opts.scale, a key inside opts"),
    # a dotted grid key overriding the leaf another grid key's dicts set (ids named those)
    ({"grid": {"opts": [{"scale": 0.5}, {"scale": 2.0}], "opts.scale": [1.0]}},
     r"Protocol.grid opts.scale \(inside grid key opts, whose value \{'scale': 0.5\} sets "
     r"it\) would override that leaf of the other key's values"),
    # two grid keys' overrides of one parameter: the later key won silently
    ({"grid": {"x": [1, 2], "fail_on": [0, 5]},
      "overrides": {"x": {1: {"opts": {"a": 1}}}, "fail_on": {0: {"opts": {"a": 2}}}}},
     r"Protocol.overrides\['fail_on'\]\[0\] and overrides\['x'\]\[1\] both set opts "
     r"\(\{'a': 2\} and \{'a': 1\}\) for the runs with fail_on=0 and x=1; one would win "
     r"silently: set opts in one of the two tables"),
    # a grid key is part of each run's directory name: "x./../../EVIL" wrote a run
    # outside out, "x.a/b" made nested directories the listing called missing
    ({"grid": {"opts./../../EVIL": [1]}}, r"Protocol.grid key\(s\) 'opts\./\.\./\.\./EVIL' "
     r"are not parameter names: a grid key is a notebook parameter's name, or a dotted path "
     r"into a dict parameter \(rule_params.traffic_rule\), with no empty part and no '/', "
     r"'\\' or NUL: it becomes part of each run's directory name"),
    ({"grid": {"x": [1], "opts.a/b": [1], "opts.": [2]}},
     r"Protocol.grid key\(s\) 'opts.', 'opts.a/b' are not parameter names"),
    # true == 1 in Python, but they are two grid values: the override applied to seed 1
    ({"overrides": {"x": {True: {"fail_on": 1}}}}, r"overrides\['x'\]\[True\]: True is not a "
     r"value of grid\['x'\] = \[1, 2\], so it would never apply$"),
    ({"workers": 0}, r"Protocol.workers=0 is out of range"),
    ({"name": "a/b"}, r"Protocol.name='a/b' is not allowed"),
    # '..' and '.' made `lab report` rmtree the reports directory's parent / itself
    ({"name": ".."}, r"Protocol.name='\.\.' is not allowed: a name may not start with '\.' "
                     r"\(it names a directory beside the others: '\.' and '\.\.' are the "
                     r"reports directory and its parent\)"),
    ({"name": "."}, r"Protocol.name='\.' is not allowed: a name may not start with"),
    ({"name": ".hidden"}, r"Protocol.name='\.hidden' is not allowed"),
    ({"name": "x.failed"}, r"Protocol.name='x\.failed' is not allowed: .* or end with "
                           r"\.pending or \.failed or \.html \(another report's"),
    ({"name": "uni-ü"}, r"Protocol.name='uni-ü' is not allowed; use a non-empty name of ASCII "
                        r"letters, digits and \. = , \+ - _ \(it names directories"),
])
def test_bad_protocols(tmp_path, fields, message):
    with pytest.raises(ProtocolError, match=message):
        load_protocol(write_protocol(tmp_path / "p.yaml", **fields))


def test_grid_keys_that_combine_and_overrides_that_agree_are_allowed(tmp_path):
    # A dotted grid key the other key's dicts do not hold is a product of the two; two
    # tables giving one parameter the same value do not conflict; a 10,000-run grid loads.
    protocol = load_protocol(write_protocol(
        tmp_path / "p.yaml", grid={"opts": [{"a": 1}, {"a": 2}], "opts.b": [3, 4]}))
    assert sorted((s.params["opts"]["a"], s.params["opts.b"]) for s in expand(protocol)) == [
        (1, 3), (1, 4), (2, 3), (2, 4)]
    load_protocol(write_protocol(tmp_path / "p.yaml", grid={"x": [1, 2], "fail_on": [0, 5]},
                                 overrides={"x": {1: {"opts": {"a": 1}}},
                                            "fail_on": {0: {"opts": {"a": 1}}}}))
    big = load_protocol(write_protocol(tmp_path / "p.yaml",
                                       grid={"x": list(range(100)), "fail_on": list(range(100))}))
    assert len(big.grid["x"]) * len(big.grid["fail_on"]) == 10_000


def test_an_empty_report_key_is_no_report(tmp_path):
    # `report:` with nothing after it (YAML null) was "Protocol.report must be str, got None".
    assert load_protocol(write_protocol(tmp_path / "p.yaml", report=None)).report == ""


def test_a_protocol_name_may_hold_an_underscore(tmp_path):
    assert load_protocol(write_protocol(tmp_path / "p.yaml", name="my_study")).name == "my_study"
    for name in ("a..b", "v1.2", "x.failed-not"):  # dots inside a name are fine
        assert load_protocol(write_protocol(tmp_path / "p.yaml", name=name)).name == name


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
    # A report notebook's default "../tests/..." run by papermill from the repository root
    # (Jupyter starts in notebooks/): the message says from where the path was read.
    with pytest.raises(ProtocolError, match=(
            r"does not exist: the relative path '../nope/p.yaml' is read from the working "
            r"directory, .*; .*papermill: --cwd notebooks")):
        load_protocol("../nope/p.yaml")
    (tmp_path / "b.yaml").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ProtocolError, match=r"cannot be read"):
        load_protocol(tmp_path / "b.yaml")
    with pytest.raises(ProtocolError, match=r"p.yaml is not valid YAML at line 3, column 1 "
                                            r"\(key 'grid' is given twice \(lines 2 and 3\)"):
        (tmp_path / "p.yaml").write_text("name: t\ngrid: {rule: [bp]}\ngrid: {rule: [fa]}\n")
        load_protocol(tmp_path / "p.yaml")
    # two merge keys in one mapping: PyYAML let the later win without a word
    with pytest.raises(ProtocolError, match=re.escape(
            "p.yaml is not valid YAML at line 5, column 3 (the merge key '<<' is given twice "
            "(lines 4 and 5); merge several mappings with one: <<: [*a, *b])")):
        (tmp_path / "p.yaml").write_text(
            "name: t\nx: &a {lr: 0.05}\nfixed:\n  <<: *a\n  <<: {lr: 0.01}\n")
        load_protocol(tmp_path / "p.yaml")
    with pytest.raises(ProtocolError, match=r"protocol .* is a directory; expected a YAML "
                                            r"mapping with keys name, "):
        load_protocol(tmp_path)
    with pytest.raises(ProtocolError, match=r"has key\(s\) that are not names: 1; expected"):
        (tmp_path / "p.yaml").write_text("1: x\n")  # keys must be names
        load_protocol(tmp_path / "p.yaml")


def test_paths_are_relative_to_the_protocol_file(tmp_path):
    (tmp_path / "sub").mkdir()
    rel = os.path.relpath(ECHO, tmp_path / "sub")
    protocol = load_protocol(write_protocol(tmp_path / "sub" / "p.yaml", notebook=rel))
    assert Path(protocol.notebook) == ECHO.resolve()
    assert Path(protocol.out) == (tmp_path / "sub" / "runs").resolve()


def test_data_paths_among_the_parameters_are_relative_to_the_protocol_file(tmp_path,
                                                                           monkeypatch):
    # csv_path was resolved against the working directory: runs made from the protocol's
    # folder were `stale` from its parent, and a sweep from elsewhere read no file (or
    # another file of the same relative name).
    (tmp_path / "csv").mkdir()
    (tmp_path / "protos").mkdir()
    prices = "close\n" + "".join(f"{100 + (i % 17) * 0.5 + i * 0.01:.2f}\n" for i in range(600))
    for name in ("a", "b"):
        (tmp_path / "csv" / f"{name}.csv").write_text(prices)
    path = write_protocol(tmp_path / "protos" / "p.yaml",
                          notebook=str(ROOT / "notebooks" / "03-train-cfc-aux.ipynb"),
                          fixed={"source": "csv", "column": "close", "steps": 2},
                          grid={"csv_path": ["../csv/a.csv", "../csv/b.csv"]})
    for cwd in (tmp_path, tmp_path / "protos", tmp_path / "csv"):
        monkeypatch.chdir(cwd)
        for configs in (False, True):  # the analysis' torch-free load, and a sweep's
            specs = expand(load_protocol(path, configs=configs))
            assert [spec.params["csv_path"] for spec in specs] == \
                [str((tmp_path / "csv" / f"{name}.csv").resolve()) for name in ("a", "b")]
            # the ids and grid columns keep the protocol's text
            assert [spec.grid["csv_path"] for spec in specs] == ["../csv/a.csv", "../csv/b.csv"]
            assert [spec.run_id for spec in specs] == \
                [run_id_for(spec.grid, {"csv_path": ["../csv/a.csv", "../csv/b.csv"]})
                 for spec in specs]


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
    assert run_id_for({"dims": [1, 2], "name": "a/b c"}) == \
        f"dims-1+2_name-a-b-c-{hashlib.sha256(b'a/b c').hexdigest()[:8]}"


def test_demo_protocol():
    protocol = load_protocol(ROOT / "protocols" / "demo.yaml")
    specs = expand(protocol)
    assert [s.run_id for s in specs] == ["rule-bp_seed-0", "rule-bp_seed-1"]
    assert specs[0].params["depth"] == 20 and specs[0].params["width"] == 16
    # The demo trains with the documented recipe: ConvConfig's default epochs.
    assert specs[0].params["epochs"] == ConvConfig().epochs
    assert Path(protocol.report).name == "10-summary.ipynb"


def _waits_for_selection(path: Path) -> bool:
    """A later stage: it includes what `lab select` has not written yet."""
    include = yaml.safe_load(path.read_text()).get("include") or []
    include = [include] if isinstance(include, str) else include
    return any(not (path.parent / name).is_file() for name in include)


@pytest.mark.parametrize("path", sorted((ROOT / "protocols").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_protocol_builds_valid_configs(path):
    if _waits_for_selection(path):
        # A later stage: it loads once `lab select` has written what it includes.
        with pytest.raises(ProtocolError, match=r"does not exist; `lab select "
                                                r"\S+-select(-\w+)?\.yaml` writes it"):
            load_protocol(path)
        return
    protocol = load_protocol(path)  # builds every run's config through the notebook's class
    spec = lab.notebook.notebook_spec(protocol.notebook)
    assert spec.config_class is not None, f"{protocol.notebook} names no lab_config class"
    for run in expand(protocol):
        assert lab.notebook.resolve_parameters(protocol.notebook, run.params, spec).full


def test_a_dotted_grid_key_gets_readable_ids_and_sets_one_key(tmp_path):
    path = write_protocol(tmp_path / "p.yaml", fixed={"opts": {"scale": 1, "label": "z"}},
                          grid={"opts.scale": [2, 3], "x": [1]})
    protocol = load_protocol(path)
    specs = expand(protocol)
    assert [s.run_id for s in specs] == ["opts.scale-2_x-1", "opts.scale-3_x-1"]
    assert specs[0].grid == {"opts.scale": 2, "x": 1}
    resolved = lab.notebook.resolve_parameters(protocol.notebook, specs[1].params)
    assert resolved.params["opts"] == {"scale": 3, "label": "z"}  # the other key is kept


def test_grid_values_are_built_into_the_config_class_at_load(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lab.notebook, "_papermill", lambda *a, **k: pytest.fail("kernel"))
    bad = write_protocol(tmp_path / "p.yaml", notebook=str(TRAIN), out="runs",
                         fixed={"epochs": 1}, grid={"lr": ["fast", 0.1], "seed": [0, 1]})
    with pytest.raises(ProtocolError, match=r"2 of 4 runs have parameters the notebook refuses, "
                       r"so none was started: ConvConfig.lr must be float, got 'fast' \(str\) "
                       r"\(runs lr-fast_seed-0, lr-fast_seed-1\)"):
        load_protocol(bad)
    assert cli_main(["sweep", str(bad), "-q"]) == 2
    assert "ConvConfig.lr must be float" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    unknown = write_protocol(tmp_path / "q.yaml", notebook=str(TRAIN), fixed={"rule": "kp"},
                             grid={"rule_params.nosuch": [1], "seed": [0]})
    with pytest.raises(ProtocolError) as err:
        load_protocol(unknown)
    from lab.rules import RULES
    assert "'nosuch'" in str(err.value)
    assert all(name in str(err.value) for name in field_names(RULES["kp"].Params))


# ---------------------------------------------------------------------------
# deciding from record.json alone


def _fake_run(run_dir: Path, status: str, config: dict):
    record = records.new_record(run_id=run_dir.name, kind="notebook", config=config)
    record["status"] = status
    records.save_run(run_dir, record)


def _conv_config(**values) -> dict:
    """The oracle for a resolved conv config: ConvConfig from the notebook's defaults."""
    defaults = {k: v for k, v in notebook_defaults(TRAIN).items() if k != "out_dir"}
    return json.loads(json.dumps(dataclasses.asdict(ConvConfig(**{**defaults, **values}))))


def _states(protocol) -> dict:
    return {rid: (o.status if o else "execute") for rid, o in plan(protocol, 1)[1].items()}


def test_protocol_changes_are_compared_on_resolved_configs(tmp_path, monkeypatch):
    monkeypatch.setattr(lab.notebook, "_papermill", lambda *a, **k: pytest.fail("kernel"))
    runs = tmp_path / "runs"
    _fake_run(runs / "seed-0", "complete", _conv_config(epochs=4, threads=1, seed=0))

    def protocol(**fixed):
        return load_protocol(write_protocol(tmp_path / "p.yaml", notebook=str(TRAIN),
                                            fixed=fixed, grid={"seed": [0, 1]},
                                            threads_per_run=1))

    # The protocol it was run with; and with an explicit default (lr 0.1) or another
    # progress flag (display only): the same runs.
    for same in ({"epochs": 4}, {"epochs": 4, "lr": 0.1}, {"epochs": 4, "progress": True}):
        assert _states(protocol(**same)) == {"seed-0": "complete", "seed-1": "execute"}
    # epochs removed: the notebook's default (2) applies, so the run is stale.
    report = plan(protocol(), 1)[1]["seed-0"]
    assert report.status == "stale" and report.skipped
    assert "complete run with other parameters (epochs: 4 there vs 2 now)" in report.error
    assert "--force" in report.error
    assert _states(protocol(epochs=4, lr=0.2))["seed-0"] == "stale"


def test_plan_reports_locked_interrupted_and_unreadable_runs(tmp_path):
    path = write_protocol(tmp_path / "p.yaml", grid={"x": [1, 2, 3, 4]}, threads_per_run=1)
    protocol = load_protocol(path)
    runs = tmp_path / "runs"
    config = lab.notebook.resolve_parameters(ECHO, {"x": 1}).config
    _fake_run(runs / "x-1", "complete", config)
    _fake_run(runs / "x-2", "running", {**config, "x": 2})  # killed: resumes
    (runs / "x-3").mkdir()
    (runs / "x-3" / "record.json").write_text("{half")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from lab import runlock; "
                               "lock = runlock.acquire(sys.argv[1]); print('held', flush=True); "
                               "time.sleep(600)", str(runs / "x-4")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        outcomes = plan(protocol, 1)[1]
        assert outcomes["x-1"].status == "complete" and outcomes["x-1"].skipped
        assert outcomes["x-2"] is None
        assert outcomes["x-3"].status == "unreadable" and "not valid JSON" in outcomes["x-3"].error
        assert outcomes["x-4"].status == "locked" and str(holder.pid) in outcomes["x-4"].error
        # --force replaces the unreadable run; the live one is never touched.
        forced = plan(protocol, 1, force=True)[1]
        assert forced["x-3"] is None and forced["x-4"].status == "locked"
        # The summary says a locked run may be finished by its holder (two sweeps of one
        # protocol: each ended "LOCKED" for runs the other had completed meanwhile).
        report = SweepReport("p", str(runs), [o for o in outcomes.values() if o])
        assert report.summary().endswith(
            "\n  (a locked run is another process's to finish, and it may have by now: "
            "`lab runs` on the protocol shows where each run stands)")
        assert "locked run" not in SweepReport("p", str(runs), [outcomes["x-1"]]).summary()
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------------------
# sweeps


def test_failing_run_is_reported_and_the_others_finish(tmp_path, capsys):
    path = write_protocol(tmp_path / "p.yaml", grid={"x": [1, 2, 3]}, fixed={"fail_on": 2})
    assert cli_main(["sweep", str(path), "--workers", "2", "-q"]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert "FAILED x-2: ValueError: asked to fail at x=2" in out
    assert "3 runs, 3 executed, 0 already finished, 0 locked by another process, 0 left alone " \
           "(stale or unreadable), 1 failed" in out
    assert "Port 8787" not in captured.err + out  # no dashboard
    runs = tmp_path / "runs"
    assert records.load_record(runs / "x-1")["status"] == "complete"
    assert records.load_record(runs / "x-3")["status"] == "complete"
    failed = records.load_record(runs / "x-2")
    assert failed["status"] == "failed" and "asked to fail at x=2" in failed["error"]
    assert (runs / "x-2" / "notebook.ipynb").exists()
    # Listed by `lab runs`, with the error.
    table, unreadable = runs_table(runs)
    assert not unreadable
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
        assert values["omp_threads"] == values["numba_threads"] == "1"
        assert values["malloc_trim"] == kernel_env()["MALLOC_TRIM_THRESHOLD_"] != "65536"
        again = run_sweep(protocol, scheduler=cluster.scheduler_address, progress=False)
    assert all(o.skipped for o in again.outcomes) and not again.failed
    # A changed protocol does not silently reuse runs made with other parameters...
    changed = load_protocol(write_protocol(tmp_path / "p.yaml", grid={"x": [1, 2]},
                                           fixed={"fail_on": 7}, threads_per_run=1))
    before = (tmp_path / "runs" / "x-1" / "record.json").read_bytes()
    stale = run_sweep(changed, workers=1, progress=False)
    assert [o.status for o in stale.outcomes] == ["stale", "stale"]
    assert "fail_on: -1 there vs 7 now" in stale.outcomes[0].error
    assert (tmp_path / "runs" / "x-1" / "record.json").read_bytes() == before
    # ...unless told to replace them: the old runs are kept beside the new ones.
    forced = run_sweep(changed, workers=1, progress=False, force=True)
    assert [o.status for o in forced.outcomes] == ["complete", "complete"]
    kept = Path(forced.outcomes[0].moved_aside)
    assert kept.name.startswith("x-1.old-") and (kept / "record.json").read_bytes() == before
    assert records.load_record(tmp_path / "runs" / "x-1")["config"]["fail_on"] == 7


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
    return json.dumps([record.get("trajectory"), record["final"]], sort_keys=True)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_sigkill_mid_sweep_then_resume_equals_uninterrupted(tiny, tmp_path):
    # Two runs at once: the 1-epoch one finishes while the 150-epoch one is mid-way
    # (about 5 s of training: a window wide enough to see on a loaded machine).
    fixed = {key: value for key, value in tiny.items() if key != "epochs"}
    grid = {"epochs": [1, 150]}
    killed = write_protocol(tmp_path / "killed.yaml", notebook=str(TRAIN), out="killed",
                            fixed=fixed, grid=grid, threads_per_run=1)
    protocol = load_protocol(killed)
    marker = f"LAB_TEST_SWEEP_{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-m", "lab.cli", "sweep", str(killed), "-q",
                             "--workers", "2"], env={**os.environ, marker: "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        def one_done_one_training():
            states = plan(protocol, 1)[1]
            try:  # its record, not the lock: a notebook's last cells run after training
                training = records.load_record(tmp_path / "killed" / "epochs-150",
                                               rows=False)["status"] == "running"
            except records.RecordError:
                training = False
            return proc.poll() is not None or (training and states["epochs-1"] is not None
                                               and states["epochs-1"].status == "complete")

        _wait_until(one_done_one_training, 180, "one run complete while the other trains")
        assert proc.poll() is None, "the sweep finished before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI, the Dask scheduler and its workers
        proc.wait()
    # Kernels die with their worker (PR_SET_PDEATHSIG): none outlives the kill.
    _wait_until(lambda: not _marked_processes(marker), 2, "orphaned kernels to exit")
    # A dying worker holds its run's lock until its files are closed, after its
    # environment is gone: wait for that too, or a finished run reads as locked.
    _wait_until(lambda: all(runlock.holder(tmp_path / "killed" / s.run_id) is None
                            for s in expand(protocol)), 10, "the killed workers' locks")

    states = plan(protocol, 1)[1]
    done = sorted(rid for rid, o in states.items() if o is not None and o.status == "complete")
    assert done == ["epochs-1"], states
    before = {rid: (tmp_path / "killed" / rid / "record.json").read_bytes() for rid in done}
    report = run_sweep(protocol, workers=2, progress=False)
    assert not report.failed and not report.left_alone
    assert sorted(o.run_id for o in report.outcomes if o.skipped) == done, (states, report)
    after = {rid: (tmp_path / "killed" / rid / "record.json").read_bytes() for rid in done}
    assert after == before, "runs finished before the kill were touched again"

    # The reference: each run's resolved config trained uninterrupted, in this process.
    for spec in expand(protocol):
        resolved = lab.notebook.resolve_parameters(TRAIN, {**spec.params, "threads": 1})
        train_conv(from_dict(ConvConfig, resolved.config), tmp_path / "whole" / spec.run_id)
        assert _values(tmp_path / "killed" / spec.run_id) == \
            _values(tmp_path / "whole" / spec.run_id), spec.run_id


def _trace(run_dir: Path) -> list[tuple[str, int, float]]:
    lines = (run_dir / "trace.log").read_text().splitlines()
    return [(event, int(pid), float(at)) for event, pid, at in map(str.split, lines)]


def _sweep_process(path: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lab.cli", "sweep", str(path), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


@pytest.mark.slow
def test_two_concurrent_sweeps_execute_each_run_once(tmp_path):
    path = write_protocol(tmp_path / "p.yaml", notebook=str(SLOW), grid={"x": [1, 2, 3]},
                          fixed={"ticks": 10}, workers=1, threads_per_run=1)
    first, second = _sweep_process(path), _sweep_process(path)
    outputs = [proc.communicate(timeout=240)[0] for proc in (first, second)]
    executed = [int(re.search(r"(\d+) executed", out).group(1)) for out in outputs]
    assert sum(executed) == 3, outputs
    for run in ("x-1", "x-2", "x-3"):
        trace = _trace(tmp_path / "runs" / run)
        assert [e for e, _, _ in trace].count("start") == 1, (run, trace)
        assert len({pid for _, pid, _ in trace}) == 1
        assert records.load_record(tmp_path / "runs" / run)["status"] == "complete"
    assert all("Port 8787" not in out for out in outputs)


@pytest.mark.slow
def test_a_sweep_restarted_after_sigkill_never_overlaps_the_old_kernels(tmp_path):
    path = write_protocol(tmp_path / "p.yaml", notebook=str(SLOW), grid={"x": [1, 2]},
                          fixed={"ticks": 40}, workers=2, threads_per_run=1)
    runs = tmp_path / "runs"
    first = _sweep_process(path)
    _wait_until(lambda: all((runs / r / "trace.log").exists() and
                            len(_trace(runs / r)) >= 3 for r in ("x-1", "x-2")),
                120, "both runs to be writing")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed_at = time.time()
    second = _sweep_process(path)  # at once: its workers may take the runs immediately
    out = second.communicate(timeout=240)[0]
    assert second.returncode == 0, out
    for run in ("x-1", "x-2"):
        trace = _trace(runs / run)
        pids = list(dict.fromkeys(pid for _, pid, _ in trace))
        assert len(pids) == 2, trace  # killed once, executed again once
        old_last = max(at for _, pid, at in trace if pid == pids[0])
        new_first = min(at for _, pid, at in trace if pid == pids[1])
        # The old kernel died with its worker: the kernel gets its death signal when its
        # parent dies, a few ms after `killpg` returns at most (without it, it kept writing
        # until its run ended), so never while the restarted sweep's kernel was training.
        assert old_last < new_first, (run, old_last, new_first)
        assert old_last - killed_at < 0.25, (run, old_last - killed_at)
        assert killed_at < new_first
        assert [e for e, pid, _ in trace if pid == pids[1]][-1] == "end"


def test_lab_runs_lists_a_protocol_with_missing_runs(tmp_path, capsys):
    source = ROOT / "tests" / "fixtures" / "summary" / "protocol.yaml"
    assert cli_main(["runs", str(source)]) == 0
    out = capsys.readouterr().out
    assert "lr-0.05_rule-bp_seed-0" in out and "test_acc" in out and "complete" in out
    path = write_protocol(tmp_path / "p.yaml", grid={"x": [1, 2]})
    config = lab.notebook.resolve_parameters(ECHO, {"x": 1}).config
    _fake_run(tmp_path / "runs" / "x-1", "complete", config)
    _fake_run(tmp_path / "runs" / "x-1.old-20200101T000000Z", "failed", config)  # moved aside
    table, _ = runs_table(path)
    assert dict(zip(table.run_id, table.status)) == {"x-1": "complete", "x-2": "missing"}
    assert list(table["dir"]) == ["x-1", "x-2"]
    assert table.attrs["not_in_protocol"] == []  # (a moved-aside run is the protocol's)
    assert cli_main(["runs", str(tmp_path / "nowhere")]) == 2
    # A grid value removed since: its run is not listed, but it is not passed over either.
    _fake_run(tmp_path / "runs" / "x-7", "complete", {**config, "x": 7})
    capsys.readouterr()
    assert cli_main(["runs", str(path)]) == 0
    out = capsys.readouterr().out
    assert "x-7" not in out.split("\n\n")[0]  # not in the table
    assert out.endswith("\n1 run directory in the protocol's out is not among its runs (x-7): "
                        "a grid value removed since, or another protocol's? `lab runs` on the "
                        "directory lists them\n")


def test_a_fixed_leaf_inside_a_grid_dict_is_refused(tmp_path):
    # Dotted keys are applied last: the fixed leaf would override every grid value's.
    path = write_protocol(tmp_path / "p.yaml", notebook=str(TRAIN),
                          fixed={"rule": "kp_traffic", "rule_params.predictor_warmup_steps": 5},
                          grid={"rule_params": [{"traffic_rule": "innovation",
                                                 "predictor_warmup_steps": 7}]})
    with pytest.raises(ProtocolError, match=r"Protocol.fixed rule_params.predictor_warmup_steps "
                                            r"\(inside grid key rule_params\) would override "
                                            r"that leaf of every grid value"):
        load_protocol(path, configs=False)


# ---------------------------------------------------------------------------
# trial 5: overrides beaten by fixed leaves, blank/odd paths, threads, run ids


def test_an_override_beaten_by_a_fixed_dotted_key_is_refused(tmp_path):
    # Dotted keys are applied after whole dicts: the fixed leaf would beat the override's,
    # though an override is meant to win over `fixed`.
    path = write_protocol(tmp_path / "p.yaml", fixed={"opts.scale": 2},
                          overrides={"x": {1: {"opts": {"scale": 5, "label": "b"}}}})
    with pytest.raises(ProtocolError, match=r"Protocol.fixed opts.scale beats "
                                            r"Protocol.overrides\['x'\]\[1\] opts: a dotted key "
                                            r"is applied after a whole dict"):
        load_protocol(path, configs=False)
    # An override leaf inside a grid key's dicts would beat every grid value's leaf.
    inside = write_protocol(tmp_path / "q.yaml", grid={"x": [1, 2], "opts": [{"scale": 1}]},
                            overrides={"x": {1: {"opts.scale": 3}}})
    with pytest.raises(ProtocolError, match=r"Protocol.overrides\['x'\]\[1\] sets opts.scale "
                                            r"\(inside grid key opts\), which would override"):
        load_protocol(inside, configs=False)
    # The way the message suggests: the override as the same dotted key wins for its value.
    fixed = write_protocol(tmp_path / "r.yaml", fixed={"opts.scale": 2},
                           overrides={"x": {1: {"opts.scale": 5}}})
    protocol = load_protocol(fixed)
    scales = {spec.run_id: lab.notebook.resolve_parameters(ECHO, spec.params).params["opts"]
              for spec in expand(protocol)}
    assert scales == {"x-1": {"scale": 5, "label": "a"}, "x-2": {"scale": 2, "label": "a"}}


@pytest.mark.parametrize("fields, message", [
    ({"out": ""}, r"Protocol.out='' is blank; give the directory that holds the runs"),
    ({"out": "  "}, r"Protocol.out='  ' is blank"),
    ({"notebook": ""}, r"Protocol.notebook='' is blank; give the notebook each run executes"),
    ({"report": ""}, r"Protocol.report='' is blank; give the analysis notebook `lab report` "
                     r"executes .* or leave the key out for none"),
    ({"out": "afile"}, r"Protocol.out='afile' \(.*afile\) is a file, not a directory; out must "
                       r"be a directory that holds the runs \(it need not exist yet\)"),
    ({"out": "afile/deeper"}, r"Protocol.out='afile/deeper' \(.*deeper\) is inside .*afile, "
                              r"which is a file, not a directory"),
    ({"report": "adir"}, r"Protocol.report='adir' \(.*adir\) is a directory; give the analysis "
                         r"notebook \(.ipynb\)"),
    ({"notebook": "adir"}, r"notebook .*adir is a directory; give the notebook \(.ipynb\)"),
    ({"report": "adir/nope.ipynb"}, r"Protocol.report='adir/nope.ipynb' \(.*nope.ipynb\) does "
                                    r"not exist; notebooks in .*adir: none \(or leave the key"),
    # no analysis notebook: found by `lab report` only, after the whole sweep
    ({"report": str(TRAIN)}, r"Protocol.report: .*01-train-conv.ipynb is not an analysis "
                             r"notebook: it does not declare the 'protocol' parameter"),
    ({"report": "afile"}, r"Protocol.report: .*afile cannot be read as a Jupyter notebook"),
])
def test_blank_and_misplaced_paths_are_refused_at_load(tmp_path, monkeypatch, capsys, fields,
                                                       message):
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "adir").mkdir()
    path = write_protocol(tmp_path / "p.yaml", **fields)
    with pytest.raises(ProtocolError, match=message):
        load_protocol(path, configs=False)
    # `lab sweep` refuses it before any Dask cluster starts, creating nothing.
    import distributed

    monkeypatch.setattr(distributed, "LocalCluster",
                        lambda *a, **k: pytest.fail("a cluster was started"))
    monkeypatch.chdir(tmp_path)
    assert cli_main(["sweep", str(path), "-q"]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile", "p.yaml"]


def test_a_blank_out_is_refused_in_python_too():
    with pytest.raises(ProtocolError, match=r"Protocol.out='' is blank"):
        Protocol(name="t", notebook="nb.ipynb", out="", grid={"seed": [0]})
    with pytest.raises(ProtocolError, match=r"Protocol.report=' ' is blank"):
        Protocol(name="t", notebook="nb.ipynb", out="o", report=" ", grid={"seed": [0]})


@pytest.mark.parametrize("fields, named", [
    ({"fixed": {"threads": 2}}, r"Protocol.fixed threads=2"),
    ({"grid": {"x": [1], "threads": [1, 2]}}, r"Protocol.grid threads=\[1, 2\]"),
    ({"overrides": {"x": {1: {"threads": 2}}}},
     r"Protocol.overrides\['x'\]\[1\] threads=2"),
])
def test_threads_set_twice_is_refused(tmp_path, fields, named):
    path = write_protocol(tmp_path / "p.yaml", notebook=str(TRAIN), threads_per_run=1, **fields)
    with pytest.raises(ProtocolError, match=r"Protocol.threads_per_run=1 and " + named
                       + r" both set each run's thread count; keep one"):
        load_protocol(path, configs=False)


def test_threads_left_to_the_machine_are_taken_from_the_record(tmp_path, monkeypatch):
    # A run made by a sweep with 2 workers on 2 cores (1 thread each), then asked again by a
    # sweep with 1 worker (2 threads): `lab sweep` and `lab runs` must agree it is complete.
    from lab.sweep import stale_runs

    monkeypatch.setattr(lab.notebook, "_papermill", lambda *a, **k: pytest.fail("kernel"))
    runs = tmp_path / "runs"
    _fake_run(runs / "seed-0", "complete", _conv_config(epochs=1, threads=1, seed=0))
    _fake_run(runs / "seed-1", "running", _conv_config(epochs=1, threads=1, seed=1))  # killed

    def protocol(threads_per_run, **fixed):
        return load_protocol(write_protocol(tmp_path / "p.yaml", notebook=str(TRAIN),
                                            fixed={"epochs": 1, **fixed},
                                            grid={"seed": [0, 1, 2]},
                                            threads_per_run=threads_per_run))

    auto = protocol(0)
    specs, outcomes = plan(auto, 2)
    assert outcomes["seed-0"].status == "complete" and outcomes["seed-0"].skipped
    assert stale_runs(auto) == {}
    # The interrupted run resumes with the threads it started with; a new run gets this
    # sweep's count.
    threads = {spec.run_id: spec.params["threads"] for spec in specs}
    assert threads == {"seed-0": 1, "seed-1": 1, "seed-2": 2}
    assert outcomes["seed-1"] is None and outcomes["seed-2"] is None
    # A protocol that fixes the count: both call the run made with another count stale.
    for fixed in (protocol(2), protocol(0, threads=2)):
        assert plan(fixed, 2)[1]["seed-0"].status == "stale"
        assert "threads: 1 there vs 2" in stale_runs(fixed)["seed-0"]
    # Stale for another reason and forced: it is run afresh, with this sweep's count.
    changed = protocol(0, lr=0.2)
    assert "lr: 0.1 there vs 0.2" in stale_runs(changed)["seed-0"]
    assert plan(changed, 2)[1]["seed-0"].status == "stale"
    specs, outcomes = plan(changed, 2, force=True)
    assert outcomes["seed-0"] is None
    assert {s.run_id: s.params["threads"] for s in specs}["seed-0"] == 2


def _echo_taking_text(path: Path) -> str:
    """echo.ipynb with x's default None: x then takes text (its default 1 takes ints only)."""
    import nbformat

    nb = nbformat.read(ECHO, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source, hits = re.subn(r"(?m)^x = 1$", "x = None", cell.source)
    assert hits == 1, cell.source
    nbformat.write(nb, str(path))
    return str(path)


def test_run_ids_of_non_ascii_values_are_distinct_and_stable(tmp_path):
    import hashlib

    def digest(text):
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    echo = _echo_taking_text(tmp_path / "echo.ipynb")
    path = write_protocol(tmp_path / "p.yaml", notebook=echo,
                          grid={"x": ["α", "β", "café", "🙂", "🙃", "a🙂"]})
    ids = [spec.run_id for spec in expand(load_protocol(path))]
    assert ids == ["x-α", "x-β", "x-café", f"x-{digest('🙂')}", f"x-{digest('🙃')}",
                   f"x-a-{digest('a🙂')}"]
    # One letter in two Unicode forms (composed é, e + combining accent): two values, and
    # the one the id does not spell as given gets the digest.
    both = write_protocol(tmp_path / "q.yaml", notebook=echo,
                          grid={"x": ["caf\u00e9", "cafe\u0301"]})
    decomposed = digest("cafe\u0301")
    assert [s.run_id for s in expand(load_protocol(both))] == ["x-café", f"x-café-{decomposed}"]
    # The file system takes them, with --force's suffix too.
    for run_id in ids:
        (tmp_path / "runs" / f"{run_id}.old-20260101T000000Z-99").mkdir(parents=True)


def test_long_run_ids_are_shortened_with_a_digest(tmp_path):
    import hashlib

    from lab.sweep import MAX_RUN_ID_BYTES

    assert MAX_RUN_ID_BYTES + len(".old-20260101T000000Z-99") == 255
    grid = {"x": ["a" * 300, "a" * 299 + "b", "é" * 200, "short"]}
    echo = _echo_taking_text(tmp_path / "echo.ipynb")
    ids = [spec.run_id for spec in expand(load_protocol(write_protocol(tmp_path / "p.yaml",
                                                                        notebook=echo,
                                                                        grid=grid)))]
    assert len(set(ids)) == 4 and ids[3] == "x-short"
    for run_id, value in zip(ids[:3], grid["x"][:3], strict=True):
        full = f"x-{value}"
        assert len(run_id.encode()) <= MAX_RUN_ID_BYTES
        assert run_id.endswith("-" + hashlib.sha256(full.encode()).hexdigest()[:8])
        assert full.startswith(run_id[:-9])  # cut on a whole character
        (tmp_path / "runs" / f"{run_id}.old-20260101T000000Z-99").mkdir(parents=True)
    assert len(ids[0].encode()) == MAX_RUN_ID_BYTES


def _echo_with_threads(path: Path) -> Path:
    """The echo notebook with a `threads` parameter, as a trainer notebook declares it."""
    nb = json.loads(ECHO.read_text())
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if "parameters" in cell["metadata"].get("tags", []):
            cell["source"] = source + "\nthreads = 0"
        elif "record_value(\"x\", x)" in source:
            cell["source"] = source + "\nrecord_value(\"threads\", threads)"
    path.write_text(json.dumps(nb))
    return path


def test_lab_sweep_with_fewer_workers_keeps_runs_lab_runs_calls_complete(tmp_path, monkeypatch,
                                                                         capsys):
    # The trial's repro: threads_per_run 0, a sweep with --workers 2, then --workers 1.
    monkeypatch.setattr("lab.sweep.usable_cores", lambda: 4)
    notebook = _echo_with_threads(tmp_path / "threads.ipynb")
    # x-2 sets its own count: its kernel's OMP/Numba threads follow it.
    path = write_protocol(tmp_path / "p.yaml", notebook=str(notebook), grid={"x": [1, 2]},
                          overrides={"x": {2: {"threads": 3}}}, threads_per_run=0)
    assert cli_main(["sweep", str(path), "-q", "--workers", "2"]) == 0
    for run, threads in (("x-1", 2), ("x-2", 3)):  # x-1: 4 cores // 2 workers
        values = read_values(tmp_path / "runs" / run / "notebook.ipynb")
        assert values["threads"] == threads
        assert values["omp_threads"] == values["numba_threads"] == str(threads)
    capsys.readouterr()
    assert cli_main(["sweep", str(path), "-q", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 runs, 0 executed, 2 already finished" in out and "STALE" not in out
    table, _ = runs_table(path)
    assert dict(zip(table.run_id, table.status)) == {"x-1": "complete", "x-2": "complete"}
    # A grid value removed since: the sweep names the run it no longer covers (as lab runs).
    fewer = write_protocol(tmp_path / "p.yaml", notebook=str(notebook), grid={"x": [1]},
                           threads_per_run=0)
    assert cli_main(["sweep", str(fewer), "-q", "--workers", "1"]) == 0
    assert capsys.readouterr().out.endswith(
        "note: 1 run directory in the protocol's out is not among its runs (x-2): a grid value "
        "removed since, or another protocol's? `lab runs` on the directory lists them; the "
        "sweep leaves it alone\n")


def test_lab_runs_and_lab_sweep_agree_on_a_notebooks_own_parameters(tmp_path, monkeypatch):
    # A notebook with a parameter beyond its config class (a note): a run made with another
    # note is stale for both the sweep's plan and stale_runs (`lab runs`, `lab report`).
    import nbformat

    from lab.sweep import stale_runs

    monkeypatch.setattr(lab.notebook, "_papermill", lambda *a, **k: pytest.fail("kernel"))
    nb = nbformat.read(TRAIN, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source += '\nnote = "default note"\n'
    nbformat.write(nb, str(tmp_path / "mine.ipynb"))
    runs = tmp_path / "runs"
    for seed, note in ((0, "first"), (1, "second")):
        record = records.new_record(run_id=f"seed-{seed}", kind="conv",
                                    config=_conv_config(epochs=1, threads=1, seed=seed))
        record.update(status="complete", notebook_params={"note": note})
        records.save_run(runs / f"seed-{seed}", record)
    protocol = load_protocol(write_protocol(tmp_path / "p.yaml", notebook="mine.ipynb",
                                            fixed={"epochs": 1, "note": "first"},
                                            grid={"seed": [0, 1]}, threads_per_run=1))
    outcomes = plan(protocol)[1]
    assert outcomes["seed-0"].status == "complete"
    assert outcomes["seed-1"].status == "stale"
    assert stale_runs(protocol) == {"seed-1": "note: 'second' there vs 'first' now"}


def test_the_summary_counts_diverged_runs_apart():
    from lab.sweep import RunOutcome, SweepReport

    report = SweepReport("p", "runs", [
        RunOutcome("a", "complete"), RunOutcome("b", "diverged", "train_loss=inf at epoch 3"),
        RunOutcome("c", "failed", "ValueError: x")], wall_s=1.0)
    text = report.summary()
    assert "3 runs, 3 executed, 0 already finished" in text and "1 failed, 1 diverged in" in text
    assert "  DIVERGED b: train_loss=inf at epoch 3" in text and "  FAILED c: ValueError: x" in text
    assert [o.run_id for o in report.diverged] == ["b"]


def test_negative_grid_values_keep_their_sign_in_run_ids():
    from lab.sweep import run_id_for

    assert run_id_for({"drift": -0.001}) == "drift--0.001"
    assert run_id_for({"drift": 0.001}) == "drift-0.001"
    # replaced characters at the ends still go (the digest tells the value apart)
    assert run_id_for({"x": "/a b/"}).startswith("x-a-b-")
    assert len({run_id_for({"s": v}) for v in (-1.0, 1.0, -2, 2)}) == 4


# ---------------------------------------------------------------------------
# run ids: distinct values give distinct ids, also ignoring letter case


def _sha8(value) -> str:
    """The digest a run id appends: a string's own text, any other value's JSON."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


@pytest.mark.parametrize("values, ids", [
    (["b c", "b-c", "b_c"], [f"x-b-c-{_sha8('b c')}", "x-b-c", "x-b_c"]),
    (["", "none"], [f"x-{_sha8('')}", "x-none"]),
    ([1, "1"], ["x-1", f"x-1-{_sha8('1')}"]),
    ([True, "True"], ["x-true", f"x-True-{_sha8('True')}"]),
    ([False, "false"], ["x-false", f"x-false-{_sha8('false')}"]),
    ([None, "None"], [f"x-None-{_sha8(None)}", f"x-None-{_sha8('None')}"]),
    (["b", "B", "c"], [f"x-b-{_sha8('b')}", f"x-B-{_sha8('B')}", "x-c"]),
    ([1.5, "1.5", "1.50"], ["x-1.5", f"x-1.5-{_sha8('1.5')}", f"x-1.50-{_sha8('1.50')}"]),
    ([[1, 5], "1+5"], [f"x-1+5-{_sha8([1, 5])}", f"x-1+5-{_sha8('1+5')}"]),
])
def test_distinct_grid_values_give_ids_distinct_ignoring_case(tmp_path, values, ids):
    path = write_protocol(tmp_path / "p.yaml", grid={"x": values, "fail_on": [0]})
    specs = expand(load_protocol(path, configs=False))
    assert [s.run_id for s in specs] == [f"fail_on-0_{i}" for i in ids]
    assert [s.grid["x"] for s in specs] == values  # each id holds the value it names
    assert len({s.run_id.casefold() for s in specs}) == len(values)
    for spec in specs:  # each is a directory of its own, --force's suffix included
        (tmp_path / "ids" / f"{spec.run_id.casefold()}.old-20260101T000000Z-99").mkdir(
            parents=True)


@pytest.mark.parametrize("value, run_id", [
    (0.001, "x-0.001"), (-0.001, "x--0.001"), (1e-05, "x-1e-05"), (3, "x-3"), (True, "x-true"),
    ("kp_traffic", "x-kp_traffic"), ("raw", "x-raw"), ("none", "x-none"), ("α", "x-α"),
    (None, "x-None"), ([1, 2], "x-1+2"), ({"scale": 0.5, "b": True}, "x-b=true,scale=0.5")])
def test_a_value_its_text_names_exactly_is_its_id(value, run_id):
    assert run_id_for({"x": value}) == run_id
    assert run_id_for({"x": value}, {"x": [value, "other"]}) == run_id


def test_ids_of_the_committed_protocols_name_their_runs():
    # Every run directory the fixtures hold is still found under the id its protocol gives.
    fixtures = sorted((ROOT / "tests" / "fixtures").glob("*/protocol.yaml"))
    assert len(fixtures) >= 5
    for path in fixtures:
        protocol = load_protocol(path, configs=False)
        ids = [s.run_id for s in expand(protocol)]
        made = sorted(p.name for p in Path(protocol.out).iterdir() if p.is_dir())
        assert sorted(ids) == made, path
    ids = {s.run_id for p in sorted((ROOT / "protocols").glob("*.yaml"))
           if not _waits_for_selection(p) for s in expand(load_protocol(p, configs=False))}
    assert "rule-kp_seed-0_weight_decay-0.001" in ids and "K-1_beta-0.1_seed-0" in ids
    assert "rule_params.traffic_rule-innovation_rule_params.traffic_sign-hebbian_seed-2" in ids
    assert all(re.fullmatch(r"[A-Za-z0-9._=,+-]+", i) and not re.search(r"-[0-9a-f]{8}(_|$)", i)
               for i in ids)  # ordinary values: no digest anywhere


def test_a_home_relative_out_is_the_home_directory_not_a_tilde_folder(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    protocol = load_protocol(write_protocol(tmp_path / "p.yaml", out="~/studies/t"))
    assert protocol.out == str(home / "studies" / "t")


def test_an_empty_section_is_no_entries(tmp_path):
    # `fixed:` with only comments under it is YAML's null: it was refused as "must be dict".
    path = tmp_path / "p.yaml"
    path.write_text(f"name: t\nnotebook: {ECHO}\nout: runs\nfixed:\n  # none yet\n"
                    "grid:\n  x: [1, 2]\noverrides:\n")
    protocol = load_protocol(path)
    assert protocol.fixed == {} and protocol.overrides == {}
    path.write_text(f"name: t\nnotebook: {ECHO}\nout: runs\ngrid:\n")
    with pytest.raises(ProtocolError, match="Protocol.grid is empty; give at least one"):
        load_protocol(path)


def test_threads_per_run_far_above_the_cores_is_refused_before_any_run(tmp_path, monkeypatch,
                                                                       capsys):
    # It failed inside every kernel (a `failed` run each), and the corrected protocol then
    # found them STALE; before the preflight knew threads, the sweep died in a traceback.
    import lab.sweep
    from lab.sweep import plan

    monkeypatch.setattr(lab.sweep, "usable_cores", lambda: 2)
    train = Path(__file__).resolve().parents[1] / "notebooks" / "01-train-conv.ipynb"
    path = write_protocol(tmp_path / "p.yaml", notebook=str(train), threads_per_run=64,
                          workers=1, grid={"seed": [0]},
                          fixed={"epochs": 2, "n_train": 256, "depth": 8, "width": 4})
    assert cli_main(["sweep", str(path), "-q"]) == 2
    assert "run seed-0 would execute with parameters the notebook refuses, so none was " \
        "started: threads=64 is more than 4 x the 2 core(s)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    # A remote cluster's machines are not this one: no local preflight there.
    specs, outcomes = plan(load_protocol(path), preflight=False)
    assert specs[0].params["threads"] == 64 and outcomes == {"seed-0": None}


# ---------------------------------------------------------------------------
# trial 9 (fix9-sweep): one config, one run; an unwritable out; workers; Ctrl-C


@pytest.mark.parametrize("fixed, grid, twins", [
    ({}, {"weight_decay": [0, 0.0], "seed": [0]},
     [("seed-0_weight_decay-0", "seed-0_weight_decay-0.0")]),
    ({}, {"lr": [1, 1.0, 0.5], "seed": [0]}, [("lr-1_seed-0", "lr-1.0_seed-0")]),
    # {} is fa's defaults, feedback_scale 1.0 among them.
    ({}, {"rule": ["fa"], "rule_params": [{}, {"feedback_scale": 1.0}], "seed": [0, 1]},
     [(f"rule-fa_rule_params-{_sha8({})}_seed-{s}",
       f"rule-fa_rule_params-feedback_scale=1.0_seed-{s}") for s in (0, 1)]),
    ({"rule": "fa"}, {"rule_params.feedback_scale": [1, 1.0], "seed": [0]},
     [("rule_params.feedback_scale-1_seed-0", "rule_params.feedback_scale-1.0_seed-0")]),
])
def test_grid_points_that_resolve_to_one_config_are_refused(tmp_path, monkeypatch, capsys,
                                                           fixed, grid, twins):
    # Two ids, one config: both ran, bit-identical, and the report read them as n=2.
    monkeypatch.setattr(lab.notebook, "_papermill", lambda *a, **k: pytest.fail("kernel"))
    path = write_protocol(tmp_path / "p.yaml", notebook=str(TRAIN), grid=grid,
                          fixed={"epochs": 2, "n_train": 256, "depth": 8, "width": 4, **fixed})
    pairs = "; ".join(
        " and ".join(re.escape(json.dumps(s.grid, sort_keys=True)) + rf" \(run {s.run_id}\)"
                     for rid in pair for s in expand(load_protocol(path, configs=False))
                     if s.run_id == rid) for pair in twins)
    message = (r"grid points resolve to the same config, so they are the same run twice: "
               + pairs + r"; keep one of each such group of values in the grid$")
    with pytest.raises(ProtocolError, match=message):
        load_protocol(path)
    for command in (["sweep", "-q"], ["runs"]):  # `lab runs` lists what a sweep would make
        assert cli_main([command[0], str(path), *command[1:]]) == 2
        err = capsys.readouterr().err
        assert re.search(message, err.strip()) and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_grid_points_of_distinct_configs_still_load(tmp_path):
    # The control: values that differ (0 vs 0.001, {} vs a non-default scale) are runs.
    path = write_protocol(tmp_path / "p.yaml", notebook=str(TRAIN),
                          fixed={"epochs": 2, "n_train": 256, "depth": 8, "width": 4},
                          grid={"rule": ["fa"], "weight_decay": [0, 0.001],
                                "rule_params": [{}, {"feedback_scale": 0.5}]})
    assert len(expand(load_protocol(path))) == 4
    # Without a config class the notebook's declared defaults fill in: 1 and 1.0 are
    # one run there too (lab.notebook.decide finds either "complete with these parameters").
    with pytest.raises(ProtocolError, match=r"\{\"opts.scale\": 1\} \(run opts.scale-1\) and "
                                            r"\{\"opts.scale\": 1.0\} \(run opts.scale-1.0\);"):
        load_protocol(write_protocol(tmp_path / "e.yaml", grid={"opts.scale": [1, 1.0, 2]}))
    assert len(expand(load_protocol(write_protocol(tmp_path / "f.yaml",
                                                   grid={"opts.scale": [1, "1", 2]})))) == 3


@pytest.mark.parametrize("value", [{}, []])
def test_an_empty_dict_or_list_is_named_by_its_digest(value):
    # Its text is empty: `rule_params-` (trailing dash) named nothing.
    assert run_id_for({"rule_params": value, "seed": 0}) == \
        f"rule_params-{_sha8(value)}_seed-0"
    assert run_id_for({"x": [value]}) == f"x-{_sha8([value])}"


def test_an_unwritable_out_is_refused_before_dask_starts(tmp_path, monkeypatch, capsys):
    import distributed

    monkeypatch.setattr(distributed, "LocalCluster",
                        lambda *a, **k: pytest.fail("a cluster was started"))
    path = write_protocol(tmp_path / "p.yaml", out="ro/sweep")
    load_protocol(path)  # listing or reporting runs only reads them: not refused there
    # Root may write anywhere, so the check is exercised through what os.access says.
    monkeypatch.setattr(runlock.os, "access", lambda p, mode: False)
    (tmp_path / "ro").mkdir()
    assert cli_main(["sweep", str(path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: protocol {path}: Protocol.out {tmp_path / 'ro' / 'sweep'}: "
                   f"{tmp_path / 'ro'}, where it would be made, is not writable; choose a "
                   "directory you can write to\n")
    (tmp_path / "ro" / "sweep").mkdir()  # made, but not writable
    with pytest.raises(ProtocolError, match=r"Protocol.out .*sweep: the runs directory is not "
                                            r"writable; choose a directory you can write to$"):
        run_sweep(load_protocol(path), progress=False)
    assert sorted(p.name for p in (tmp_path / "ro").iterdir()) == ["sweep"]
    assert not any((tmp_path / "ro" / "sweep").iterdir())


def test_an_out_inside_a_run_directory_is_refused_before_dask_starts(tmp_path, monkeypatch):
    # Its runs would be nested in that run: listed with it, moved aside with it by --force.
    import distributed

    monkeypatch.setattr(distributed, "LocalCluster",
                        lambda *a, **k: pytest.fail("a cluster was started"))
    (tmp_path / "a-run").mkdir()
    (tmp_path / "a-run" / "record.json").write_text("{}")
    path = write_protocol(tmp_path / "p.yaml", out="a-run/sweep")
    with pytest.raises(ProtocolError, match=r"Protocol.out .*a-run/sweep lies inside the run "
                                            r"directory .*a-run, so its runs would be nested"):
        run_sweep(load_protocol(path), progress=False)
    assert not (tmp_path / "a-run" / "sweep").exists()


def test_local_workers_are_capped_at_the_runs_and_oversubscription_is_told(monkeypatch,
                                                                          capsys):
    import lab.sweep

    monkeypatch.setattr(lab.sweep, "usable_cores", lambda: 2)
    assert lab.sweep._local_workers(12, [1, 1, 1, 1]) == 4
    assert capsys.readouterr().err.splitlines() == [
        "12 workers asked, 4 run(s) to execute: starting 4 worker process(es)",
        "warning: 4 workers x 1 thread(s) per run = 4 threads on 2 core(s): the runs will "
        "share cores and each go slower (fewer --workers or a smaller threads_per_run would "
        "fit)"]
    assert lab.sweep._local_workers(2, [1, 1, 1, 1]) == 2  # fits: not a word
    assert capsys.readouterr().err == ""
    # Not capped by cores (a researcher may mean it); the busiest runs count: 3 + 1 > 2.
    assert lab.sweep._local_workers(2, [1, 3, 1]) == 2
    assert "warning: 2 workers x up to 3 thread(s) per run = 4 threads on 2 core(s)" in \
        capsys.readouterr().err
    monkeypatch.setattr(lab.sweep, "usable_cores", lambda: 4)
    assert lab.sweep._local_workers(3, [2, 2]) == 2
    assert capsys.readouterr().err == \
        "3 workers asked, 2 run(s) to execute: starting 2 worker process(es)\n"


def test_a_sweep_starts_no_more_local_workers_than_runs(tmp_path, monkeypatch):
    import contextlib

    import lab.sweep

    started = []

    @contextlib.contextmanager
    def client(scheduler, workers):
        started.append(workers)
        raise RuntimeError("stop here")
        yield  # (a generator)

    monkeypatch.setattr(lab.sweep, "_client", client)
    path = write_protocol(tmp_path / "p.yaml", threads_per_run=1, grid={"x": [1, 2]})
    with pytest.raises(RuntimeError, match="stop here"):
        run_sweep(load_protocol(path), workers=12, progress=False)
    # The thread count a run is resolved with still follows the workers asked (so a
    # rerun with fewer runs left does not make the others stale): 1 here, as set.
    assert started == [2]


class _FakeCluster:
    """A LocalCluster whose shutdown logs what a nanny logs when its worker was killed."""

    seen: list = []

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        import logging

        nanny = logging.getLogger("distributed.nanny")
        self.seen.append(nanny.isEnabledFor(logging.ERROR))
        nanny.error("Traceback ... asyncio.exceptions.CancelledError")


@pytest.mark.parametrize("raised, quiet", [(KeyboardInterrupt, True), (SystemExit, True),
                                           (RuntimeError, False), (None, False)])
def test_distributed_logs_are_quiet_only_while_an_interrupted_cluster_closes(
        monkeypatch, caplog, raised, quiet):
    import logging

    import distributed

    import lab.sweep

    monkeypatch.setattr(distributed, "LocalCluster", _FakeCluster)
    monkeypatch.setattr(distributed, "Client", _FakeCluster)
    monkeypatch.setattr(_FakeCluster, "seen", [])
    nanny = logging.getLogger("distributed.nanny")
    names = ("distributed", "distributed.nanny")
    with caplog.at_level(logging.ERROR, logger="distributed.nanny"):
        levels = {name: logging.getLogger(name).level for name in names}
        with contextlib.suppress(*([raised] if raised else [])), lab.sweep._client(None, 1):
            if raised:
                raise raised()
        # Afterwards (the CLI's one line, the next sweep in a notebook) logs flow again.
        assert {name: logging.getLogger(name).level for name in names} == levels
        assert nanny.isEnabledFor(logging.ERROR)
    logged = [r for r in caplog.records if "CancelledError" in r.getMessage()]
    assert _FakeCluster.seen == [not quiet, not quiet]  # Client's exit, then the cluster's
    assert len(logged) == (0 if quiet else 2)


def test_a_large_grid_expands_with_one_clash_scan_per_key(tmp_path, monkeypatch):
    # run_id_for scanned all of a key's values for letter-case clashes at every grid
    # point: quadratic, so `lab runs` of a 1000-seed grid did not finish in 200 s.
    import lab.sweep

    scans = []
    real = lab.sweep._clashing
    monkeypatch.setattr(lab.sweep, "_clashing", lambda values: scans.append(len(values))
                        or real(values))
    grid = {"fail_on": list(range(1500)), "x": [1, 2, 3, 4]}
    protocol = load_protocol(write_protocol(tmp_path / "p.yaml", grid=grid))
    scans.clear()  # (loading checks the runs: it expands the grid too)
    specs = expand(protocol)
    assert len(specs) == 6000 and sorted(scans) == [4, 1500]
    monkeypatch.setattr(lab.sweep, "_clashing", real)
    for spec in specs[:8] + specs[-8:]:  # the ids are run_id_for's
        assert spec.run_id == run_id_for(spec.grid, grid)
    assert len({s.run_id for s in specs}) == 6000
    # case clashes still get their hash when the scan is made once per key
    clash = {"k": ["b", "B", "c"]}
    assert [lab.sweep._run_id({"k": v}, {"k": real(clash["k"])}) for v in clash["k"]] == \
        [run_id_for({"k": v}, clash) for v in clash["k"]]
    assert re.fullmatch(r"k-b-[0-9a-f]{8}", run_id_for({"k": "b"}, clash))


def test_a_large_grid_refused_names_a_few_runs_and_counts_the_rest(tmp_path):
    path = write_protocol(tmp_path / "p.yaml", grid={"x": ["a"], "fail_on": list(range(500))})
    with pytest.raises(ProtocolError) as err:
        plan(load_protocol(path), 1)
    text = str(err.value)
    assert "500 of 500 runs have parameters the notebook refuses" in text
    assert "parameter x must be int, got 'a'" in text
    assert text.count("fail_on-") == 8 and "and 492 more" in text and len(text) < 1500


def test_list_and_dict_values_are_written_as_their_items_and_told_apart_from_strings():
    # As the README says: a list joins its items with "+", a dict "key=value" with ",";
    # the string with the same text gets the hash only when both are one key's values.
    assert run_id_for({"horizons": [1, 5]}) == "horizons-1+5"
    assert run_id_for({"rule_params": {"feedback_scale": 0.5}}) == \
        "rule_params-feedback_scale=0.5"
    grid = {"x": [[1, 5], "1+5"]}
    ids = [run_id_for({"x": value}, grid) for value in grid["x"]]
    assert all(re.fullmatch(r"x-1\+5-[0-9a-f]{8}", i) for i in ids) and ids[0] != ids[1]
    assert re.fullmatch(r"x-1\+a-b-[0-9a-f]{8}", run_id_for({"x": [1, "a b"]}))  # inexact


def test_an_override_keyed_true_is_not_the_value_1(tmp_path):
    # true == 1 in Python: an override for seed 1 came out of a table keyed true.
    protocol = Protocol(name="t", notebook="nb", out="o", grid={"x": [1, True]},
                        overrides={"x": {True: {"fail_on": 7}}})
    got = sorted((type(spec.grid["x"]).__name__, spec.params.get("fail_on"))
                 for spec in expand(protocol))
    assert got == [("bool", 7), ("int", None)]


def test_a_long_grids_duplicates_are_told_in_a_paragraph(tmp_path):
    # seed [0, 1, 1] x 1000 lr values: every one of the 1000 clashes was listed (80 KB).
    protocol = Protocol(name="t", notebook="nb", out="o",
                        grid={"seed": [0, 1, 1], "lr": [i / 1000 for i in range(1, 1001)]})
    with pytest.raises(ProtocolError) as err:
        expand(protocol)
    text = str(err.value)
    assert len(text) < 1000, len(text)
    assert "the grid gives 1000 duplicate run id(s) (seed: 1 and 1 give one id (seed-1)): " \
           'lr-0.001_seed-1 from {"lr": 0.001, "seed": 1} and {"lr": 0.001, "seed": 1}; ' in text
    assert text.endswith("; and 997 more; make the grid values distinct")


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_an_empty_protocol_says_so(tmp_path, text):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ProtocolError, match=re.escape(
            f"protocol {path} is empty; a protocol is a YAML mapping with at least name, "
            "notebook, out, grid (see protocols/demo.yaml)")):
        load_protocol(path)


def test_a_lost_scheduler_is_told_as_such(tmp_path):
    # Scheduler killed mid-sweep: queued runs were called "failed" (and counted executed)
    # though nothing was made, and runs still training on their workers a bare "locked".
    import subprocess
    import sys
    import textwrap

    from lab.sweep import RunSpec, SweepReport, _record_lost_worker

    error = ("FutureCancelledError: run-1 cancelled for reason: scheduler-connection-lost.\n"
             "Client lost the connection to the scheduler.")
    queued = _record_lost_worker(tmp_path, RunSpec("queued", {}, {}), error)
    assert (queued.status, queued.skipped) == ("failed", True)
    assert queued.error.startswith("the Dask scheduler was lost before this run started "
                                   "(FutureCancelledError: ") and queued.error.endswith(
        "nothing was made: run the sweep again")
    assert not (tmp_path / "queued").exists()
    # a run its worker still trains: the worker holds the lock
    busy = tmp_path / "busy"
    record = records.new_record(run_id="busy", kind="notebook", config={})
    records.save_run(busy, record)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from lab import runlock
        lock = runlock.acquire({str(busy)!r})
        print("held", flush=True)
        time.sleep(60)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        training = _record_lost_worker(tmp_path, RunSpec("busy", {}, {}), error)
    finally:
        holder.kill()
        holder.wait()
    assert (training.status, training.skipped) == ("locked", True)
    assert training.error.startswith("the Dask scheduler was lost while this run trained; "
                                     "its worker still holds it (")
    assert records.load_record(busy)["status"] == "running"  # untouched
    report = SweepReport("p", str(tmp_path), [queued, training])
    assert "0 executed" in report.summary()
    # a task's own failure, scheduler alive: as before
    broken = _record_lost_worker(tmp_path, RunSpec("x", {}, {}), "KilledWorker: boom")
    assert (broken.status, broken.skipped, broken.error) == ("failed", False, "KilledWorker: boom")


def test_a_dict_parameters_keys_may_be_any_text_in_a_grid_key(tmp_path):
    # Keys inside a dict parameter need not be identifiers (weights.0, weights.a-b): fixed
    # and -p set them, and the grid must too; only what is unsafe in a directory name is
    # refused.
    protocol = Protocol(name="t", notebook="nb", out="o",
                        grid={"opts.0": [1, 2], "opts.a-b": [3], "ηlr": [0.1]})
    assert sorted(spec.run_id for spec in expand(protocol)) == [
        "opts.0-1_opts.a-b-3_ηlr-0.1", "opts.0-2_opts.a-b-3_ηlr-0.1"]
    for key in ("opts..x", ".x", "x.", "a/b", "a\\b", "a\0b"):
        with pytest.raises(ProtocolError, match="are not parameter names"):
            Protocol(name="t", notebook="nb", out="o", grid={key: [1]})
