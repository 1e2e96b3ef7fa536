"""The benchmark scripts' options: every bad choice is one argparse error before any
timing, and what --help promises is what the parsed options say (no timing runs here)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_cli_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rules():
    return _load("bench_rules")


@pytest.fixture(scope="module")
def traffic():
    return _load("bench_traffic")


def _error(module, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        module.parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rules", "fa,lhfa"], r"--rules: must include bp, the baseline .*got 'fa,lhfa'"),
    (["--rules", "bp,kp_trafic"], r"--rules: unknown rule\(s\) 'kp_trafic'; known rules: .*"
                                  r"kp_traffic"),
    (["--rules", "bp,fa,fa"], r"--rules: a rule is named twice in 'bp,fa,fa'"),
    (["--every", "0"], r"argument --every: must be an integer >= 1, got 0"),
    (["--rounds", "0"], r"argument --rounds: must be an integer >= 1, got 0"),
    (["--batch", "-3"], r"argument --batch: must be an integer >= 1, got -3"),
    (["--every", "2.5"], r"argument --every: must be an integer >= 1, got '2.5'"),
])
def test_bench_rules_refuses_bad_options_up_front(rules, capsys, argv, message):
    err = _error(rules, argv, capsys)
    assert "Traceback" not in err
    assert re.search(message, err.splitlines()[-1]), err


def test_bench_rules_names_the_learned_rules_it_will_split(rules):
    args = rules.parse_args(["--rules", "bp, fa,sdil", "--every", "4", "--batch", "16"])
    assert args.rules == ["bp", "fa", "sdil"] and args.learned == ("sdil",)
    assert (args.every, args.batch, args.rounds) == (4, 16, 15)
    assert rules.parse_args(["--rules", "bp,kp"]).learned == ()
    default = rules.parse_args([])
    assert "bp" in default.rules and default.learned == ("lhfa", "sdil")


def test_bench_rules_help_says_what_each_option_and_the_second_table_need(rules, capsys):
    with pytest.raises(SystemExit):
        rules.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--rounds ROUNDS timed", "--rules RULES comma-separated",
                   "--batch BATCH batch", "--every EVERY lhfa/sdil"):
        assert option in text, text
    assert "must include bp" in text
    assert f"own batch of {rules.LEARNED_BATCH}" in text and "not --batch" in text
    assert "when --rules names lhfa and/or sdil" in text


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], r"argument --batch: must be at least 1, got 0"),
    (["--quick", "--batch", "-1"], r"argument --batch: must be at least 1, got -1"),
    (["--repeats", "0"], r"--repeats and --runs must be at least 1, got 0 and 1"),
])
def test_bench_traffic_refuses_bad_options_up_front(traffic, capsys, argv, message):
    err = _error(traffic, argv, capsys)
    assert re.search(message, err.splitlines()[-1]), err


@pytest.mark.parametrize("argv, depth, batch", [
    ([], 20, 128), (["--batch", "64"], 20, 64), (["--quick"], 8, 32),
    (["--quick", "--batch", "8"], 8, 8),  # --batch is honoured with --quick
])
def test_bench_traffic_quick_honours_batch(traffic, argv, depth, batch):
    args = traffic.parse_args(argv)
    assert (args.depth, args.batch) == (depth, batch)


def test_fig_wd_kp_refuses_a_missing_directory_and_unfinished_runs(tmp_path, capsys):
    from lab import records

    fig = _load("fig_wd_kp")
    with pytest.raises(SystemExit) as exit_:
        fig.cli([str(tmp_path / "nope"), str(tmp_path / "f.png")])
    assert exit_.value.code == 2 and "no such directory of runs" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"no runs under"):
        fig.cli([str(tmp_path), str(tmp_path / "f.png")])
    for run_id, status in (("a", "complete"), ("b", "running")):
        record = records.new_record(run_id=run_id, kind="conv", config={"rule": "kp"})
        record["status"] = status
        records.save_run(tmp_path / run_id, record)
    with pytest.raises(SystemExit, match=r"1 run\(s\) under .* are not complete: b \(running\)"):
        fig.cli([str(tmp_path), str(tmp_path / "f.png")])
    assert not (tmp_path / "f.png").exists()
