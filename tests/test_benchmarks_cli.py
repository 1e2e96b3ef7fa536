"""The benchmark scripts' options: every bad choice is one argparse error before any
timing, and what --help promises is what the parsed options say (no timing runs here)."""

from __future__ import annotations

import importlib.util
import json
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


@pytest.fixture(scope="module")
def kernels():
    return _load("bench_kernels")


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], r"argument --rounds: must be an integer >= 1, got 0"),
    (["--quick", "--rounds", "-3"], r"argument --rounds: must be an integer >= 1, got -3"),
    (["--threads", "0"], r"argument --threads: must be an integer >= 1, got 0"),
    (["--threads", "two"], r"argument --threads: must be an integer >= 1, got 'two'"),
    (["--threads", "9999"], r"argument --threads: at most NUMBA_NUM_THREADS = \d+ .*got 9999"),
])
def test_bench_kernels_refuses_bad_options_up_front(kernels, capsys, argv, message):
    err = _error(kernels, argv, capsys)
    assert "Traceback" not in err
    assert re.search(message, err.splitlines()[-1]), err


def test_bench_kernels_refuses_cuda_without_a_gpu(kernels, capsys, monkeypatch):
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: False)
    err = _error(kernels, ["--device", "cuda"], capsys)
    assert re.search(r"--device cuda: this torch sees no CUDA GPU.*gpu_check.sh", err), err


@pytest.mark.parametrize("argv, rounds", [([], 30), (["--quick"], 5),
                                          (["--quick", "--rounds", "7"], 7),
                                          (["--rounds", "2"], 2)])
def test_bench_kernels_quick_honours_rounds(kernels, argv, rounds):
    assert kernels.parse_args(argv).rounds == rounds


def test_bench_kernels_warns_on_a_busy_machine(kernels, monkeypatch):
    monkeypatch.setattr(kernels.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kernels.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    assert re.search(r"busy \(load average 5.0 on 2 cores\)", kernels.machine_load())
    monkeypatch.setattr(kernels.os, "getloadavg", lambda: (0.3, 2.0, 2.0))
    assert kernels.machine_load() is None


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


def _wd_runs(root, seeds=(0, 1)):
    """Synthetic wd-kp runs: kp and bp x two decays, known accuracy and cos(B, W)."""
    from lab import records

    acc, cos = {}, {}
    for rule in ("kp", "bp"):
        for decay in (0.001, 0.01):
            for seed in seeds:
                run_id = f"rule-{rule}_seed-{seed}_weight_decay-{decay}"
                acc[run_id] = 0.9 + 0.01 * seed + (0.05 if rule == "bp" else 0) + decay
                # A last-epoch mean and min cos(B, W), and an earlier row that must not count.
                cos[run_id] = (0.5 + 40 * decay + 0.01 * seed, 0.2 + 50 * decay + 0.02 * seed)
                config = {"rule": rule, "weight_decay": decay, "seed": seed, "dataset": "mnist1d",
                          "depth": 20, "width": 16, "epochs": 2, "optimizer": "sgd",
                          "schedule": "onecycle"}
                record = records.new_record(run_id=run_id, kind="conv", config=config)
                feedback = [{"mean_cos": 0.1, "min_cos": 0.05},
                            {"mean_cos": cos[run_id][0], "min_cos": cos[run_id][1]}]
                record["trajectory"] = [
                    {"epoch": e, "train_loss": 1.0,
                     "rule": {"feedback": fb} if rule == "kp" else {}}
                    for e, fb in enumerate(feedback)]
                record["final"] = {"test_acc": acc[run_id]}
                record["status"] = "complete"
                records.save_run(root / run_id, record)
    return acc, cos


def test_fig_wd_kp_prints_the_readme_table_from_the_records(tmp_path, capsys):
    import statistics

    fig = _load("fig_wd_kp")
    acc, cos = _wd_runs(tmp_path)
    fig.cli([str(tmp_path)])  # no figure path: the table only
    out = capsys.readouterr().out
    assert out.startswith("mnist1d, ResNet-20 width 16, 2 epochs, sgd onecycle; 2 seed(s) "
                          "per point\n\n| weight decay | kp test acc (%) | kp cos(B, W) at the "
                          "end, mean over layers (min) | bp test acc (%) |\n| --- |")
    rows = [line for line in out.splitlines() if line.startswith("| 1e-")]
    assert [row.split(" | ")[0] for row in rows] == ["| 1e-3", "| 1e-2"]
    for row, decay in zip(rows, (0.001, 0.01)):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        for cell, rule in ((cells[1], "kp"), (cells[3], "bp")):
            values = [100 * acc[f"rule-{rule}_seed-{s}_weight_decay-{decay}"] for s in (0, 1)]
            mean, std = (float(part) for part in cell.split(" ± "))
            assert mean == pytest.approx(statistics.mean(values), abs=0.005)
            assert std == pytest.approx(statistics.stdev(values), abs=0.005)
            assert std > 0.5  # seeds differ by a point: a real spread, not 0
        mean_cos, low = cells[2].split(" (")
        kp = [cos[f"rule-kp_seed-{s}_weight_decay-{decay}"] for s in (0, 1)]
        assert float(mean_cos) == pytest.approx(statistics.mean(c for c, _ in kp), abs=5e-4)
        assert float(low.rstrip(")")) == pytest.approx(min(m for _, m in kp), abs=5e-3)
    assert [row.split(" | ")[2] for row in rows] == ["0.545 (0.25)", "0.905 (0.70)"]
    # With a path the same table is printed and the figure is written.
    fig.cli([str(tmp_path), str(tmp_path / "f.png")])
    assert rows[0] in capsys.readouterr().out and (tmp_path / "f.png").stat().st_size > 0


def test_fig_wd_kp_table_shows_one_seed_without_a_spread_and_a_missing_rule(tmp_path, capsys):
    from lab import records

    fig = _load("fig_wd_kp")
    acc, _ = _wd_runs(tmp_path, seeds=(0,))
    for run_id in [r for r in acc if r.startswith("rule-bp") and r.endswith("0.01")]:
        (tmp_path / run_id / records.RECORD_FILE).unlink()
    fig.cli([str(tmp_path)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1e-")]
    assert rows == ["| 1e-3 | 90.10 | 0.540 (0.25) | 95.10 |",
                    "| 1e-2 | 91.00 | 0.900 (0.70) | — |"]


def test_mutation_score_reads_the_stats_and_answers_help(tmp_path, capsys):
    # `--help` printed "mutants/mutmut-cicd-stats.json not found" and exited 1.
    score = _load("mutation_score")
    with pytest.raises(SystemExit) as done:
        score.main(["--help"])
    assert done.value.code == 0 and "mutation score" in capsys.readouterr().out
    stats = tmp_path / "s.json"
    stats.write_text(json.dumps({"total": 12, "killed": 8, "survived": 1, "timeout": 1,
                                 "suspicious": 0, "no_tests": 2, "skipped": 0}))
    assert score.main(["--stats", str(stats)]) == 0
    assert "mutation score: 80.0% (target >= 85%)" in capsys.readouterr().out  # 8 / 10
    assert score.main(["--stats", str(tmp_path / "none.json")]) == 1
