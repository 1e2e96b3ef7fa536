"""The MT-1 analysis on its committed fixture: complete data passes, each gap is named."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from analysis import load_protocol_runs, mt1
from analysis.completeness import IncompleteProtocolError

FIXTURE = Path(__file__).parent / "fixtures" / "mt1" / "protocol.yaml"
RAW0 = "rule_params.traffic_rule-raw_seed-0"
INNOVATION1 = "rule_params.traffic_rule-innovation_seed-1"


@pytest.fixture
def data():
    return load_protocol_runs(FIXTURE)


def test_the_fixture_is_complete_and_summarised(data):
    mt1.check_mt1_complete(data)
    finals = mt1.final_table(data)
    assert sorted(finals.index) == ["innovation", "matched", "none", "raw"]
    # Independent value: the mean test accuracy of a condition from the run table.
    table = data.table()
    for condition in finals.index:
        accs = table.loc[table[mt1.CONDITION] == condition, "final.test_acc"]
        assert finals.loc[condition, "test_acc/mean"] == pytest.approx(accs.mean(), abs=1e-12)
    # The calibrated traffic is 4x the instruction: innovation/traffic starts near 1/4 when
    # the predictor has removed the traffic (none and innovation share the same traffic).
    ratio = mt1.ratio_frame(data, "innovation", "traffic")
    assert 0.15 < ratio.loc[0, "innovation"] < 0.35
    assert ratio.loc[0, "none"] == pytest.approx(ratio.loc[0, "innovation"], rel=1e-2)
    for figure in (mt1.rms_panels(data), mt1.alignment_bars(data),
                   mt1.lines(mt1.epoch_frame(data, "rule/feedback/mean_cos"), "cos")):
        assert figure._repr_png_().startswith(b"\x89PNG")


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
    assert finals.loc["raw", "silent_populations/mean"] > 0  # raw traffic silenced them
    assert math.isnan(finals.loc["raw", "predictor_residual_ratio/mean"])
    m = data.metrics.copy()
    hit = (m["run_id"] == INNOVATION1) & (m["metric"] == "rule/predictor_residual_ratio")
    m.loc[hit, "value"] = math.nan
    data.metrics = m
    assert _problems(data) == [
        f"{INNOVATION1}: final field 'rule/predictor_residual_ratio' is non-finite (nan) "
        "although no population is silent"]


def test_a_missing_final_diagnostic_is_named(data):
    m = data.metrics
    data.metrics = m[~((m["run_id"] == RAW0) & (m["metric"] ==
                                                 "rule/signal_alignment/used/mean"))]
    assert _problems(data) == [f"{RAW0}: final field 'rule/signal_alignment/used/mean' missing"]


def test_a_protocol_without_the_condition_key_is_refused(data):
    data.specs = [type(s)(s.run_id, s.params, {"seed": s.grid["seed"]}) for s in data.specs]
    with pytest.raises(ValueError, match="MT-1 needs the grid key 'rule_params.traffic_rule'"):
        mt1.final_table(data)
