"""The MT-1 analysis on its committed fixture: complete data passes, each gap is named."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from analysis import load_protocol_runs, mt1
from analysis.completeness import IncompleteProtocolError

FIXTURE = Path(__file__).parent / "fixtures" / "mt1" / "protocol.yaml"
RAW0 = "rule_params.traffic_rule-raw_seed-0"
INNOVATION1 = "rule_params.traffic_rule-innovation_seed-1"
SIGN = "anti_hebbian"  # the fixture's runs were made before the sign was a choice


@pytest.fixture
def data():
    return load_protocol_runs(FIXTURE)


def test_the_fixture_is_complete_and_summarised(data):
    mt1.check_mt1_complete(data)
    finals = mt1.final_table(data)
    assert sorted(finals.index) == [(c, SIGN) for c in ("innovation", "matched", "none", "raw")]
    assert (finals["diverged"] == 0).all() and (finals["diverged_at"] == "").all()
    # Independent value: the mean test accuracy of a condition from the run table.
    table = data.table()
    for condition, _ in finals.index:
        accs = table.loc[table[mt1.CONDITION] == condition, "final.test_acc"]
        assert finals.loc[(condition, SIGN), "test_acc/mean"] == pytest.approx(accs.mean(),
                                                                             abs=1e-12)
    # The calibrated traffic is 4x the instruction: innovation/traffic starts near 1/4 when
    # the predictor has removed the traffic (none and innovation share the same traffic).
    ratio = mt1.ratio_frame(data, "innovation", "traffic")
    assert 0.15 < ratio.loc[0, ("innovation", SIGN)] < 0.35
    assert ratio.loc[0, ("none", SIGN)] == pytest.approx(ratio.loc[0, ("innovation", SIGN)],
                                                         rel=1e-2)
    for figure in (mt1.rms_panels(data), mt1.alignment_bars(data),
                   mt1.lines(mt1.epoch_frame(data, "rule/feedback/mean_cos"), "cos")):
        assert figure._repr_png_().startswith(b"\x89PNG")


def test_lines_name_conditions_with_no_finite_value(data):
    # At traffic_ratio 0 every RMS(innovation) / RMS(traffic) is inf: the panel drew only
    # a legend and an empty axis.
    ratio = mt1.ratio_frame(data, "innovation", "traffic")
    ratio[("raw", SIGN)] = math.inf
    fig = mt1.lines(ratio, "RMS(innovation) / RMS(traffic)", log=True)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == [
        f"{c}, {SIGN}" for c, _ in ratio.columns if c != "raw"]
    assert [t.get_text() for t in ax.texts] == [f"undefined (no finite value) for: raw, {SIGN}"]
    ratio[:] = math.inf
    ax = mt1.lines(ratio, "r", log=True).axes[0]
    assert not ax.lines and ax.get_legend() is None and ax.get_yscale() == "linear"
    assert ax.texts[0].get_text().endswith(", ".join(f"{c}, {SIGN}" for c, _ in ratio.columns))
    assert mt1.lines(ratio, "r")._repr_png_().startswith(b"\x89PNG")


def _problems(data):
    with pytest.raises(IncompleteProtocolError) as info:
        mt1.check_mt1_complete(data)
    return info.value.problems


def test_a_missing_run_is_named(data):
    data.runs = data.runs[data.runs["run_id"] != RAW0]
    assert _problems(data) == [f"1 of 8 runs missing: {RAW0}"]


def test_a_missing_epoch_is_named(data):
    m = data.metrics
    data.metrics = m[~((m["run_id"] == INNOVATION1) & (m["axis"] == "epoch")
                       & (m["index"] == 2))]
    assert _problems(data) == [f"{INNOVATION1}: epochs 2 missing (has 3 of 4 rows)"]


def test_a_missing_trajectory_field_is_named(data):
    m = data.metrics
    data.metrics = m[~((m["run_id"] == INNOVATION1) & (m["metric"] ==
                                                       "rule/apical/rms_traffic/mean"))]
    assert _problems(data) == [
        f"{INNOVATION1}: field 'rule/apical/rms_traffic/mean' missing at epochs 0-3"]


def test_a_non_finite_value_is_named(data):
    m = data.metrics.copy()
    hit = (m["run_id"] == INNOVATION1) & (m["metric"] == "rule/feedback/mean_cos") & \
        (m["index"] == 1)
    m.loc[hit, "value"] = math.nan
    data.metrics = m
    assert _problems(data) == [
        f"{INNOVATION1}: field 'rule/feedback/mean_cos' is non-finite (nan) at epochs 1"]


def test_an_undefined_diagnostic_needs_a_silent_population(data):
    finals = mt1.final_table(data)
    raw = ("raw", SIGN)
    assert finals.loc[raw, "silent_populations/mean"] > 0  # raw traffic silenced them
    assert math.isnan(finals.loc[raw, "predictor_residual_ratio/mean"])
    m = data.metrics.copy()
    hit = (m["run_id"] == INNOVATION1) & (m["metric"] == "rule/predictor_residual_ratio")
    m.loc[hit, "value"] = math.nan
    data.metrics = m
    assert _problems(data) == [
        f"{INNOVATION1}: final field 'rule/predictor_residual_ratio' is non-finite (nan) "
        "although no population is silent and the traffic gains are not all 0"]


def test_a_missing_final_diagnostic_is_named(data):
    m = data.metrics
    data.metrics = m[~((m["run_id"] == RAW0) & (m["metric"] ==
                                                 "rule/signal_alignment/used/mean"))]
    assert _problems(data) == [f"{RAW0}: final field 'rule/signal_alignment/used/mean' missing"]


def test_a_protocol_without_the_condition_key_is_refused(data):
    data.specs = [type(s)(s.run_id, s.params, {"seed": s.grid["seed"]}) for s in data.specs]
    with pytest.raises(ValueError, match="MT-1 needs the grid key 'rule_params.traffic_rule'"):
        mt1.final_table(data)


def test_a_grid_with_another_key_is_refused_not_averaged_in(data):
    # final_table grouped by the condition alone: runs at two weight decays were pooled
    # into one mean, and counted as seeds (none 0.2815 +- 0.0672, seeds=2: one seed each).
    data.specs = [type(s)(s.run_id, s.params, {mt1.CONDITION: s.grid[mt1.CONDITION],
                                               "weight_decay": (0.001, 0.01)[s.grid["seed"]]})
                  for s in data.specs]
    assert data.group_keys == [mt1.CONDITION, "weight_decay"]
    said = (r"MT-1 compares the traffic rules at one setting, over seeds; this protocol's "
            r"grid also varies weight_decay, which its tables would average in")
    for call in (lambda: mt1.final_table(data), lambda: mt1.check_mt1_complete(data),
                 lambda: mt1.epoch_frame(data, "train_loss"),
                 lambda: mt1.ratio_frame(data, "innovation", "traffic"),
                 lambda: mt1.rms_panels(data), lambda: mt1.alignment_bars(data)):
        with pytest.raises(ValueError, match=said):
            call()


def test_a_grid_key_with_one_value_selects_a_setting_and_is_allowed(data):
    # traffic_ratio: [4.0] in the grid (one slice of existing runs) was refused as "varies".
    plain = mt1.final_table(data)
    data.specs = [type(s)(s.run_id, s.params, {**s.grid, "rule_params.traffic_ratio": 4.0})
                  for s in data.specs]
    assert "rule_params.traffic_ratio" in data.group_keys
    pd.testing.assert_frame_equal(mt1.final_table(data), plain)
    mt1.check_mt1_complete(data)


def _set_final(data, run_ids, metric_prefix, value):
    m = data.metrics.copy()
    hit = m["run_id"].isin(run_ids) & m["metric"].str.startswith(metric_prefix)
    assert hit.any()
    m.loc[hit, "value"] = value
    data.metrics = m


def test_without_traffic_the_residual_ratio_is_undefined_not_a_gap(data):
    # A protocol at traffic_ratio 0: every calibrated gain is 0, so RMS(residual) / RMS(traffic)
    # is 0/0 in every run. The runs are complete; the table keeps the ratio, as NaN
    # (undefined), and nothing else moves.
    before = mt1.final_table(data)
    _set_final(data, data.expected_ids, "rule/gains/", 0.0)
    _set_final(data, data.expected_ids, "rule/predictor_residual_ratio", math.nan)
    mt1.check_mt1_complete(data)
    after = mt1.final_table(data)
    assert after["predictor_residual_ratio/mean"].isna().all()
    rest = [c for c in before.columns if not c.startswith("predictor_residual_ratio")]
    assert after[rest].equals(before[rest])
    assert mt1.alignment_bars(data)._repr_png_().startswith(b"\x89PNG")


def test_an_undefined_residual_with_some_traffic_is_still_named(data):
    # One gain left non-zero: there is traffic, so a NaN ratio is a fault, not a result.
    _set_final(data, [INNOVATION1], "rule/gains/", 0.0)
    _set_final(data, [INNOVATION1], "rule/gains/6", 0.5)
    _set_final(data, [INNOVATION1], "rule/predictor_residual_ratio", math.nan)
    assert _problems(data) == [
        f"{INNOVATION1}: final field 'rule/predictor_residual_ratio' is non-finite (nan) "
        "although no population is silent and the traffic gains are not all 0"]
    # The run is complete: no advice to rerun the sweep, which would reproduce the NaN.
    with pytest.raises(IncompleteProtocolError, match=r"rerunning reproduces a NaN in a "
                       r"complete run: a fault of the run or the rule, not a gap\)") as info:
        mt1.check_mt1_complete(data)
    assert "rerun the sweep" not in str(info.value)


def test_the_alignment_mean_says_how_many_populations_it_covers(data):
    # The fixture's raw runs are fully silent (7 of 7) but the top population, instructed
    # by the read-out, keeps a finite cosine: the mean is that one population's cosine.
    finals = mt1.final_table(data)
    table = data.table().set_index("run_id")
    raw = table[table[mt1.CONDITION] == "raw"]
    top = "final.rule/signal_alignment/{}/block2.outer"
    for signal in mt1.ALIGNED:
        assert finals.loc[("raw", SIGN), f"align_{signal}/populations/mean"] == 1
        assert finals.loc[("raw", SIGN), f"align_{signal}/mean"] == pytest.approx(
            raw[top.format(signal)].mean(), abs=1e-12)
        assert finals.loc[("none", SIGN), f"align_{signal}/populations/mean"] == 7
    assert (finals["populations/mean"] == 7).all()
    assert (finals.loc[("raw", SIGN), "silent_populations/mean"]
            == finals.loc[("raw", SIGN), "populations/mean"])
    # Counted from the per-population cosines, independently of the recorded mean.
    covered = mt1.populations_covered(data)
    cos = table.filter(like="final.rule/signal_alignment/used/").drop(
        columns="final.rule/signal_alignment/used/mean")
    assert (covered["align_used/populations"] == cos.notna().sum(axis=1)
            .reindex(covered.index)).all()
    # The figure says so: the raw tick names 1 of 7 populations, its bars are hatched.
    fig = mt1.alignment_bars(data)
    ax = fig.axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks[list(finals.index).index(("raw", SIGN))] == f"raw\n{SIGN}\n1/7 populations"
    assert ticks[list(finals.index).index(("none", SIGN))] == f"none\n{SIGN}\n7/7 populations"
    hatched = [bar.get_hatch() for bar in ax.patches]
    assert hatched.count("//") == len(mt1.ALIGNED)  # one raw bar per signal


def test_a_quantity_undefined_in_one_seed_is_counted_not_hidden(data):
    # The mean over the seeds that define it was shown alone, reading as the condition's.
    finals = data.metrics
    key = "rule/predictor_residual_ratio"
    picked = (finals["axis"] == "final") & (finals["metric"] == key) & (
        finals["run_id"] == INNOVATION1)
    assert picked.sum() == 1
    data.metrics = finals.assign(value=finals["value"].mask(picked))
    table = mt1.final_table(data)
    other = finals[(finals["axis"] == "final") & (finals["metric"] == key)
                   & (finals["run_id"] == INNOVATION1.replace("seed-1", "seed-0"))]["value"]
    row = table.loc[("innovation", SIGN)]
    assert row["seeds"] == 2 and row["predictor_residual_ratio/n"] == 1
    assert row["predictor_residual_ratio/mean"] == pytest.approx(float(other.iloc[0]), abs=0)
    assert row["test_acc/n"] == 2
    assert (table["seeds"] == table["test_acc/n"]).all()


def test_a_mistyped_metric_or_signal_is_named_not_an_empty_figure(data):
    with pytest.raises(ValueError, match=r"^epoch_frame: no run recorded the per-epoch metric "
                                         r"'rule/feedback/mean_cso' \(did you mean "
                                         r"'rule/feedback/mean_cos'.*\?\); recorded per "
                                         r"epoch: epoch_wall_s, .*\.\.\. \(\d+ more\)$"):
        mt1.epoch_frame(data, "rule/feedback/mean_cso")
    with pytest.raises(ValueError, match=r"^ratio_frame: no run recorded the per-epoch RMS of "
                                         r"signal 'nope', metric 'rule/apical/rms_nope/mean' "
                                         r"\(did you mean .*\); recorded per epoch: .*"
                                         r"rule/apical/rms_traffic/mean"):
        mt1.ratio_frame(data, "nope", "traffic")


def _diverge(data, run_id, epoch):
    """``run_id`` as a run that diverged at ``epoch``: its rows up to that one (the
    training loss there non-finite), no final metrics, status and error as the lifecycle
    writes them."""
    m = data.metrics
    mine = m["run_id"] == run_id
    keep = ~mine | ((m["axis"] == "epoch") & (m["index"] <= epoch))
    m = m[keep].copy()
    m.loc[(m["run_id"] == run_id) & (m["index"] == epoch) & (m["metric"] == "train_loss"),
          "value"] = math.nan
    data.metrics = m
    runs = data.runs.copy()
    hit = runs["run_id"] == run_id
    runs.loc[hit, "status"] = "diverged"
    runs.loc[hit, "n_rows"] = epoch + 1
    runs.loc[hit, "error"] = f"non-finite training loss train_loss=nan at epoch {epoch}"
    runs.loc[hit, [c for c in runs.columns if c.startswith("final.")]] = math.nan
    data.runs = runs


def test_a_diverged_run_is_a_result_summarised_with_its_epoch(data):
    before = mt1.final_table(data)
    loss = mt1.epoch_frame(data, "train_loss")
    raw1 = data.metrics[(data.metrics["run_id"] == RAW0.replace("seed-0", "seed-1"))
                        & (data.metrics["axis"] == "epoch")
                        & (data.metrics["metric"] == "train_loss")].set_index("index")["value"]
    _diverge(data, RAW0, 2)
    mt1.check_mt1_complete(data)  # not a gap
    runs = mt1.outcomes(data).set_index("run_id")
    assert runs.loc[RAW0, "status"] == "diverged" and runs.loc[RAW0, "diverged_epoch"] == 2
    assert runs.loc[RAW0, "error"].endswith("at epoch 2")
    assert runs["diverged_epoch"].drop(RAW0).isna().all()
    finals = mt1.final_table(data)
    raw = ("raw", SIGN)
    assert finals.loc[raw, "diverged"] == 1 and finals.loc[raw, "diverged_at"] == "2"
    assert finals.loc[raw, "seeds"] == 2 and finals.loc[raw, "test_acc/n"] == 1
    # the finals are the seed that finished; the other conditions do not move
    test_acc1 = data.table().set_index("run_id").loc[RAW0.replace("seed-0", "seed-1"),
                                                     "final.test_acc"]
    assert finals.loc[raw, "test_acc/mean"] == test_acc1
    others = [k for k in finals.index if k != raw]
    pd.testing.assert_frame_equal(finals.loc[others], before.loc[others])
    # the trajectory counts up to the divergence: epoch 1 is both seeds' mean, from epoch 2
    # (seed 0's loss non-finite) only seed 1
    after = mt1.epoch_frame(data, "train_loss")
    assert after.loc[1, raw] == loss.loc[1, raw]
    assert after.loc[2, raw] == raw1[2] and after.loc[3, raw] == raw1[3]
    assert after.attrs["diverged"] == {raw: [(0, 2)]}
    ax = mt1.lines(after, "train loss").axes[0]
    assert f"raw, {SIGN} (diverged at epoch 2)" in [
        line.get_label() for line in ax.lines]
    marks = [line for line in ax.lines if line.get_marker() == "x"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [2]
    for figure in (mt1.rms_panels(data), mt1.alignment_bars(data),
                   mt1.lines(mt1.ratio_frame(data, "used", "instruction"), "r", log=True)):
        assert figure._repr_png_().startswith(b"\x89PNG")


def test_a_condition_whose_every_seed_diverged_is_said_not_drawn_as_a_bar(data):
    _diverge(data, RAW0, 2)
    _diverge(data, RAW0.replace("seed-0", "seed-1"), 1)
    mt1.check_mt1_complete(data)
    finals = mt1.final_table(data)
    raw = ("raw", SIGN)
    assert finals.loc[raw, "diverged"] == 2 and finals.loc[raw, "diverged_at"] == "1, 2"
    assert finals.loc[raw, "test_acc/n"] == 0 and math.isnan(finals.loc[raw, "test_acc/mean"])
    ax = mt1.alignment_bars(data).axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks[list(finals.index).index(raw)] == f"raw\n{SIGN}\nall 2 diverged"


def test_a_diverged_run_missing_a_row_before_its_divergence_is_a_gap(data):
    _diverge(data, RAW0, 2)
    m = data.metrics
    data.metrics = m[~((m["run_id"] == RAW0) & (m["index"] == 1))]
    assert _problems(data) == [f"{RAW0}: epochs 1 missing (has 2 of 3 rows)"]


def test_a_failed_run_is_still_refused(data):
    runs = data.runs.copy()
    runs.loc[runs["run_id"] == RAW0, ["status", "error"]] = ["failed", "RuntimeError: boom"]
    data.runs = runs
    assert _problems(data) == [f"{RAW0}: status 'failed', not 'complete': RuntimeError: boom"]


def test_every_table_is_per_traffic_sign_too(data):
    # The fixture as if its seed-1 runs had the other sign: one grid key more, eight groups
    # of one run each, each group's value that run's.
    data.specs = [type(s)(s.run_id, s.params,
                          {**s.grid, mt1.SIGN: ("anti_hebbian", "hebbian")[s.grid["seed"]]})
                  for s in data.specs]
    mt1.check_mt1_complete(data)
    finals = mt1.final_table(data)
    assert len(finals) == 8 and (finals["seeds"] == 1).all()
    for _, row in data.table().iterrows():
        key = (row[mt1.CONDITION], row[mt1.SIGN])
        assert finals.loc[key, "test_acc/mean"] == row["final.test_acc"]
    assert mt1.epoch_frame(data, "train_loss").shape[1] == 8
    fig = mt1.rms_panels(data)
    assert len(fig.axes) == 8
    assert sorted(ax.get_title() for ax in fig.axes)[:2] == ["innovation, anti_hebbian",
                                                            "innovation, hebbian"]
