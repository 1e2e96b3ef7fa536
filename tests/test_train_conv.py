"""The conv trainer: reproducibility, resume after SIGKILL, divergence, test-once."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lab import records
from lab.cli import main as cli_main
from lab.rules import RULES, Rule, StepResult
from lab.train import ConvConfig, conv, train_conv
from lab.train.checkpoint import CheckpointError


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
            if path.exists() and len(records.read_json(path)["trajectory"]) >= min_epochs:
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


def test_corrupt_checkpoint_is_named(tiny, tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / conv.CHECKPOINT).write_bytes(b"not a checkpoint")
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


STATEFUL_RULES = ["kp", "wm", "rrm", "brsf", "frsf", "dfa", "nodepert"]


@pytest.mark.parametrize("rule", STATEFUL_RULES)
def test_interrupted_rule_resumes_exactly(tiny, tmp_path, monkeypatch, rule):
    """A crash after epoch 2 and a resume give the uninterrupted record (rule state too)."""
    config = ConvConfig(**{**tiny, "epochs": 4, "alignment_every": 2, "alignment_batch": 32},
                        rule=rule)
    whole = train_conv(config, tmp_path / "whole")
    real = conv._train_epoch

    def crash_at_2(run, epoch, kind):
        if epoch == 2:
            raise KeyboardInterrupt
        return real(run, epoch, kind)

    monkeypatch.setattr(conv, "_train_epoch", crash_at_2)
    with pytest.raises(KeyboardInterrupt):
        train_conv(config, tmp_path / "cut")
    monkeypatch.setattr(conv, "_train_epoch", real)
    resumed = train_conv(config, tmp_path / "cut")
    assert _values(resumed) == _values(whole)
    assert resumed["work"] == whole["work"]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_alignment_and_tracking_trajectories_are_complete(tiny, rule):
    record = train_conv(ConvConfig(**{**tiny, "epochs": 2}, rule=rule, alignment_every=1,
                                   alignment_batch=32))
    assert record["status"] == "complete"
    for row in record["trajectory"]:
        assert set(row["alignment"]["teaching_cos"]) and set(row["alignment"]["update_cos"])
        if rule in ("fa", "kp", "usf", "brsf", "frsf", "wm", "rrm"):
            assert -1 <= row["feedback"]["min_cos"] <= row["feedback"]["mean_cos"] <= 1
    assert record["work"]["macs"]["forward"] == (
        record["work"]["forward_macs_per_example"] * record["work"]["examples"])
