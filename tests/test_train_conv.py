"""The conv trainer: reproducibility, resume after SIGKILL, divergence, test-once."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lab import records
from lab.cli import main as cli_main
from lab.config import ConfigError, from_dict
from lab.lifecycle import CHECKPOINT, CheckpointError
from lab.rules import RULES, Rule, StepResult
from lab.train import ConvConfig, conv, train_conv


def _values(record):
    """The record's trajectory and final values as JSON text, timings aside."""
    stripped = records.without_timings(record)
    return json.dumps([stripped["trajectory"], stripped["final"]], sort_keys=True)


def test_same_seed_gives_identical_records(tiny, tmp_path):
    config = ConvConfig(**tiny)
    first = train_conv(config, tmp_path / "a")
    second = train_conv(config, tmp_path / "b")
    assert first["status"] == second["status"] == "complete"
    assert len(first["trajectory"]) == tiny["epochs"]
    assert _values(first) == _values(second)
    # The saved record, read back, carries the same values.
    assert _values(records.load_record(tmp_path / "a")) == _values(first)


def test_another_seed_gives_another_record(tiny):
    assert _values(train_conv(ConvConfig(**tiny))) != _values(
        train_conv(ConvConfig(**tiny, seed=1)))


def test_record_layout(tiny, tmp_path):
    train_conv(ConvConfig(**tiny), tmp_path / "run")
    record = records.load_record(tmp_path / "run")
    assert record["status"] == "complete" and record["kind"] == "conv"
    assert record["config"]["rule_params"] == {}
    assert {"test_acc", "test_loss"} <= set(record["final"])
    assert [row["epoch"] for row in record["trajectory"]] == list(range(tiny["epochs"]))
    metrics = records.load_metrics(tmp_path)
    assert set(metrics[metrics.axis == "epoch"]["index"]) == set(range(tiny["epochs"]))


def test_test_split_is_evaluated_exactly_once(tiny, monkeypatch):
    runs, calls = [], []
    build, evaluate = conv.build_run, conv._evaluate
    monkeypatch.setattr(conv, "build_run", lambda c: runs.append(build(c)) or runs[-1])
    monkeypatch.setattr(conv, "_evaluate",
                        lambda m, split, b: calls.append(split) or evaluate(m, split, b))
    train_conv(ConvConfig(**tiny))
    test_calls = [s for s in calls if s is runs[0].data.test]
    assert len(test_calls) == 1 and calls[-1] is runs[0].data.test
    assert len(calls) == tiny["epochs"] + 1  # one validation pass per epoch, one test


class NanAfter(Rule):
    """Backprop whose loss turns non-finite from step 6 on."""

    name = "test_nan_after"

    def compute_gradients(self, x, y, step):
        logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        bad = loss.detach() * (math.nan if step >= 6 else 1.0)
        return StepResult(bad, logits.detach())


