"""analysis.select: the choice is the best mean over seeds, made once per `per` value;
a diverged run loses; ties keep grid order; the fragment is what a protocol includes."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

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


def _train_protocol(path):
    """Train every run of a protocol in-process, as its notebook would (no kernels)."""
    from lab.config import field_names, from_dict
    from lab.notebook import notebook_defaults
    from lab.sweep import expand, load_protocol
    from lab.train import ConvConfig, train_conv

    protocol = load_protocol(path)
    defaults = notebook_defaults(protocol.notebook)
    for spec in expand(protocol):
        params = {**defaults, **spec.params}
        config = from_dict(ConvConfig, {k: params[k] for k in field_names(ConvConfig)})
        train_conv(config, Path(protocol.out) / spec.run_id, run_id=spec.run_id)
    return protocol


def test_select_then_include_end_to_end(tmp_path):
    """A selection protocol's runs are scored on validation, the fragment it writes is what a
    final protocol trains with, and editing it by hand is refused where it clashes."""
    from analysis.select import select
    from lab.records import load_record
    from lab.sweep import expand, load_protocol

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "01-train-conv.ipynb"
    (tmp_path / "select.yaml").write_text(f"""
name: sel
notebook: {notebook}
out: runs-select
fixed: {{n_train: 256, depth: 8, width: 4, epochs: 2, batch_size: 64, val_fraction: 0.25,
        eval_every: 1, schedule: constant, progress: false}}
grid:
  rule: [bp, dfa]
  lr: [0.001, 0.3]
  seed: [0, 1]
select: {{choose: lr, per: rule, metric: val_acc, goal: max, into: chosen/lr.yaml}}
""")
    _train_protocol(tmp_path / "select.yaml")
    selection = select(tmp_path / "select.yaml")
    # the oracle: each rule's best mean validation accuracy, read from the records directly
    protocol = load_protocol(tmp_path / "select.yaml", configs=False)
    scores = {}
    for spec in expand(protocol):
        record = load_record(Path(protocol.out) / spec.run_id)
        key = (spec.grid["rule"], spec.grid["lr"])
        scores.setdefault(key, []).append(record["final"]["val_acc"])
    rates = [0.001, 0.3]  # a tie keeps the first listed
    expected = {rule: max(rates, key=lambda lr: (sum(scores[rule, lr]) / 2, -rates.index(lr)))
                for rule in ("bp", "dfa")}
    chosen = selection.chosen.set_index("rule")["lr"].to_dict()
    assert chosen == expected
    path = selection.write()
    assert path == tmp_path / "chosen" / "lr.yaml"
    # the evidence rides along as comments: every candidate's mean, the chosen ones marked
    comments = [line.split() for line in path.read_text().splitlines()
                if line.startswith("#   ") and line.split()[1] in ("bp", "dfa")]
    assert {(w[1], float(w[2])): (float(w[3]), w[-1] == "<-") for w in comments} == {
        (rule, lr): (round(sum(scores[rule, lr]) / 2, 4), chosen[rule] == lr)
        for rule, lr in scores}
    assert yaml.safe_load(path.read_text()) == {"overrides": {"rule": {
        rule: {"lr": lr} for rule, lr in chosen.items()}}}

    (tmp_path / "final.yaml").write_text(f"""
name: final
notebook: {notebook}
out: runs-final
include: chosen/lr.yaml
fixed: {{n_train: 256, depth: 8, width: 4, epochs: 2, batch_size: 64, val_fraction: 0.0,
        eval_every: 0, schedule: constant, progress: false}}
grid:
  rule: [bp, dfa]
  seed: [0]
""")
    final = load_protocol(tmp_path / "final.yaml")
    assert {s.grid["rule"]: s.params["lr"] for s in expand(final)} == chosen
    text = (tmp_path / "final.yaml").read_text()
    (tmp_path / "final.yaml").write_text(text + "overrides: {rule: {bp: {lr: 0.1}}}\n")
    with pytest.raises(ValueError, match=r"overrides.rule.bp.lr is set both in .*final.yaml"):
        load_protocol(tmp_path / "final.yaml", configs=False)


def test_a_run_that_diverged_before_its_last_epoch_loses_instead_of_stopping_selection(
        tmp_path):
    # (lhfa at lr 0.3 diverged at epoch 5 of 12, and lab select refused: "epochs 5-11
    # missing", as if the run were unfinished.)
    from analysis.select import select
    from lab.records import load_record

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "01-train-conv.ipynb"
    (tmp_path / "s.yaml").write_text(f"""
