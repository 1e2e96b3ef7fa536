"""The rule-comparison analysis over real (tiny) run records, checked against the records."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import pytest

from analysis import IncompleteProtocolError
from analysis import rules as compare
from lab import records
from lab.models import ResNet
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


def test_accuracy_bars_show_each_rules_mean_spread_and_seeds(runs):
    _, table, _ = runs
    fig = compare.accuracy_bars(table)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert sorted(labels) == ["bp", "dfa", "kp"]
    for bar, rule in zip(ax.patches, labels):
        accs = table.loc[table["rule"] == rule, "final.test_acc"]
        assert bar.get_height() == pytest.approx(100 * accs.mean(), abs=1e-9)
    # From 0: a bar's length is its accuracy (a cut axis exaggerated the gaps).
    assert ax.get_ylim() == (0.0, 100.0)
    # The bars are sorted by mean accuracy, best first.
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == sorted(heights, reverse=True)
    dots = [line for line in ax.lines if line.get_marker() == "."]
    assert sorted(len(line.get_xdata()) for line in dots) == [2, 2, 2]
    for line in dots:
        rule = labels[int(line.get_xdata()[0])]
        accs = table.loc[table["rule"] == rule, "final.test_acc"]
        assert sorted(line.get_ydata()) == pytest.approx(sorted(100 * accs), abs=1e-9)


def test_accuracy_bars_error_bars_are_each_rules_std_and_absent_for_one_seed(runs):
    # A rule with one seed had a zero-width error bar drawn, as if its seeds agreed.
    _, table, _ = runs
    one = table[~((table["rule"] == "dfa") & (table["config.seed"] == 1))]
    ax = compare.accuracy_bars(one).axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    from matplotlib.container import ErrorbarContainer

    errorbar = next(c for c in ax.containers if isinstance(c, ErrorbarContainer))
    segments = errorbar.lines[2][0].get_segments()
    drawn = [seg for seg in segments if len(seg)]  # (NaN yerr: an empty segment, or none)
    expected = [100 * one.loc[one["rule"] == rule, "final.test_acc"].std() for rule in labels
                if rule != "dfa"]
    assert len(drawn) == 2 == len(expected)
    for seg, std in zip(drawn, expected):
        assert seg[1][1] - seg[0][1] == pytest.approx(2 * std, rel=1e-9)  # mean -+ std
    xs = {int(round(seg[0][0])) for seg in drawn}
    assert labels.index("dfa") not in xs


def test_alignment_per_layer_over_epochs_is_the_seed_mean(runs):
    _, table, metrics = runs
    frame = compare.per_name_over_epochs(metrics, table, "alignment/update_cos/")
    assert set(frame["rule"]) == {"bp", "kp", "dfa"}
    assert set(frame["epoch"]) == {0, 1}
    # backprop's update is its own reference: cosine 1 in every layer and epoch.
    assert frame[frame["rule"] == "bp"]["value"].min() > 1 - 1e-6
    # Independent value: kp's fc cosine at epoch 1 = the mean of the two seeds' records.
    want = []
    for seed in (0, 1):
        rows = metrics[(metrics["run_id"] == f"kp-{seed}") & (metrics["index"] == 1)
                       & (metrics["metric"] == "alignment/update_cos/fc")]
        want.append(float(rows["value"].iloc[0]))
    got = frame[(frame["rule"] == "kp") & (frame["name"] == "fc") & (frame["epoch"] == 1)]
    assert float(got["value"].iloc[0]) == pytest.approx(sum(want) / 2, abs=1e-12)
    fig = compare.lines_per_rule(frame, "cos")
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["bp", "dfa", "kp"]


def test_accuracy_bars_label_the_metric_they_draw(runs):
    # Any metric was drawn x100 on a 0-100 axis labelled "test accuracy (%)": a loss read
    # as 100 % everywhere.
    _, table, _ = runs
    ax = compare.accuracy_bars(table, "final.train_loss").axes[0]
    assert ax.get_ylabel() == "train loss"
    labels = [t.get_text() for t in ax.get_xticklabels()]
    for bar, rule in zip(ax.patches, labels):
        assert bar.get_height() == pytest.approx(
            table.loc[table["rule"] == rule, "final.train_loss"].mean(), abs=1e-12)
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == sorted(heights)  # a loss: lowest (best) first
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > max(heights)
    val = compare.accuracy_bars(table, "final.val_acc").axes[0]
    assert val.get_ylabel() == "val acc (%)" and val.get_ylim() == (0.0, 100.0)
    assert "error bar: +-1 std over seeds" in val.get_title()


def test_lines_per_rule_shade_layers_by_depth(runs):
    # Names came alphabetically (blocks..., fc, stem): the first layer got the deepest red.
    _, table, metrics = runs
    frame = compare.per_name_over_epochs(metrics, table, "alignment/update_cos/")
    names = list(dict.fromkeys(frame.loc[frame["rule"] == "kp", "name"]))
    assert names[0] == "stem" and names[-1] == "fc"
    recorded = [m.removeprefix("alignment/update_cos/") for m in dict.fromkeys(
        metrics.loc[metrics["metric"].str.startswith("alignment/update_cos/"), "metric"])]
    assert names == recorded  # the records' (forward) order
    ax = compare.lines_per_rule(frame, "cos").axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["stem (first)", "fc (last)"]
    blue, red = ax.lines[0].get_color(), ax.lines[len(names) - 1].get_color()
    assert blue[2] > blue[0] and red[0] > red[2]


def test_feedback_cosine_only_for_rules_with_feedback(runs):
    _, table, metrics = runs
    frame = compare.per_name_over_epochs(metrics, table, "rule/feedback/cos/")
    assert set(frame["rule"]) == {"kp"}
    line = compare.mean_lines(frame, "cos(B, W)").axes[0].lines[0]
    mean = frame.groupby("epoch")["value"].mean()
    assert list(line.get_ydata()) == pytest.approx(list(mean.values), abs=1e-12)


def test_epoch_figures_tick_whole_epochs_and_wrap_long_labels(runs):
    # The teaching-cosine figure's y label was cut off and its ticks fell on 0.25 epochs.
    _, table, metrics = runs
    frame = compare.per_name_over_epochs(metrics, table, "alignment/teaching_cos/")
    label = "mean over populations of cos(teaching, BP gradient)"
    for fig in (compare.mean_lines(frame, label), compare.lines_per_rule(frame, label)):
        fig.canvas.draw()
        ax = fig.axes[0]
        ticks = ax.get_xticks()
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
        assert "\n" in ax.get_ylabel() and ax.get_ylabel().replace("\n", " ") == label
        box = ax.yaxis.label.get_window_extent()
        assert box.y0 >= 0 and box.y1 <= fig.bbox.height  # inside the figure


def test_compute_bill_per_rule(runs):
    root, table, _ = runs
    bill = compare.compute_bill(table, root)
    assert set(bill.index) == {"bp", "kp", "dfa"}
    # Independent count from the architecture: 1-D ResNet-8 of width 4 on (1, 40).
    layers = ResNet(8, 4, dims=1, in_channels=1).layer_macs((1, 40))
    forward, stem = sum(layers.values()), layers["stem"]
    assert bill.loc["bp", "forward"] == forward
    # The stem's input is the data: no input-gradient product is needed there.
    assert bill.loc["bp", "bp_reverse"] == 2 * forward - stem
    assert bill.loc["kp", "feedback_update"] == forward - stem
    assert (bill["total"] == bill.drop(columns="total").sum(axis=1)).all()
    assert len(compare.bill_bars(bill).axes[0].patches) == bill.shape[0] * (bill.shape[1] - 1)


def test_rules_table_refuses_incomplete_data(tmp_path):
    # A mean over the runs that happen to exist is not the protocol's result: the
    # README's table refuses a protocol with a run missing, naming it.
    import shutil
    from pathlib import Path

    from analysis import IncompleteProtocolError, load_protocol_runs

    fixture = Path(__file__).resolve().parent / "fixtures" / "rules"
    target = tmp_path / "rules"
    shutil.copytree(fixture, target)
    protocol = target / "protocol.yaml"
    protocol.write_text(protocol.read_text().replace(
        "../../../notebooks", str(Path(__file__).resolve().parents[1] / "notebooks")))
    complete = compare.rules_table(load_protocol_runs(protocol))
    assert len(complete) > 1
    victim = sorted(p for p in (target / "runs").iterdir() if p.is_dir())[0]
    shutil.rmtree(victim)
    with pytest.raises(IncompleteProtocolError, match=rf"runs missing: .*{victim.name}"):
        compare.rules_table(load_protocol_runs(protocol))


RULES_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "rules" / "protocol.yaml"
ALIGN_MESSAGE = "'alignment/mean_update_cos', 'alignment/mean_teaching_cos'"


def _rules_data():
    from analysis import load_protocol_runs

    return load_protocol_runs(RULES_FIXTURE)


def test_rules_table_is_each_runs_last_epoch_from_the_records():
    # The oracle: each record's own last trajectory row and final metrics.
    data = _rules_data()
    got = compare.rules_table(data)
    runs = RULES_FIXTURE.parent / "runs"
    for rule in ("bp", "kp", "dfa"):
        last = [records.load_record(runs / f"rule-{rule}_seed-{s}")["trajectory"][-1]
                for s in (0, 1)]
        assert [row["epoch"] for row in last] == [2, 2]
        for column, key in (("update_cos", "mean_update_cos"),
                            ("teaching_cos", "mean_teaching_cos")):
            want = (last[0]["alignment"][key] + last[1]["alignment"][key]) / 2
            assert got.loc[rule, column] == pytest.approx(want, abs=1e-12)
        # Without the read-out: each run's mean over its other layers, then over seeds.
        hidden = [statistics.mean(v for k, v in row["alignment"]["update_cos"].items()
                                  if k != "fc") for row in last]
        assert "fc" in last[0]["alignment"]["update_cos"] and len(hidden) == 2
        assert got.loc[rule, "update_cos_hidden"] == pytest.approx(statistics.mean(hidden),
                                                                   abs=1e-12)
    feedback = [records.load_record(runs / f"rule-kp_seed-{s}")["trajectory"][-1]
                ["rule"]["feedback"]["mean_cos"] for s in (0, 1)]
    assert got.loc["kp", "feedback_cos"] == pytest.approx(sum(feedback) / 2, abs=1e-12)
    assert math.isnan(got.loc["bp", "feedback_cos"])  # no feedback tensors
    # The fixture was recorded before the diagnostic measured norms: NaN, not a refusal.
    assert got["teaching_norm"].isna().all()


def test_runs_without_alignment_are_refused_naming_each(tmp_path):
    # alignment_every: 0 -- no alignment rows and none declared: the runs are complete as
    # runs, but not for a comparison whose table reports alignment.
    data = _rules_data()
    data.metrics = data.metrics[~data.metrics["metric"].str.startswith("alignment/")]
    data.runs = data.runs.assign(expect=[
        {**e, "periodic": [p for p in e["periodic"] if p[0] != "alignment/"]}
        for e in data.runs["expect"]])
    with pytest.raises(IncompleteProtocolError) as err:
        compare.check_rules_complete(data)
    assert err.value.problems == [f"{run_id}: {ALIGN_MESSAGE} missing at its last epoch (2)"
                                  for run_id in data.expected_ids]
    # The advice comes first, before the list of gaps (which can be long).
    first, *listed = str(err.value).splitlines()
    assert first == (
        "incomplete data: 6 problem(s) across 6 expected runs (only complete data is "
        "summarised). The rule comparison reports alignment with backprop at each run's last "
        "epoch: run the protocol with alignment_every dividing epochs (alignment_every: 1 "
        "measures every epoch).")
    assert listed == [f"  - {p}" for p in err.value.problems]
    with pytest.raises(IncompleteProtocolError, match="missing at its last epoch"):
        compare.rules_table(data)


def test_one_seeds_missing_last_epoch_alignment_is_not_filled_from_an_earlier_epoch():
    data = _rules_data()
    m = data.metrics
    gone = ((m["run_id"] == "rule-kp_seed-1") & (m["index"] == 2)
            & (m["metric"] == "alignment/mean_update_cos"))
    assert gone.sum() == 1
    data.metrics = m[~gone]
    with pytest.raises(IncompleteProtocolError) as err:
        compare.rules_table(data)
    assert err.value.problems == [
        "rule-kp_seed-1: 'alignment/mean_update_cos' missing at its last epoch (2)"]
    # Below the check, the per-rule mean refuses too: never epoch 1's value in its place.
    with pytest.raises(ValueError, match=r"^'alignment/mean_update_cos' is missing at the last "
                                         r"epoch of run\(s\) rule-kp_seed-1 \(epoch 2\); an "
                                         r"earlier epoch's value is not the last epoch's$"):
        compare._last_epoch_mean(data, data.table(), "alignment/mean_update_cos")
    # An infinite last value is a fault, named as such (NaN is a result: see below).
    m = data.metrics.copy()
    m.loc[(m["run_id"] == "rule-dfa_seed-0") & (m["index"] == 2)
          & (m["metric"] == "alignment/mean_teaching_cos"), "value"] = math.inf
    data.metrics = m
    with pytest.raises(IncompleteProtocolError) as err:
        compare.check_rules_complete(data)
    assert ("rule-dfa_seed-0: infinite at its last epoch (2): "
            "alignment/mean_teaching_cos (inf)") in err.value.problems


def _silence(data, run_id, prefix="alignment/", epochs=(0, 1, 2)):
    """``data`` with ``run_id``'s alignment metrics under ``prefix`` measured but NaN
    (undefined: what a network that fell silent records)."""
    m = data.metrics.copy()
    m.loc[(m["run_id"] == run_id) & m["index"].isin(epochs) & (m["axis"] == "epoch")
          & m["metric"].str.startswith(prefix), "value"] = math.nan
    data.metrics = m
    return data


def _last_alignment(rule, seed):
    return records.load_record(RULES_FIXTURE.parent / "runs" / f"rule-{rule}_seed-{seed}")[
        "trajectory"][-1]["alignment"]


def test_a_complete_run_whose_alignment_is_undefined_is_summarised_not_refused():
    # kp seed 0 fell silent: every cosine measured and NaN. dfa: both seeds silent.
    data = _rules_data()
    for run_id in ("rule-kp_seed-0", "rule-dfa_seed-0", "rule-dfa_seed-1"):
        _silence(data, run_id)
    compare.check_rules_complete(data)  # a result, not a gap: no error
    got = compare.rules_table(data)
    acc = {(r, s): 100 * records.load_record(RULES_FIXTURE.parent / "runs" /
                                             f"rule-{r}_seed-{s}")["final"]["test_acc"]
           for r in ("bp", "kp", "dfa") for s in (0, 1)}
    for rule in ("bp", "kp", "dfa"):  # accuracy covers every run
        assert got.loc[rule, "test_acc_mean"] == pytest.approx(
            (acc[rule, 0] + acc[rule, 1]) / 2, abs=1e-9)
    # kp's alignment: over the seed where it is defined, i.e. seed 1's own values.
    seed1 = _last_alignment("kp", 1)
    assert got.loc["kp", "update_cos"] == pytest.approx(seed1["mean_update_cos"], abs=1e-12)
    assert got.loc["kp", "teaching_cos"] == pytest.approx(seed1["mean_teaching_cos"], abs=1e-12)
    hidden = statistics.mean(v for k, v in seed1["update_cos"].items() if k != "fc")
    assert got.loc["kp", "update_cos_hidden"] == pytest.approx(hidden, abs=1e-12)
    # dfa: defined nowhere, so NaN, and counted; bp: untouched.
    for column in ("update_cos", "update_cos_hidden", "teaching_cos"):
        assert math.isnan(got.loc["dfa", column])
    assert got.loc["bp", "update_cos"] == pytest.approx(1.0, abs=1e-9)
    assert got["align_undefined_runs"].to_dict() == {"bp": 0, "kp": 1, "dfa": 2}
    # Over how many of the 8 layers and 7 populations it is defined, mean over seeds.
    layers, populations = len(seed1["update_cos"]), len(seed1["teaching_cos"])
    assert (layers, populations) == (8, 7)
    assert got["update_layers_defined"].to_dict() == {"bp": layers, "kp": layers / 2, "dfa": 0}
    assert got["teaching_populations_defined"].to_dict() == {"bp": populations,
                                                             "kp": populations / 2, "dfa": 0}
    note = compare.alignment_note(got)
    assert note.startswith("Alignment undefined (NaN) at some layer or population at the last "
                           "epoch in 3 run(s): ")
    assert "kp (1 run(s); defined at 4 layers and 3.5 populations, mean over seeds)" in note
    assert "dfa (2 run(s); defined at 0 layers and 0 populations" in note and "bp" not in note


def test_one_undefined_layer_counts_its_run_and_leaves_the_other_layers_mean():
    data = _silence(_rules_data(), "rule-kp_seed-0", "alignment/update_cos/stem", (2,))
    got = compare.rules_table(data)
    assert got["align_undefined_runs"].to_dict() == {"bp": 0, "kp": 1, "dfa": 0}
    assert got.loc["kp", "update_layers_defined"] == 7.5  # 7 of 8 layers, and 8 of 8
    assert got.loc["kp", "teaching_populations_defined"] == 7
    rows = [_last_alignment("kp", s)["update_cos"] for s in (0, 1)]
    hidden = [statistics.mean(v for k, v in row.items() if k not in ("fc", "stem"))
              for row in rows[:1]]
    hidden.append(statistics.mean(v for k, v in rows[1].items() if k != "fc"))
    assert got.loc["kp", "update_cos_hidden"] == pytest.approx(statistics.mean(hidden),
                                                               abs=1e-12)
    assert compare.alignment_note(compare.rules_table(_rules_data())) == ""


def test_not_measured_is_refused_with_advice_even_beside_an_undefined_run():
    data = _silence(_rules_data(), "rule-kp_seed-0")
    m = data.metrics
    data.metrics = m[~((m["run_id"] == "rule-dfa_seed-1") & (m["index"] == 2)
                       & (m["metric"] == "alignment/mean_teaching_cos"))]
    with pytest.raises(IncompleteProtocolError) as err:
        compare.rules_table(data)
    # Only the run that lacks the field is named; the undefined one is a result.
    assert err.value.problems == [
        "rule-dfa_seed-1: 'alignment/mean_teaching_cos' missing at its last epoch (2)"]
    assert str(err.value).splitlines()[0].endswith("(alignment_every: 1 measures every epoch).")
    # Without a missing field there is no advice about alignment_every.
    data = _silence(_rules_data(), "rule-kp_seed-0")
    m = data.metrics.copy()
    m.loc[(m["run_id"] == "rule-bp_seed-0") & (m["metric"] == "alignment/update_cos/fc"),
          "value"] = -math.inf
    data.metrics = m
    with pytest.raises(IncompleteProtocolError) as err:
        compare.rules_table(data)
    assert "alignment_every" not in str(err.value)
    assert err.value.problems == [
        "rule-bp_seed-0: metrics under 'alignment/' is non-finite (-inf in "
        "alignment/update_cos/fc) at epochs 0-2"]


def test_per_seed_table_is_each_runs_own_value():
    data = _rules_data()
    acc = compare.per_seed_table(data, "final.test_acc")
    teaching = compare.per_seed_table(data, "alignment/mean_teaching_cos")
    for frame in (acc, teaching):
        assert list(frame.columns) == ["seed 0", "seed 1"]
        assert sorted(frame.index) == ["bp", "dfa", "kp"]
    for rule in ("bp", "kp", "dfa"):
        for seed in (0, 1):
            record = records.load_record(RULES_FIXTURE.parent / "runs" / f"rule-{rule}_seed-{seed}")
            assert acc.loc[rule, f"seed {seed}"] == record["final"]["test_acc"]
            assert teaching.loc[rule, f"seed {seed}"] == pytest.approx(
                record["trajectory"][-1]["alignment"]["mean_teaching_cos"], abs=1e-15)
    # Its rows are what rules_table's mean summarises.
    table = compare.rules_table(data)
    assert (100 * acc.mean(axis=1)).to_dict() == pytest.approx(
        table["test_acc_mean"].to_dict(), abs=1e-9)
    # A grid of rule x weight_decay keeps each grid point apart.
    by_point = compare.per_seed_table(_rule_x_decay_data(), "final.test_acc")
    assert by_point.index.names == ["rule", "weight_decay"] and len(by_point) == 6
    with pytest.raises(KeyError, match=r"per_seed_table: 'alignment/nope' is neither a column "
                                       r"of the runs' table \(run_id, rule, seed, .*\) nor an "
                                       r"epoch metric at the runs' last epoch"):
        compare.per_seed_table(data, "alignment/nope")


def test_rule_figures_and_bill_refuse_an_empty_table(runs):
    root, table, _ = runs
    with pytest.raises(ValueError, match=r"^accuracy_bars: the table has no runs \(one row per "
                                         r"run is expected: ProtocolRuns.table\(\)\)$"):
        compare.accuracy_bars(table.iloc[:0])
    with pytest.raises(ValueError, match=r"^compute_bill: the table has no runs"):
        compare.compute_bill(table.iloc[:0], root)
    with pytest.raises(KeyError, match=r"compute_bill: column\(s\) rule not in the table"):
        compare.compute_bill(table.drop(columns="rule"), root)
    with pytest.raises(KeyError, match=r"accuracy_bars: column\(s\) final.nope not in the table"):
        compare.accuracy_bars(table, "final.nope")
    # records.load_runs' table names config fields config.<field>: the error says so, and
    # lists at most 20 columns, not hundreds
    wide = table.rename(columns={"rule": "config.rule"}).assign(
        **{f"final.x{i}": 0.0 for i in range(40)})
    with pytest.raises(KeyError, match=r"column\(s\) rule not in the table; this table names "
                                       r"them 'config.rule' \(records.load_runs' names\): pass "
                                       r"those, or rename them .*\.\.\. \(\d+ more\)"):
        compare.compute_bill(wide, root)
    # summarize and the curves say the same
    from analysis import curve_bands, summarize

    with pytest.raises(KeyError, match=r"summarize: column\(s\) rule not in the table; this "
                                       r"table names them 'config.rule'"):
        summarize(wide, ["rule"], ["final.test_acc"])
    with pytest.raises(ValueError, match=r"^curve_bands: table lacks column\(s\) 'rule'; this "
                                         r"table names them 'config.rule'"):
        curve_bands(_rules_data().metrics, wide, ["rule"], "train_loss")
    renamed = compare.compute_bill(wide.rename(columns={"config.rule": "rule"}), root)
    assert renamed.equals(compare.compute_bill(table, root))


def _rule_x_decay_data(drop_bp_at=None):
    """The rules fixture seen as a grid of rule x weight_decay with one seed: each rule's
    seed-0 run stands for weight_decay 0.0 and its seed-1 run for 0.1 (the records are
    the same; only the grid points they stand for change)."""
    from lab.sweep import RunSpec

    data = _rules_data()
    specs = []
    for spec in data.specs:
        decay = 0.1 if spec.grid["seed"] == 1 else 0.0
        if spec.grid["rule"] == "bp" and decay == drop_bp_at:
            continue
        specs.append(RunSpec(spec.run_id, spec.params,
                             {"rule": spec.grid["rule"], "seed": 0, "weight_decay": decay}))
    data.specs = specs
    return data


def test_rules_table_keeps_each_grid_point_apart():
    # The oracle: one run per (rule, weight_decay), read from its own record.
    data = _rule_x_decay_data()
    assert data.group_keys == ["rule", "weight_decay"]
    got = compare.rules_table(data)
    assert got.index.names == ["rule", "weight_decay"] and len(got) == 6
    runs = RULES_FIXTURE.parent / "runs"
    acc, update = {}, {}
    for rule in ("bp", "kp", "dfa"):
        for seed, decay in ((0, 0.0), (1, 0.1)):
            record = records.load_record(runs / f"rule-{rule}_seed-{seed}")
            acc[rule, decay] = 100 * record["final"]["test_acc"]
            update[rule, decay] = record["trajectory"][-1]["alignment"]["mean_update_cos"]
            work = record["work"]
            macs = {k: v / work["examples"] for k, v in work["macs"].items()}
            row = got.loc[(rule, decay)]
            assert row["test_acc_mean"] == pytest.approx(acc[rule, decay], abs=1e-9)
            assert math.isnan(row["test_acc_std"])  # one seed per grid point
            assert row["update_cos"] == pytest.approx(update[rule, decay], abs=1e-12)
            assert row["macs_x_forward"] == pytest.approx(
                sum(macs.values()) / macs["forward"], rel=1e-12)
    # vs bp at the same weight decay, not at a pool of decays.
    assert acc["bp", 0.0] != acc["bp", 0.1]
    for (rule, decay), value in acc.items():
        assert got.loc[(rule, decay), "vs_bp"] == pytest.approx(value - acc["bp", decay],
                                                                abs=1e-9)
    # No bp run at weight_decay 0.1: vs_bp is NaN there, and only there.
    partial = compare.rules_table(_rule_x_decay_data(drop_bp_at=0.1))
    assert len(partial) == 5
    assert partial["vs_bp"].isna().sum() == 2
    assert math.isnan(partial.loc[("kp", 0.1), "vs_bp"])
    assert partial.loc[("kp", 0.0), "vs_bp"] == pytest.approx(acc["kp", 0.0] - acc["bp", 0.0],
                                                              abs=1e-9)


def test_figures_and_bill_show_each_grid_point_apart():
    data = _rule_x_decay_data()
    table = data.table()
    points = compare.label_grid_points(table, data.group_keys)
    labels = {f"{rule}, weight_decay={decay}" for rule in ("bp", "kp", "dfa")
              for decay in (0.0, 0.1)}
    assert set(points["rule"]) == labels
    fig = compare.accuracy_bars(points)
    assert sorted(t.get_text() for t in fig.axes[0].get_xticklabels()) == sorted(labels)
    bill = compare.compute_bill(points, data.runs_dir)
    by_key = compare.compute_bill(table, data.runs_dir, data.group_keys)
    assert list(by_key.index.names) == ["rule", "weight_decay"]
    for (rule, decay), total in by_key["total"].items():
        assert bill.loc[f"{rule}, weight_decay={decay}", "total"] == total
    ticks = compare.bill_bars(by_key).axes[0].get_xticklabels()
    assert sorted(t.get_text() for t in ticks) == sorted(labels)
    # With rule and seed only, the table is left as it is.
    plain = _rules_data()
    assert list(compare.label_grid_points(plain.table(), plain.group_keys)["rule"]) == list(
        plain.table()["rule"])


def test_rules_table_refuses_a_grid_without_rule():
    from lab.sweep import RunSpec

    data = _rules_data()
    data.specs = [RunSpec(s.run_id, s.params, {"seed": s.grid["seed"]}) for s in data.specs]
    with pytest.raises(ValueError, match=r"^rules_table: the protocol 'rules-fixture' has no "
                                         r"rule in its grid \(grid keys: seed only\)"):
        compare.rules_table(data)
    # 11-compare-rules calls check_rules_complete first: it said KeyError
    # "label_grid_points: column(s) rule not in the table" for a fixed rule.
    with pytest.raises(ValueError, match=r"^check_rules_complete: the protocol 'rules-fixture' "
                                         r"has no rule in its grid"):
        compare.check_rules_complete(data)


def test_undefined_names_are_a_list_not_a_bare_string():
    from analysis.completeness import find_problems

    data = _rules_data()
    with pytest.raises(TypeError, match=r"^undefined must be a list of metric names, got "
                                        r"'alignment/' \(str\)$"):
        find_problems(data.runs, data.metrics, data.expected_ids, undefined="alignment/")
    # Without ``undefined`` a NaN alignment is a problem of completeness; with it, a result.
    _silence(data, "rule-kp_seed-0", "alignment/update_cos/stem", (2,))
    assert find_problems(data.runs, data.metrics, data.expected_ids) == [
        "rule-kp_seed-0: metrics under 'alignment/' is non-finite (nan in "
        "alignment/update_cos/stem) at epochs 2"]
    assert find_problems(data.runs, data.metrics, data.expected_ids,
                         undefined=compare.UNDEFINED) == []


def test_per_name_over_epochs_names_an_unknown_prefix():
    data = _rules_data()
    table = data.table()
    epoch = data.metrics[data.metrics["axis"] == "epoch"]["metric"]
    # Oracle: the families of the epoch metrics, each name up to its last "/".
    families = sorted({name.rsplit("/", 1)[0] + "/" for name in epoch if "/" in name})
    assert "alignment/update_cos/" in families and "rule/feedback/cos/" in families
    shown = re.escape(", ".join(map(repr, families)))
    # Was an empty frame: a typo read as "no rule logged it".
    with pytest.raises(ValueError, match=r"^per_name_over_epochs: no field of any run of the "
                                         r"table starts with 'alignment/bogus' on the epoch "
                                         rf"axis; prefixes there: {shown}$"):
        compare.per_name_over_epochs(data.metrics, table, "alignment/bogus")
    # A family named without its last slash means its members (names once came out as
    # '/blocks.0.conv1')
    bare = compare.per_name_over_epochs(data.metrics, table, "alignment/update_cos")
    assert bare.equals(compare.per_name_over_epochs(data.metrics, table,
                                                    "alignment/update_cos/"))
    assert len(bare) and not bare["name"].str.startswith("/").any()
    # Only the table's runs count: kp's feedback cosines are not bp's.
    bp = table[table["rule"] == "bp"]
    with pytest.raises(ValueError, match=r"starts with 'rule/feedback/rel_err/' .*; prefixes "
                                         r"there: 'alignment/', 'alignment/teaching_cos/', "
                                         r"'alignment/update_cos/'$"):
        compare.per_name_over_epochs(data.metrics, bp, "rule/feedback/rel_err/")
    # A family this module draws that no run of the table logs is a result (bp and dfa
    # have no feedback tensors): an empty frame, as the comparison notebook expects.
    empty = compare.per_name_over_epochs(data.metrics, bp, "rule/feedback/cos/")
    assert len(empty) == 0 and list(empty.columns) == ["rule", "name", "epoch", "value"]
    with pytest.raises(TypeError, match=r"^per_name_over_epochs: prefix must be the start of "
                                        r"metric names \(a non-empty str\), e.g. "
                                        r"'alignment/update_cos/', got \['alignment/'\] "
                                        r"\(list\)$"):
        compare.per_name_over_epochs(data.metrics, table, ["alignment/"])
    with pytest.raises(ValueError, match=r"^per_name_over_epochs: metrics lacks column\(s\) "
                                         r"'axis'.* look swapped \(the order is "
                                         r"per_name_over_epochs\(metrics, table, prefix\)\)$"):
        compare.per_name_over_epochs(table, data.metrics, "alignment/update_cos/")


def test_compute_bill_group_keys_are_a_list_of_distinct_columns():
    data = _rules_data()
    table = data.table()
    # Was "column(s) r, u, l, e not in the table": the string read letter by letter.
    with pytest.raises(TypeError, match=r"^group_keys must be a list of column names, got "
                                        r"'rule' \(str\)$"):
        compare.compute_bill(table, data.runs_dir, group_keys="rule")
    with pytest.raises(ValueError, match=r"^compute_bill: group_keys names 'rule' more than "
                                         r"once \(\['rule', 'rule'\]\); give each column once"):
        compare.compute_bill(table, data.runs_dir, group_keys=["rule", "rule"])
    with pytest.raises(ValueError, match=r"^compute_bill: group_keys is empty; name the "
                                         r"column\(s\) to bill per, e.g. \['rule'\]$"):
        compare.compute_bill(table, data.runs_dir, group_keys=[])
    with pytest.raises(ValueError, match=r"^label_grid_points: group_keys names 'seed' more "
                                         r"than once"):
        compare.label_grid_points(table, ["seed", "seed"])
    with pytest.raises(TypeError, match=r"^group_keys must be a list of column names, got "
                                        r"'seed' \(str\)$"):
        compare.label_grid_points(table, "seed")


def _bill_oracle(runs_dir, run_ids):
    """MACs per example of each run, read straight from its record."""
    out = {}
    for run_id in run_ids:
        work = records.load_record(runs_dir / run_id, rows=False)["work"]
        out[run_id] = {k: v / work["examples"] for k, v in work["macs"].items()}
    return out


def test_compute_bill_names_each_run_without_a_bill(tmp_path):
    import shutil

    from lab.train.conv import ConvConfig

    runs_dir = tmp_path / "runs"
    shutil.copytree(RULES_FIXTURE.parent / "runs", runs_dir)
    table = _rules_data().table()

    def edit(run_id, **fields):
        record = records.load_record(runs_dir / run_id, rows=False)
        record.update(fields)
        records.write_record(runs_dir / run_id, record)

    # A failed run that never trained, and another trainer's run beside the conv runs.
    edit("rule-kp_seed-0", status="failed", error="RuntimeError: boom", work={})
    edit("rule-dfa_seed-1", kind="ep", work={"ep": {"macs": 10}, "train_wall_s": 1.0})
    # Was a bare KeyError: 'examples', naming no run.
    with pytest.raises(ValueError, match=re.escape(
            "compute_bill: 2 run(s) of the table have no conv compute bill: 'rule-dfa_seed-1' "
            "(complete, kind ep): work.examples and work.macs missing: another trainer's run "
            "(ep), whose work is not a conv compute bill; 'rule-kp_seed-0' (failed, kind conv): "
            "work.examples and work.macs missing: a run that never trained (its work is "
            "empty). Drop them from the table, e.g. table[~table['run_id'].isin("
            "['rule-dfa_seed-1', 'rule-kp_seed-0'])]") + "$"):
        compare.compute_bill(table.sort_values("run_id"), runs_dir)
    # As the message says: the other runs are billed, each rule's mean over its runs.
    kept = table[~table["run_id"].isin(["rule-dfa_seed-1", "rule-kp_seed-0"])]
    bill = compare.compute_bill(kept, runs_dir)
    oracle = _bill_oracle(runs_dir, kept["run_id"])
    for rule, row in bill.iterrows():
        ids = kept.loc[kept["rule"] == rule, "run_id"]
        for component, value in row.drop("total").items():
            want = statistics.mean(oracle[i].get(component, 0.0) for i in ids)
            assert value == pytest.approx(want, rel=1e-12)
        assert row["total"] == pytest.approx(
            statistics.mean(sum(oracle[i].values()) for i in ids), rel=1e-12)
    assert row["total"] > 0
    # The kind a conv run's record carries (analysis imports no torch, so it is written out).
    assert compare.CONV_KIND == ConvConfig.KIND


@pytest.mark.parametrize("fixture, kind, first", [
    ("cfc-aux", "cfc_aux", "aux-lift_seed-0"), ("ep", "ep", "beta-0.1_seed-0")])
def test_another_trainers_runs_are_named_as_such_not_as_incomplete(fixture, kind, first):
    # 11-compare-rules on a CfC protocol said "incomplete data ... final field 'test_acc'
    # missing" once per run: a gap no rerun fills.
    from analysis import load_protocol_runs

    data = load_protocol_runs(RULES_FIXTURE.parents[1] / fixture / "protocol.yaml")
    assert set(data.runs["kind"]) == {kind} and len(data.runs) == len(data.expected_ids)
    for check in (compare.check_rules_complete, compare.rules_table):
        with pytest.raises(ValueError, match=(
                rf"^{check.__name__}: the protocol '{fixture}-fixture' holds {kind} runs "
                rf"\(e.g. {first}, .*\), not conv runs: the rule comparison .* needs runs of "
                r"the conv trainer \(notebooks/01-train-conv.ipynb\); summarise them with "
                rf"{dict(cfc_aux='30-cfc-summary', ep='20-ep-summary')[kind]} \({kind} "
                r"runs\)$")) as err:
            check(data)
        assert not isinstance(err.value, IncompleteProtocolError)
    compare.check_rules_complete(_rules_data())  # conv runs pass (the fixture is complete)


def test_compute_bill_reads_each_run_from_its_own_directory(tmp_path):
    # Swapped run directories: the table matches runs by their records' ids, but the bill
    # was read from the directory named like the run: bp billed kp's feedback, and back.
    import shutil

    runs_dir = tmp_path / "runs"
    shutil.copytree(RULES_FIXTURE.parent / "runs", runs_dir)
    table = _rules_data().table()
    want = compare.compute_bill(table, runs_dir)
    (runs_dir / "rule-bp_seed-0").rename(runs_dir / "tmp")
    (runs_dir / "rule-kp_seed-0").rename(runs_dir / "rule-bp_seed-0")
    (runs_dir / "tmp").rename(runs_dir / "rule-kp_seed-0")
    got = compare.compute_bill(table, runs_dir)
    import pandas as pd

    pd.testing.assert_frame_equal(got, want)
    assert got.loc["bp", "total"] < got.loc["kp", "total"]
    shutil.copytree(runs_dir / "rule-kp_seed-0", runs_dir / "another")  # bp's record twice
    with pytest.raises(ValueError, match=r"compute_bill: run 'rule-bp_seed-0' is not the run in "
                                         r".*rule-bp_seed-0, and 2 directories of .* hold it"):
        compare.compute_bill(table, runs_dir)
    with pytest.raises(ValueError, match=r"compute_bill: no directory of \S+ holds run "
                                         r"'rule-bp_seed-0' \(\S+/rule-bp_seed-0 does not "
                                         r"exist\); give the runs directory of the protocol"):
        compare.compute_bill(table, tmp_path / "elsewhere")


def test_each_rules_lines_follow_its_own_records_order():
    # One order for all rules, taken from the first run: a rule logging one more layer got
    # it after fc, and `blocks.1 (last)` in the key.
    import pandas as pd

    def rows(run_id, names):
        return [(run_id, "epoch", e, f"alignment/update_cos/{n}", 0.5) for e in (0, 1)
                for n in names]
    metrics = pd.DataFrame(rows("a-0", ["stem", "blocks.0", "fc"])
                           + rows("b-0", ["stem", "blocks.0", "blocks.1", "fc"]),
                           columns=["run_id", "axis", "index", "metric", "value"])
    table = pd.DataFrame({"run_id": ["a-0", "b-0"], "rule": ["fa", "kp"]})
    frame = compare.per_name_over_epochs(metrics, table, "alignment/update_cos/")
    order = {rule: list(dict.fromkeys(part["name"])) for rule, part in frame.groupby("rule")}
    assert order == {"fa": ["stem", "blocks.0", "fc"],
                     "kp": ["stem", "blocks.0", "blocks.1", "fc"]}
    ax = compare.lines_per_rule(frame, "cos").axes[1]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["stem (first)", "fc (last)"]