def test_divergence_stops_and_keeps_the_trajectory(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(RULES, NanAfter.name, NanAfter)
    record = train_conv(ConvConfig(**{**tiny, "epochs": 5}, rule=NanAfter.name), tmp_path / "r")
    # 256 examples / 64 per batch = 4 steps per epoch: step 6 falls in epoch 1.
    assert record["status"] == "diverged"
    assert len(record["trajectory"]) == 2 and "epoch 1" in record["error"]
    assert math.isfinite(record["trajectory"][0]["train_loss"])
    assert math.isnan(records.load_record(tmp_path / "r")["trajectory"][1]["train_loss"])


def test_real_divergence_from_a_huge_learning_rate(tiny):
    record = train_conv(ConvConfig(**tiny, normalization="none", lr=1e4, schedule="constant"))
    assert record["status"] == "diverged"


def _kill_mid_run(config_args, out, min_epochs):
    pairs = [a for k, v in config_args.items() for a in ("-p", k, json.dumps(v))]
    proc = subprocess.Popen([sys.executable, "-m", "lab.cli", "train", "--out", str(out),
                             *pairs], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            path = out / "record.json"
            if path.exists() and records.read_json(path)["rows"].get("epoch", 0) >= min_epochs:
                break
            if proc.poll() is not None:
                pytest.fail("the run finished before it could be killed")
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()


def test_sigkill_then_resume_equals_uninterrupted(tiny, tmp_path):
    # One thread in both processes: a different thread count may reorder sums.
    args = {**tiny, "epochs": 30, "threads": 1}
    torch_threads = torch.get_num_threads()
    try:
        _kill_mid_run(args, tmp_path / "killed", min_epochs=3)
        killed = records.load_record(tmp_path / "killed")
        assert killed["status"] == "running"
        assert 3 <= len(killed["trajectory"]) < args["epochs"]
        resumed = train_conv(ConvConfig(**args), tmp_path / "killed")
        whole = train_conv(ConvConfig(**args), tmp_path / "whole")
    finally:
        torch.set_num_threads(torch_threads)
    assert resumed["status"] == "complete"
    assert _values(resumed) == _values(whole)


def test_resume_refuses_a_different_config(tiny, tmp_path):
    train_conv(ConvConfig(**tiny), tmp_path / "r")
    with pytest.raises(CheckpointError, match=r"different config \(lr: 0.1 there vs 0.2 now\)"):
        train_conv(ConvConfig(**tiny, lr=0.2), tmp_path / "r")


def test_a_different_rule_parameter_is_named_by_its_dotted_key(tiny, tmp_path):
    # Not the two whole rule_params dicts (11 keys for lhfa, 19 for sdil) differing in one.
    config = ConvConfig(**{**tiny, "rule": "kp"})
    train_conv(config, tmp_path / "r")
    other = ConvConfig(**{**tiny, "rule": "kp", "rule_params": {"feedback_scale": 0.5}})
    with pytest.raises(CheckpointError, match=r"r holds a complete run with a different config "
                       r"\(rule_params.feedback_scale: 1.0 there vs 0.5 now\); nothing was "
                       r"changed"):
        train_conv(other, tmp_path / "r")


def test_corrupt_checkpoint_is_named(tiny, tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"checkpoint .*checkpoint.pt cannot be read"):
        train_conv(ConvConfig(**tiny), tmp_path / "r")


def test_cli_train_and_bad_parameter(tiny, tmp_path, capsys):
    pairs = [a for k, v in {**tiny, "epochs": 1}.items() for a in ("-p", k, str(v))]
    assert cli_main(["train", "--out", str(tmp_path / "r"), *pairs]) == 0
    assert records.load_record(tmp_path / "r")["status"] == "complete"
    assert cli_main(["train", "--out", str(tmp_path / "s"), "-p", "learning_rate", "1"]) == 2
    assert "no field(s) 'learning_rate'" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run(tiny):
    record = train_conv(ConvConfig(**tiny, device="cuda"))
    assert record["status"] == "complete" and record["environment"]["device"] == "cuda"


# Rules that calibrate on a prefix of the training set, sized for `tiny`'s 256 examples.
TINY_RULE_PARAMS = {
    "kp_traffic": {"traffic_calibration_examples": 128, "predictor_warmup_steps": 5,
                   "predictor_batch": 64},
    "sdil": {"traffic_calibration_examples": 128, "predictor_warmup_steps": 5,
             "predictor_batch": 64, "a_warmup_steps": 2, "calibration_batch": 64},
    "lhfa": {"warmup_steps": 2, "calibration_batch": 64},
}


STATEFUL_RULES = ["kp", "wm", "rrm", "brsf", "frsf", "dfa", "nodepert", "kp_traffic", "lhfa",
                  "sdil"]


def _interrupt_at(epoch, monkeypatch, config, out):
    """train_conv into ``out``, stopped by a KeyboardInterrupt as ``epoch`` begins (a kill
    mid-run: the checkpoint of the epoch before is on disk)."""
    real = conv._train_epoch

    def crash(run, e, kind, life):
        if e == epoch:
            raise KeyboardInterrupt
        return real(run, e, kind, life)

    monkeypatch.setattr(conv, "_train_epoch", crash)
    with pytest.raises(KeyboardInterrupt):
        train_conv(config, out)
    monkeypatch.setattr(conv, "_train_epoch", real)


@pytest.mark.parametrize("rule", STATEFUL_RULES)
def test_interrupted_rule_resumes_exactly(tiny, tmp_path, monkeypatch, rule):
    """A crash after epoch 2 and a resume give the uninterrupted record (rule state too)."""
    config = ConvConfig(**{**tiny, "epochs": 4, "alignment_every": 2, "alignment_batch": 32},
                        rule=rule, rule_params=TINY_RULE_PARAMS.get(rule, {}))
    whole = train_conv(config, tmp_path / "whole")
    _interrupt_at(2, monkeypatch, config, tmp_path / "cut")
    resumed = train_conv(config, tmp_path / "cut")
    assert _values(resumed) == _values(whole)
    # Equal but for the wall time, which the lifecycle sums over both sessions.
    assert records.without_timings(resumed["work"]) == records.without_timings(whole["work"])
    assert resumed["work"]["train_wall_s"] > 0


@pytest.mark.parametrize("rule", sorted(RULES))
def test_alignment_and_tracking_trajectories_are_complete(tiny, rule):
    record = train_conv(ConvConfig(**{**tiny, "epochs": 2}, rule=rule, alignment_every=1,
                                   alignment_batch=32,
                                   rule_params=TINY_RULE_PARAMS.get(rule, {})))
    assert record["status"] == "complete"
    for row in record["trajectory"]:
        align = row["alignment"]
        assert set(align["teaching_cos"]) and set(align["update_cos"])
        # The summaries are the means of what they summarise, not independent numbers.
        assert align["mean_update_cos"] == pytest.approx(
            sum(align["update_cos"].values()) / len(align["update_cos"]), abs=1e-12)
        if rule == "bp":
            assert min(align["update_cos"].values()) > 1 - 1e-9
        if rule in ("fa", "kp", "usf", "brsf", "frsf", "wm", "rrm", "kp_traffic", "lhfa"):
            tracking = row["rule"]["feedback"]
            cos = list(tracking["cos"].values())
            assert tracking["mean_cos"] == pytest.approx(sum(cos) / len(cos), abs=1e-12)
            assert tracking["min_cos"] == min(cos)
            assert tracking["max_rel_err"] == max(tracking["rel_err"].values())
    assert record["work"]["macs"]["forward"] == (
        record["work"]["forward_macs_per_example"] * record["work"]["examples"])


def test_exploding_learning_rate_ends_diverged_with_its_rows(tmp_path):
    # The configuration a new user tried: a training loss of 2e25 was recorded as complete.
    config = ConvConfig(lr=1e6, n_train=256, width=4, depth=8, epochs=2, progress=False)
    record = train_conv(config, tmp_path / "r")
    assert record["status"] == "diverged"
    assert "exceeds 1000 x the loss at initialisation" in record["error"]
    saved = records.load_record(tmp_path / "r")
    assert saved["status"] == "diverged" and len(saved["trajectory"]) == 1
    assert saved["trajectory"][0]["train_loss"] > 1000 * 2.0
    assert "test_acc" not in saved["final"]


def _onecycle(peak: float, pct: float, total: int):
    """Smith & Topin's cosine one-cycle as torch runs it, written out: lr at step s."""
    start, floor = peak / 25, peak / 25 / 1e4
    end1 = pct * total - 1

    def lr(s):
        if s <= end1:
            a, b, t = start, peak, s / end1
        else:
            a, b, t = peak, floor, (s - end1) / (total - 1 - end1)
        return b + (a - b) / 2 * (math.cos(math.pi * t) + 1)
    return lr


def test_a_short_run_that_moves_the_warm_up_says_so_and_records_what_it_used(tiny):
    # 4 optimizer steps: 0.25 of them is under torch's 1.5-step minimum phase, so the
    # schedule used 0.375 while the record said only 0.25.
    config = ConvConfig(**{**tiny, "epochs": 1, "threads": 1})
    with pytest.warns(UserWarning, match=r"warmup_fraction=0.25 of this run's 4 optimizer "
                                         r"steps .* the warm-up used is 0.375 \(recorded as "
                                         r"work.warmup_fraction_used\)"):
        run = conv.build_run(config)
    want = _onecycle(config.lr, 1.5 / 4, 4)
    lrs = []
    for _ in range(4):
        lrs.append(run.optimizer.param_groups[0]["lr"])
        run.optimizer.step()
        run.scheduler.step()
    assert lrs == pytest.approx([want(s) for s in range(4)], rel=1e-9)
    with pytest.warns(UserWarning, match="warm-up used"):
        record = train_conv(config)
    assert record["work"]["warmup_fraction_used"] == 0.375
    assert record["config"]["warmup_fraction"] == 0.25


def test_recorded_learning_rate_follows_one_cycle(tiny):
    config = ConvConfig(**{**tiny, "epochs": 6})
    record = train_conv(config)
    steps = 4  # 256 examples / 64 per batch
    total, peak, pct = 6 * steps, config.lr, config.warmup_fraction
    floor = peak / 25 / 1e4
    onecycle = _onecycle(peak, pct, total)
    assert record["work"]["warmup_fraction_used"] == pct  # 24 steps: as configured
    # Each epoch's row holds the rate its last step used; the last is the cycle's floor.
    lrs = [row["lr"] for row in record["trajectory"]]
    assert lrs == pytest.approx([onecycle((e + 1) * steps - 1) for e in range(6)], rel=1e-9)
    assert lrs[-1] == pytest.approx(floor, rel=1e-9)
    assert lrs[0] < lrs[1] and lrs[1] > lrs[2] > lrs[3] > lrs[4]


def test_evaluation_changes_no_buffer_and_ignores_batch_size(tiny):
    run = conv.build_run(ConvConfig(**tiny))
    run.model.train()
    run.model(run.data.train.x[:64])  # move BN running stats away from their initial values
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    big = conv._evaluate(run.model, run.data.val, 1000)
    small = conv._evaluate(run.model, run.data.val, 7)
    after = run.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert small[0] == pytest.approx(big[0], rel=1e-6) and small[1] == big[1]


def test_bill_counts_every_training_example(tiny):
    config = ConvConfig(**{**tiny, "epochs": 3})
    n_train = len(conv.build_run(config).data.train.y)
    assert n_train == 256  # n_train counts training examples; validation comes from the rest
    record = train_conv(config)
    assert record["work"]["examples"] == 3 * n_train
    assert record["work"]["optimizer_steps"] == 3 * math.ceil(n_train / 64)


LEGACY = __import__("pathlib").Path(__file__).parent / "fixtures" / "legacy" / "runs"


def _legacy_rows(rows):
    """A version 1 row: rule diagnostics were merged flat; now they sit under "rule".
    Its ``lr`` was the scheduler's next value (the next epoch's first step); rows now
    hold the rate the epoch's last step used (checked against the schedule written out
    in test_recorded_learning_rate_follows_one_cycle), so lr is left out here."""
    out = []
    for row in rows:
        row = {k: v for k, v in row.items() if k != "lr"}
        rule = {"feedback": row.pop("feedback")} if "feedback" in row else {}
        out.append({**row, "rule": rule})
    return out


def _close(a, b, rel=1e-6):
    """Equal, except for the last bits that differ between machines: float64 cosines in
    the last bit, and float32 sums (a loss averaged over batches) in the last bits where
    the CPUs' vector units differ (AVX-512 against AVX2 sum in another order: 5e-8 and
    1e-7 here, on a loss and a test loss). Anything the training changes moves far more
    (a wrong step changes the second epoch's loss in the third digit)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= rel * max(abs(a), abs(b))
    return a == b


@pytest.mark.parametrize("run_id", ["demo-small_rule-bp_seed-0", "rule-bp_seed-0"])
def test_records_written_before_the_lifecycle_port_are_reproduced(tmp_path, run_id):
    """Records of the pre-port trainer (schema 1): the same config gives the same values."""
    old = records.load_record(LEGACY / run_id)
    assert old["schema_version"] == 1
    new = train_conv(from_dict(ConvConfig, old["config"]), tmp_path / "r")
    rows = [{k: v for k, v in row.items() if k != "lr"} for row in new["trajectory"]]
    for row in rows:  # counts added since (how many cosines each mean covers): all defined
        if isinstance(row.get("alignment"), dict):
            align = row["alignment"] = dict(row["alignment"])
            assert align.pop("update_defined") == len(align["update_cos"])
            assert align.pop("teaching_defined") == len(align["teaching_cos"])
            # ... and the norm ratios beside the cosines (bp: 1 everywhere, to rounding)
            for key in ("teaching_norm", "update_norm"):
                assert align.pop(key).keys() == align[key.replace("norm", "cos")].keys()
                assert align.pop(f"mean_{key}") > 0
    assert _close(records.without_timings(_legacy_rows(old["trajectory"])),
                  records.without_timings(rows))
    assert _close(new["final"], old["final"])
    assert new["final"].keys() == old["final"].keys()
    assert new["work"]["macs"]["forward"] == old["work"]["macs"]["forward"]


# -- the trainer does what the config says (mutation-testing survivors) -------------------


@pytest.mark.parametrize("kw, message", [
    (dict(eval_split="test", eval_every=1, val_fraction=0.2),
     r"eval_split='test' with eval_every=1 would look at the test split"),
    (dict(eval_every=1, val_fraction=0.0), r"eval_every > 0 needs a validation split"),
])
def test_config_refuses_evaluations_it_cannot_make_honestly(tiny, kw, message):
    from lab.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        ConvConfig(**{**tiny, **kw})


def test_config_records_the_rules_resolved_parameters(tiny):
    from lab.rules.registry import resolve_params

    config = ConvConfig(**tiny, rule="kp_traffic", rule_params={"traffic_rule": "raw"})
    assert config.rule_params == resolve_params("kp_traffic", {"traffic_rule": "raw"})
    assert config.rule_params["traffic_ratio"] == 4.0 and len(config.rule_params) > 5


def test_periodic_evaluations_fall_on_their_cadence_and_match_the_declaration(tiny, tmp_path):
    from analysis.completeness import check_complete

    config = ConvConfig(**{**tiny, "epochs": 7}, val_fraction=0.25, eval_every=3,
                        alignment_every=3, alignment_batch=16)
    record = train_conv(config, tmp_path / "r", run_id="r")
    rows = record["trajectory"]
    # on the cadence, and the last epoch (3 does not divide 7)
    assert [e for e, r in enumerate(rows) if r["val_acc"] is not None] == [2, 5, 6]
    assert [e for e, r in enumerate(rows) if r["alignment"] is not None] == [2, 5, 6]
    assert record["final"]["val_acc"] == rows[-1]["val_acc"] is not None
    assert record["expect"] == {
        "axis": "epoch", "count": 7, "stride": 1,
        "metrics": ["train_loss", "train_acc", "lr"],
        "periodic": [["val_loss", 3, 2], ["val_acc", 3, 2], ["alignment/", 3, 2]],
        "final": ["test_loss", "test_acc"], "undefined": ["alignment/"]}
    check_complete(records.load_runs(tmp_path), records.load_metrics(tmp_path), ["r"])
    assert record["run_id"] == "r" and record["environment"]["device"] == "cpu"


def test_a_run_whose_network_fell_silent_is_complete_with_undefined_alignment(tmp_path):
    # lr 1.0 without normalisation silences a width-1 network after one epoch: its
    # cosines are 0/0 from then on, NaN in the record. That is its result, and
    # 10-summary (check_complete) refused the complete run as holding "non-finite" values.
    from analysis.completeness import IncompleteProtocolError, check_complete

    config = ConvConfig(dataset="mnist1d", n_train=64, val_fraction=0.0, eval_every=0, depth=8,
                        width=1, epochs=3, normalization="none", schedule="constant", lr=1.0,
                        batch_size=16, alignment_every=1, alignment_batch=16, progress=False)
    record = train_conv(config, tmp_path / "r", run_id="r")
    cosines = [row["alignment"]["mean_update_cos"] for row in record["trajectory"]]
    assert record["status"] == "complete" and math.isfinite(cosines[0]) and \
        all(math.isnan(c) for c in cosines[1:])
    check_complete(records.load_runs(tmp_path), records.load_metrics(tmp_path), ["r"])
    with pytest.raises(IncompleteProtocolError, match=r"r: field 'train_loss' missing"):
        metrics = records.load_metrics(tmp_path)
        check_complete(records.load_runs(tmp_path),
                       metrics[metrics["metric"] != "train_loss"], ["r"])


def test_a_rules_row_metrics_are_declared(tiny):
    record = train_conv(ConvConfig(**{**tiny, "epochs": 1}, rule="lhfa",
                                   rule_params={"warmup_steps": 0, "pert_every": 10 ** 6}))
    assert record["expect"]["metrics"] == [
        "train_loss", "train_acc", "lr", "rule/feedback/mean_cos",
        "rule/perturbation/loss_queries", "rule/calibration/events"]


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_recorded_learning_rate_follows_the_other_schedules(tiny, schedule):
    config = ConvConfig(**{**tiny, "epochs": 4}, schedule=schedule)
    lrs = [row["lr"] for row in train_conv(config)["trajectory"]]
    steps, total = 4, 16
    if schedule == "constant":
        want = [config.lr] * 4
    else:  # CosineAnnealingLR to zero over the run: the rate each epoch's last step used
        want = [config.lr * (1 + math.cos(math.pi * ((e + 1) * steps - 1) / total)) / 2
                for e in range(4)]
    assert lrs == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_optimizers_take_the_configs_settings(tiny):
    run = conv.build_run(ConvConfig(**tiny, momentum=0.0, nesterov=True, weight_decay=3e-4,
                                    lr=0.05, schedule="constant"))
    group = run.optimizer.param_groups[0]
    assert isinstance(run.optimizer, torch.optim.SGD)
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (
        0.05, 0.0, False, 3e-4)  # no momentum: Nesterov has nothing to look ahead with
    run = conv.build_run(ConvConfig(**tiny, momentum=0.8, nesterov=True, lr=0.05,
                                    schedule="constant"))
    assert run.optimizer.param_groups[0]["nesterov"] is True
    run = conv.build_run(ConvConfig(**tiny, optimizer="adam", lr=0.002, weight_decay=0.01))
    group = run.optimizer.param_groups[0]
    assert isinstance(run.optimizer, torch.optim.AdamW)
    assert group["weight_decay"] == 0.01 and group["betas"] == (0.9, 0.999)
    run.optimizer.step(), run.scheduler.step()  # one-cycle leaves Adam's betas alone
    assert group["betas"] == (0.9, 0.999) and group["max_lr"] == 0.002


def test_the_split_follows_the_seed(tiny):
    from lab.data import load_dataset

    for seed in (0, 1):
        run = conv.build_run(ConvConfig(**tiny, seed=seed, val_fraction=0.25))
        want = load_dataset("mnist1d", val_fraction=0.25, split_seed=seed, n_train=256)
        assert torch.equal(run.data.val.y, want.val.y)
        assert torch.allclose(run.data.val.x, want.val.x.to(run.data.val.x))


def test_a_fresh_run_prepares_the_rule_and_records_its_final_diagnostics(tiny, monkeypatch):
    prepared, finals = [], []
    real_prepare = RULES["lhfa"].prepare
    real_final = RULES["lhfa"].final_metrics
    monkeypatch.setattr(RULES["lhfa"], "prepare",
                        lambda self, x, y: prepared.append(len(x)) or real_prepare(self, x, y))
    monkeypatch.setattr(RULES["lhfa"], "final_metrics",
                        lambda self, x, y: finals.append(len(x)) or real_final(self, x, y))
    config = ConvConfig(**{**tiny, "epochs": 2}, rule="lhfa", alignment_batch=32,
                        rule_params={"warmup_steps": 2, "pert_every": 10 ** 6,
                                     "calibration_batch": 16})
    record = train_conv(config)
    assert prepared == [256] and finals == [32]
    assert record["final"]["rule"]["calibration"]["events"] == 2  # the warm-up's, no others


@pytest.mark.parametrize("augment, want", [("auto", "shift"), ("none", "none")])
def test_the_augmentation_is_the_configs(tiny, monkeypatch, augment, want):
    seen = set()
    real = conv._train_epoch
    monkeypatch.setattr(conv, "_train_epoch",
                        lambda run, epoch, kind, life: seen.add(kind) or real(run, epoch, kind,
                                                                              life))
    train_conv(ConvConfig(**{**tiny, "epochs": 1}, augment=augment))
    assert seen == {want}


def _shuffle_mnist1d_cache(data_dir: Path) -> None:
    # Same file, same size, other content: the training examples in another order.
    path = next((data_dir / "mnist1d").glob("*.npz"))
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["x_train"] = arrays["x_train"][::-1].copy()
    np.savez(path.with_suffix(".tmp.npz"), **arrays)
    path.with_suffix(".tmp.npz").replace(path)


def test_conv_record_holds_the_data_identity_and_refuses_other_data(tiny, tmp_path, monkeypatch):
    """A conv run records its data (dataset, absolute directory, hash of the arrays, split
    sizes); a resume on changed data is refused and a finished run on it is stale."""
    from lab.data import content_identity
    from lab.data.identity import changed_files

    monkeypatch.chdir(tmp_path)
    config = ConvConfig(**{**tiny, "epochs": 3}, data_dir="data")
    assert config.data_dir == str(tmp_path / "data")  # stored absolute
    _interrupt_at(1, monkeypatch, config, tmp_path / "run")
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    identity = content_identity("mnist1d", tmp_path / "data")
    assert record["data"] == {**identity, "split": {"train": 256, "val": 400, "test": 1000}}
    assert identity["dir"] == str(tmp_path / "data") and len(identity["sha256"]) == 64

    _shuffle_mnist1d_cache(tmp_path / "data")
    with pytest.raises(CheckpointError, match=r"belongs to a run trained on other data "
                                              r"\(sha256: '[0-9a-f]{64}' there vs "):
        train_conv(config, tmp_path / "run")
    # The same data again (the cache regenerated, with new zip timestamps): resumable.
    for f in (tmp_path / "data" / "mnist1d").glob("*.npz"):
        f.unlink()
    done = train_conv(config, tmp_path / "run")
    assert done["status"] == "complete" and changed_files(done["data"]) == []
    _shuffle_mnist1d_cache(tmp_path / "data")
    assert changed_files(done["data"]) == [
        f"mnist1d in {tmp_path / 'data'}: other content (sha256)"]
    # MNIST-1D is generated: without its cache the same arrays come back, nothing changed.
    shutil.rmtree(tmp_path / "data")
    assert changed_files(done["data"]) == []


def test_a_blank_data_dir_compares_the_data_where_it_reads_now(tmp_path, monkeypatch):
    """data_dir "" reads $LAB_DATA_DIR as found where the run is made: a finished run that
    read one directory is checked against the data the default directory holds now (the
    directory it read may be untouched), and the same arrays elsewhere are the same data."""
    from lab.data import content_identity, default_data_dir
    from lab.data.identity import changed_files

    used, same, other = (tmp_path / name for name in ("used", "same", "other"))
    for d in (used, same, other):
        shutil.copytree(default_data_dir() / "mnist1d", d / "mnist1d")
    _shuffle_mnist1d_cache(other)
    data = {**content_identity("mnist1d", used), "split": {"train": 256}}
    monkeypatch.setenv("LAB_DATA_DIR", str(used))
    assert changed_files(data, "") == []
    monkeypatch.setenv("LAB_DATA_DIR", str(same))
    assert changed_files(data, "") == []  # a cache moved: the same arrays
    monkeypatch.setenv("LAB_DATA_DIR", str(other))
    assert changed_files(data, "") == [
        f"mnist1d in {other} (data_dir '' now: $LAB_DATA_DIR, else ~/.cache/lab; the run "
        f"read {used}): other content (sha256)"]
    # A directory named in the config is the one it reads (a change of it is a change of
    # the config, reported as such); without a config, the directory the run read.
    assert changed_files(data, str(used)) == changed_files(data) == []


def test_a_resume_reads_the_same_arrays_from_a_moved_default_data_dir(tiny, tmp_path,
                                                                       monkeypatch):
    # $LAB_DATA_DIR pointed at a copy of the same cache: the resume was refused as "trained
    # on other data (dir: ...)" inside the kernel, and the interrupted run marked failed.
    from lab.data import default_data_dir

    used, moved, other = (tmp_path / name for name in ("used", "moved", "other"))
    for d in (used, moved, other):
        shutil.copytree(default_data_dir() / "mnist1d", d / "mnist1d")
    _shuffle_mnist1d_cache(other)
    config = ConvConfig(**{**tiny, "epochs": 3})
    assert config.data_dir == ""
    monkeypatch.setenv("LAB_DATA_DIR", str(used))
    whole = train_conv(config, tmp_path / "whole")
    _interrupt_at(1, monkeypatch, config, tmp_path / "run")
    monkeypatch.setenv("LAB_DATA_DIR", str(other))
    with pytest.raises(CheckpointError, match=r"belongs to a run trained on other data "
                                              r"\(sha256: "):
        train_conv(config, tmp_path / "run")
    monkeypatch.setenv("LAB_DATA_DIR", str(moved))
    resumed = train_conv(config, tmp_path / "run")
    assert resumed["status"] == "complete" and resumed["data"]["dir"] == str(moved)
    assert records.without_timings(resumed["trajectory"]) == \
        records.without_timings(whole["trajectory"])
    assert resumed["final"]["test_acc"] == whole["final"]["test_acc"]


def test_cifar10_identity_sees_a_changed_or_missing_batch(tmp_path):
    from lab.data import content_identity
    from lab.data.cifar10 import write_fake_cifar10
    from lab.data.identity import changed_files

    batch_dir = write_fake_cifar10(tmp_path / "c", n_per_batch=4, seed=0)
    data = {"data": content_identity("cifar10", tmp_path / "c")}
    assert changed_files(data) == []
    write_fake_cifar10(tmp_path / "c", n_per_batch=4, seed=1)  # same sizes, other images
    assert changed_files(data) == [f"cifar10 in {tmp_path / 'c'}: other content (sha256)"]
    (batch_dir / "test_batch").unlink()
    [why] = changed_files(data)
    assert why.startswith(f"cifar10 in {tmp_path / 'c'}: cannot be read now (CIFAR-10 batch "
                          f"file(s) missing: {batch_dir / 'test_batch'}")


def test_blank_data_dir_is_refused():
    with pytest.raises(ConfigError, match=r"ConvConfig.data_dir='  ' is blank; give a "
                                          r"directory, or '' for \$LAB_DATA_DIR"):
        ConvConfig(data_dir="  ")
    assert ConvConfig(data_dir="").data_dir == ""


def test_conv_config_is_frozen_all_the_way_down():
    import copy
    import dataclasses
    import pickle

    a = ConvConfig(rule="fa")
    assert a == ConvConfig(rule="fa", rule_params={"feedback_scale": 1.0})
    assert hash(a) == hash(ConvConfig(rule="fa", rule_params={"feedback_scale": 1.0}))
    assert hash(a) != hash(ConvConfig(rule="fa", rule_params={"feedback_scale": 2.0}))
    with pytest.raises(TypeError, match=r"FrozenParams is read-only \(a frozen config's "
                                        r"parameters\); build a new config"):
        a.rule_params["feedback_scale"] = -7.0
    with pytest.raises(TypeError, match=r"read-only"):
        a.rule_params.update(feedback_scale=-7.0)
    assert a.rule_params == {"feedback_scale": 1.0, "feedback_seed": 0}
    assert pickle.loads(pickle.dumps(a)) == a and copy.deepcopy(a) == a
    assert json.loads(json.dumps(dataclasses.asdict(a)))["rule_params"] == dict(a.rule_params)
    assert dataclasses.replace(a, lr=0.2).rule_params == a.rule_params


def test_switching_the_rule_with_replace_names_the_params_to_pass():
    import dataclasses
    # The filled-in defaults of the old rule are named as such, with the replace advice,
    # not blamed as parameters the user gave for another rule ("-p rule brsf").
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(ConvConfig(rule="fa"), rule="bp")
    assert str(err.value) == (
        "ConvConfig.rule_params: rule 'bp' has no parameter(s) 'feedback_scale', "
        "'feedback_seed'; it takes no parameters. The parameters given are every parameter "
        "of rule brsf / fa / frsf / kp / ... (a config made for such a rule, its defaults "
        "filled in): changing a config's rule with dataclasses.replace? pass rule_params for "
        "the new rule too, e.g. replace(config, rule=..., rule_params={})")
    with pytest.raises(ConfigError, match=r"pert_sigma, pert_directions. The parameters given "
                                          r"are every parameter of rule brsf / fa"):
        dataclasses.replace(ConvConfig(rule="kp"), rule="nodepert")
    # a parameter given for the wrong rule still gets the -p hint
    with pytest.raises(ConfigError, match=r"'feedback_scale': parameter\(s\) of rule brsf / "
                                          r"dfa / fa / frsf / \.\.\. \(to train with it: -p rule "
                                          r"brsf"):
        ConvConfig(rule="bp", rule_params={"feedback_scale": 2.0})
    assert dataclasses.replace(ConvConfig(rule="fa"), rule="bp", rule_params={}).rule == "bp"


def test_a_rerun_keeps_the_runs_id_and_record(tiny, tmp_path):
    """The record returned for a finished run is the one on disk, whatever run_id is given."""
    config = ConvConfig(**{**tiny, "epochs": 1})
    first = train_conv(config, tmp_path / "r", run_id="x")
    with pytest.warns(UserWarning, match=rf"run_id='z' is not used: {tmp_path / 'r'} holds run "
                                         r"'x', and a run keeps the id it started with"):
        again = train_conv(config, tmp_path / "r", run_id="z")
    on_disk = records.load_record(tmp_path / "r")
    assert first["run_id"] == again["run_id"] == on_disk["run_id"] == "x"
    assert again["updated"] == on_disk["updated"] == first["updated"]


@pytest.mark.parametrize("trainer, cls", [("train_conv", "ConvConfig"), ("train_ep", "EPConfig"),
                                          ("train_cfc_aux", "CfCAuxConfig")])
def test_trainers_name_a_wrong_config_or_run_directory(tmp_path, trainer, cls):
    import lab.train as train
    fn = getattr(train, trainer)
    with pytest.raises(TypeError, match=rf"^{trainer} expects a config of type {cls}, got "
                                        rf"\{{'rule': 'bp'\}} \(dict\); build one with "
                                        rf"{cls}\(\.\.\.\) or lab.config.from_dict\({cls}, "
                                        r"values\)$"):
        fn({"rule": "bp"}, tmp_path / "r")
    (tmp_path / "file").write_text("x")
    config = getattr(train, cls)()
    for bad in (3, "", "  ", ["r"]):
        with pytest.raises(TypeError, match=rf"^{trainer} out_dir={re.escape(repr(bad))}: give "
                                            r"the run directory as a path \(str or "
                                            r"pathlib.Path\), or None"):
            fn(config, bad)
    with pytest.raises(ConfigError, match=rf"^out_dir {tmp_path / 'file'} is a file; give a "
                                          r"directory for the run$"):
        fn(config, tmp_path / "file")
    with pytest.raises(ConfigError, match=rf"^out_dir {tmp_path / 'file' / 'r'}: "
                                          rf"{tmp_path / 'file'} is a file, so the run directory "
                                          r"cannot be made there; choose another path$"):
        fn(config, tmp_path / "file" / "r")


def test_a_run_failed_after_training_gets_its_record_back_on_rerun(tiny, tmp_path):
    """A notebook cell failing after train_conv marks the finished run failed; the rerun
    finds the finished checkpoint and writes the trainer's record back (rows, bill, data)."""
    from lab.notebook import mark_failed

    config = ConvConfig(**{**tiny, "epochs": 2})
    done = train_conv(config, tmp_path / "r")
    mark_failed(tmp_path / "r", "r", {}, "RuntimeError: plot broke")
    assert records.load_record(tmp_path / "r")["status"] == "failed"
    again = train_conv(config, tmp_path / "r")
    on_disk = records.load_record(tmp_path / "r", rows=False)
    assert again["status"] == on_disk["status"] == "complete" and on_disk["error"] is None
    assert on_disk["kind"] == "conv" and on_disk["rows"] == {"epoch": 2}
    assert on_disk["work"] == done["work"] and on_disk["final"] == done["final"]
    assert on_disk["data"] == done["data"]
    assert len(records.load_record(tmp_path / "r")["trajectory"]) == 2


@pytest.mark.parametrize("depth, width, dataset", [(8, 4, "mnist1d"), (20, 16, "cifar10"),
                                                    (14, 3, "digits"), (32, 5, "mnist1d")])
def test_the_weight_count_is_the_built_models(depth, width, dataset):
    from lab.data import DATA_SPECS
    from lab.models import ResNet

    spec = DATA_SPECS[dataset]
    model = ResNet(depth, width, dims=spec.dims, in_channels=spec.in_channels,
                   n_classes=spec.n_classes)
    built = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    assert ResNet.weight_count(depth, width, spec.dims, spec.in_channels,
                               spec.n_classes) == built


def test_a_refused_run_writes_nothing_into_a_data_dir_it_was_given(tmp_path, capsys):
    # The pre-check counted MNIST-1D's training set by generating it, and cached it (with
    # the directories) in the data_dir of a run it then refused.
    data = tmp_path / "newdata"
    assert cli_main(["train", "--out", str(tmp_path / "r"), "-p", "data_dir", str(data),
                     "-p", "alignment_every", "1", "-p", "alignment_batch", "100000"]) == 2
    assert "ConvConfig.alignment_batch=100000 but the training set has only 3600 examples" \
        in capsys.readouterr().err
    assert not data.exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("field, value", [("width", 2**63 - 1), ("depth", 999999998)])
def test_a_model_larger_than_the_machine_is_refused_before_it_is_built(
        tmp_path, capsys, field, value):
    # width=2**63-1 died in torch ("Storage size calculation overflowed"), with a traceback;
    # depth=999999998 hung while the model was built.
    config = ConvConfig(**{field: value}, epochs=1)
    with pytest.raises(ConfigError, match=rf"^ConvConfig: a ResNet-{config.depth} of width "
                       rf"{config.width} on mnist1d has .* weights, which with their gradients, "
                       r"momentum and feedback in float32 need at least .* GiB, more than "
                       r"this machine's .* GiB; give a smaller depth or width"):
        config.preflight()
    assert cli_main(["train", "--out", str(tmp_path / "r"), "-p", field, str(value),
                     "-p", "epochs", "1"]) == 2
    assert "more than this machine's" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    ConvConfig(depth=110, width=64, epochs=1).preflight()  # large, but it fits


def test_a_rule_returning_no_step_result_is_named(tiny, tmp_path):
    # A custom rule returning None failed on "'NoneType' object has no attribute 'loss'".
    from lab.rules.bp import Backprop
    from lab.rules.registry import register

    @register
    class ReturnsNothing(Backprop):
        name = "returns_nothing_test"

        def compute_gradients(self, x, y, step, record=False):
            super().compute_gradients(x, y, step, record)

    try:
        with pytest.raises(TypeError, match=r"^rule 'returns_nothing_test': ReturnsNothing."
                                            r"compute_gradients returned NoneType; it must "
                                            r"write .grad and return a StepResult"):
            train_conv(ConvConfig(**{**tiny, "epochs": 1, "rule": "returns_nothing_test"}),
                       tmp_path / "r")
    finally:
        RULES.pop("returns_nothing_test", None)


def test_a_resume_in_another_environment_is_said_and_kept(tiny, tmp_path, monkeypatch):
    # Half a run on 2 threads, resumed on 1: the record said 1 for the whole run, silently.
    config = ConvConfig(**{**tiny, "epochs": 3})
    _interrupt_at(1, monkeypatch, config, tmp_path / "r")
    first = records.load_record(tmp_path / "r", rows=False)["environment"]
    real = records.environment

    def other_threads(device=None):
        return {**real(device), "threads": first["threads"] + 1}

    monkeypatch.setattr(records, "environment", other_threads)
    with pytest.warns(UserWarning, match=rf"resumed after 1 epoch\(s\) in another environment "
                                         rf"\(threads: {first['threads']} there vs "
                                         rf"{first['threads'] + 1} now\): from here on the rows "
                                         r"may differ .* environment.earlier_sessions"):
        done = train_conv(config, tmp_path / "r")
    env = records.load_record(tmp_path / "r", rows=False)["environment"]
    assert done["status"] == "complete" and env["threads"] == first["threads"] + 1
    assert env["earlier_sessions"] == [first]
    # a resume in the same environment as before says nothing and keeps what is known
    monkeypatch.setattr(records, "environment", real)
    config2 = ConvConfig(**{**tiny, "epochs": 3})
    _interrupt_at(2, monkeypatch, config2, tmp_path / "s")
    import warnings as _w

    with _w.catch_warnings():
        _w.simplefilter("error", UserWarning)
        _w.filterwarnings("ignore", message=".*warmup_fraction.*")
        train_conv(config2, tmp_path / "s")
    assert "earlier_sessions" not in records.load_record(tmp_path / "s", rows=False)["environment"]
