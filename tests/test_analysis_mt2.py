"""analysis.mt2 on a hand-made protocol: gaps pair each run with its own clean run, and a
dose axis is never averaged away (the oracle: the means written out by hand)."""

import io
from types import SimpleNamespace

import pandas as pd
import pytest

from analysis import mt2

NOISE = "rule_params.noise"


def _data(rows):
    table = pd.DataFrame(rows)
    metrics = pd.DataFrame([
        {"run_id": r["run_id"], "axis": "final", "index": 0, "metric": name, "value": value}
        for r in rows for name, value in (("test_acc", r["acc"]),
                                          (mt2.RESIDUAL, r["res"]), (mt2.ALIGN, 0.5))])
    grid = {NOISE: [0.5, 2.0], mt2.RULE: ["none", "innovation"], "seed": [0, 1]}
    return SimpleNamespace(
        table=lambda: table.drop(columns=["acc", "res"]), metrics=metrics,
        group_keys=sorted([NOISE, mt2.RULE]),
        protocol=SimpleNamespace(grid=grid, fixed={mt2.MODEL: "noisy"}))


def test_gaps_pair_runs_with_their_own_clean_run_and_doses_stay_apart():
    acc = {(0.5, "none", 0): 0.90, (0.5, "none", 1): 0.80,
           (0.5, "innovation", 0): 0.85, (0.5, "innovation", 1): 0.70,
           (2.0, "none", 0): 0.60, (2.0, "none", 1): 0.50,
           (2.0, "innovation", 0): 0.40, (2.0, "innovation", 1): 0.45}
    rows = [{"run_id": f"n{n}-{rule}-{seed}", NOISE: n, mt2.RULE: rule, "seed": seed,
             "status": "complete", "acc": a, "res": n / 10}
            for (n, rule, seed), a in acc.items()]
    frame = mt2.run_frame(_data(rows))
    assert frame.loc["n0.5-innovation-1", "gap"] == pytest.approx(0.80 - 0.70)
    assert frame.loc["n2.0-innovation-0", "gap"] == pytest.approx(0.60 - 0.40)
    assert frame["gap"].isna().sum() == 4  # the clean runs have none

    table = mt2.summary(_data(rows))
    assert list(table.index.names) == ["traffic_model", "predictor", "noise", "traffic_rule"]
    low = table.loc[("noisy", "unit_affine", 0.5, "innovation")]
    high = table.loc[("noisy", "unit_affine", 2.0, "innovation")]
    assert low["test_acc"] == pytest.approx((0.85 + 0.70) / 2)
    assert low["gap"] == pytest.approx((0.05 + 0.10) / 2)
    assert high["gap"] == pytest.approx((0.20 + 0.05) / 2)
    assert high["residual"] == pytest.approx(0.2) and high["seeds"] == 2


def test_the_alignment_figure_says_so_when_no_run_recorded_alignment():
    rows = [{"run_id": f"{rule}-{seed}", NOISE: 0.5, mt2.RULE: rule, "seed": seed,
             "status": "complete", "acc": 0.5, "res": 0.1}
            for rule in ("none", "innovation") for seed in (0, 1)]
    data = _data(rows)
    data.metrics = data.metrics[data.metrics["metric"] != mt2.ALIGN]
    fig = mt2.alignment_figure(data)
    assert "no run" in fig.axes[0].texts[0].get_text()
    fig.savefig(io.BytesIO())  # draws (a log scale over no points raised here)


def test_the_gap_figure_says_so_when_every_run_with_traffic_diverged():
    rows = [{"run_id": f"{rule}-{seed}", NOISE: 0.5, mt2.RULE: rule, "seed": seed,
             "status": "complete" if rule == "none" else "diverged",
             "acc": 0.9 if rule == "none" else float("nan"), "res": 0.1}
            for rule in ("none", "innovation") for seed in (0, 1)]
    fig = mt2.gap_figure(_data(rows))
    assert "no run with traffic finished" in fig.axes[0].texts[0].get_text()
    fig.savefig(io.BytesIO())