name: s
notebook: {notebook}
out: runs
fixed: {{n_train: 256, depth: 8, width: 4, epochs: 3, batch_size: 64, val_fraction: 0.25,
        eval_every: 1, schedule: constant, progress: false}}
grid: {{lr: [0.01, 10000.0], seed: [0]}}
select: {{choose: [lr], metric: val_acc, into: x.yaml}}
""")
    _train_protocol(tmp_path / "s.yaml")
    blown = load_record(tmp_path / "runs" / "lr-10000.0_seed-0")
    assert blown["status"] == "diverged" and len(blown["trajectory"]) < 3
    selection = select(tmp_path / "s.yaml")
    assert selection.chosen["lr"].tolist() == [0.01]
    assert selection.result.set_index("lr").loc[10000.0, "diverged"] == 1


def test_selection_refuses_missing_runs(tmp_path):
    from analysis.completeness import IncompleteProtocolError
    from analysis.select import select

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "01-train-conv.ipynb"
    (tmp_path / "s.yaml").write_text(f"""
name: s
notebook: {notebook}
out: runs
fixed: {{n_train: 256, eval_every: 1, val_fraction: 0.25}}
grid: {{lr: [0.01, 0.1], seed: [0]}}
select: {{choose: [lr], metric: val_acc, into: x.yaml}}
""")
    with pytest.raises(IncompleteProtocolError,
                       match=r"(?s)every run of s finished.*2 of 2 runs missing"):
        select(tmp_path / "s.yaml")


def test_lab_select_refuses_a_protocol_without_select_before_any_run(tmp_path, capsys):
    from lab.cli import main

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "01-train-conv.ipynb"
    (tmp_path / "p.yaml").write_text(f"name: p\nnotebook: {notebook}\nout: runs\n"
                                     "grid: {seed: [0]}\n")
    assert main(["select", str(tmp_path / "p.yaml")]) != 0
    assert "has no select section" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_missing_fragment_names_the_selection_protocol_that_writes_it(tmp_path):
    from lab.sweep import ProtocolError, load_protocol

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "01-train-conv.ipynb"
    (tmp_path / "s.yaml").write_text(f"name: s\nnotebook: {notebook}\nout: r\n"
                                     "grid: {lr: [0.1], seed: [0]}\n"
                                     "select: {choose: lr, metric: val_acc, into: out/lr.yaml}\n")
    (tmp_path / "f.yaml").write_text(f"name: f\nnotebook: {notebook}\nout: r2\n"
                                     "include: out/lr.yaml\ngrid: {seed: [0]}\n")
    with pytest.raises(ProtocolError, match=r"does not exist; `lab select .*s\.yaml` writes it"):
        load_protocol(tmp_path / "f.yaml", configs=False)


def test_a_tie_in_the_last_float_digit_is_a_tie():
    # kp on the rule table: 0.98 and 0.985 at lr 0.03, 0.9875 and 0.9775 at 0.3. Both
    # means are 0.9825 over 400 validation examples, but the floats differ in the 16th
    # digit (0.9824999999999999 vs 0.9825), and 0.3 was chosen instead of the first listed.
    grid = {"rule": ["kp"], "lr": [0.03, 0.3], "seed": [0, 1]}
    values = {(0.03, 0): 0.98, (0.03, 1): 0.985, (0.3, 0): 0.9875, (0.3, 1): 0.9775}
    table = pd.DataFrame([{"run_id": f"{lr}-{s}", "rule": "kp", "lr": lr, "seed": s,
                           "status": "complete", "final.val_acc": v}
                          for (lr, s), v in values.items()])
    result = choose(table, _spec(), grid)
    assert result["mean"].iloc[0] != result["mean"].iloc[1]  # the floats do differ
    assert result[result["chosen"]]["lr"].tolist() == [0.03]
    # ... and a real difference still wins wherever it is listed
    values[(0.3, 0)] = 0.99
    table["final.val_acc"] = list(values.values())
    assert choose(table, _spec(), grid).query("chosen")["lr"].tolist() == [0.3]
