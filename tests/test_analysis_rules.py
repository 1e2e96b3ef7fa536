"""The rule-comparison analysis over real (tiny) run records."""

from __future__ import annotations

import pytest

from analysis import rules as compare
from lab import records
from lab.train import ConvConfig, train_conv


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    base = dict(dataset="mnist1d", n_train=128, depth=8, width=4, epochs=2, batch_size=64,
                progress=False, alignment_every=1, alignment_batch=16)
    for rule in ("bp", "kp", "dfa"):
        for seed in (0, 1):
            train_conv(ConvConfig(**base, rule=rule, seed=seed), root / f"{rule}-{seed}")
    table = records.load_runs(root).rename(columns={"config.rule": "rule"})
    return root, table, records.load_metrics(root)


def test_accuracy_bars_one_bar_per_rule(runs):
    _, table, _ = runs
    fig = compare.accuracy_bars(table)
    assert len(fig.axes[0].patches) == 3


def test_alignment_per_layer_over_epochs(runs):
    _, table, metrics = runs
    frame = compare.per_name_over_epochs(metrics, table, "alignment/update_cos/")
    assert set(frame["rule"]) == {"bp", "kp", "dfa"}
    assert set(frame["epoch"]) == {0, 1}
    # backprop's update is its own reference: cosine 1 in every layer and epoch.
    assert frame[frame["rule"] == "bp"]["value"].min() > 1 - 1e-6
    assert len(compare.lines_per_rule(frame, "cos").axes) >= 3


def test_feedback_cosine_only_for_rules_with_feedback(runs):
    _, table, metrics = runs
    frame = compare.per_name_over_epochs(metrics, table, "feedback/cos/")
    assert set(frame["rule"]) == {"kp"}
    assert compare.mean_lines(frame, "cos(B, W)").axes[0].lines


def test_compute_bill_per_rule(runs):
    root, table, _ = runs
    bill = compare.compute_bill(table, root)
    assert set(bill.index) == {"bp", "kp", "dfa"}
    forward = bill.loc["bp", "forward"]
    assert bill.loc["bp", "bp_reverse"] == 2 * forward
    assert bill.loc["kp", "feedback_update"] == forward
    assert (bill["total"] == bill.drop(columns="total").sum(axis=1)).all()
    assert len(compare.bill_bars(bill).axes[0].patches) == bill.shape[0] * (bill.shape[1] - 1)
