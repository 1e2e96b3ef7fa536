"""analysis.select: the choice is the best mean over seeds, made once per `per` value;
a diverged run loses; ties keep grid order; the fragment is what a protocol includes."""

from __future__ import annotations

import itertools
import math

import pandas as pd
import pytest
import yaml

from analysis.select import SelectionError, SelectSpec, choose, fragment, read_spec

GRID = {"rule": ["bp", "fa"], "lr": [0.01, 0.1, 1.0], "seed": [0, 1]}


def _table(score, status=lambda rule, lr, seed: "complete"):
    rows = [{"run_id": f"{r}-{lr}-{s}", "rule": r, "lr": lr, "seed": s,
             "status": status(r, lr, s), "final.val_acc": score(r, lr, s)}
            for r, lr, s in itertools.product(*GRID.values())]
    return pd.DataFrame(rows)


def _spec(per="rule", goal="max"):
    return SelectSpec(choose=("lr",), metric="val_acc", goal=goal, into=None, per=per)


def test_the_best_mean_over_seeds_per_rule_is_chosen():
    # bp is best at 0.1 on the mean, though seed 1 alone would pick 1.0; fa at 0.01
    values = {("bp", 0.01): (0.5, 0.5), ("bp", 0.1): (0.9, 0.7), ("bp", 1.0): (0.6, 0.85),
              ("fa", 0.01): (0.8, 0.8), ("fa", 0.1): (0.7, 0.75), ("fa", 1.0): (0.2, 0.1)}
    result = choose(_table(lambda r, lr, s: values[r, lr][s]), _spec(), GRID)
    assert len(result) == 6 and (result["n"] == 2).all()
    for _, row in result.iterrows():
        a, b = values[row["rule"], row["lr"]]
        assert row["mean"] == pytest.approx((a + b) / 2)
        assert row["std"] == pytest.approx(abs(a - b) / math.sqrt(2))
    chosen = result[result["chosen"]].set_index("rule")["lr"].to_dict()
    assert chosen == {"bp": 0.1, "fa": 0.01}
    assert fragment(result, _spec()) == {"overrides": {"rule": {"bp": {"lr": 0.1},
                                                                "fa": {"lr": 0.01}}}}
    # min picks the other end
    low = choose(_table(lambda r, lr, s: values[r, lr][s]), _spec(goal="min"), GRID)
    assert low[low["chosen"]].set_index("rule")["lr"].to_dict() == {"bp": 0.01, "fa": 1.0}


def test_a_diverged_seed_loses_and_ties_keep_grid_order():
    table = _table(lambda r, lr, s: 0.9 if lr == 1.0 else 0.5,
                   status=lambda r, lr, s: "diverged" if (r, lr, s) == ("bp", 1.0, 1) else
                   "complete")
    result = choose(table, _spec(), GRID)
    chosen = result[result["chosen"]].set_index("rule")["lr"].to_dict()
    assert chosen == {"bp": 0.01, "fa": 1.0}  # bp: 0.01 and 0.1 tie, the first listed wins
    assert result.set_index(["rule", "lr"]).loc[("bp", 1.0), "diverged"] == 1
    assert result.groupby("rule")["chosen"].sum().tolist() == [1, 1]


def test_without_per_one_value_goes_to_fixed():
    result = choose(_table(lambda r, lr, s: -abs(math.log10(lr) + 1)), _spec(per=None), GRID)
    assert result["n"].tolist() == [4, 4, 4]
    assert fragment(result, _spec(per=None)) == {"fixed": {"lr": 0.1}}


def test_select_sections_are_checked(tmp_path):
    protocol = tmp_path / "p.yaml"
    spec = read_spec({"choose": "lr", "per": "rule", "metric": "val_acc", "into": "s/x.yaml"},
                     GRID, protocol)
    assert spec.choose == ("lr",) and spec.into == tmp_path / "s" / "x.yaml"
    bad = [({"choose": ["lrr"], "metric": "val_acc", "into": "x"}, "'lrr' is not a grid key"),
           ({"choose": ["lr"], "metric": "val_acc", "into": "x", "goal": "best"}, "allowed: max"),
           ({"choose": ["lr"], "metric": "val_acc"}, "missing key(s) into"),
           ({"choose": ["lr"], "metric": "val_acc", "into": "x", "by": "rule"}, "unknown key"),
           ({"choose": ["lr"], "per": "lr", "metric": "val_acc", "into": "x"}, "not chosen")]
    for section, words in bad:
        with pytest.raises(SelectionError, match=words.replace("(", r"\(").replace(")", r"\)")):
            read_spec(section, GRID, protocol)


def test_an_unrecorded_metric_is_named():
    with pytest.raises(SelectionError, match="val_acc.*final metrics are val_acc"):
        choose(_table(lambda *a: 0.5), SelectSpec(("lr",), "val_accuracy", "max", None, "rule"),
               GRID)


def test_the_fragment_reads_back_as_yaml():
    result = choose(_table(lambda r, lr, s: lr), _spec(), GRID)
    text = yaml.safe_dump(fragment(result, _spec()))
    assert yaml.safe_load(text) == {"overrides": {"rule": {"bp": {"lr": 1.0},
                                                           "fa": {"lr": 1.0}}}}
