"""The CfC-aux trainer (lab.train.cfc_aux): gradient routing at the encoder against plain
autograd, separate optimizers, the lift and its window, the constant-signal run, resume."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from analysis import find_problems
from lab import records
from lab.config import ConfigError
from lab.data import DataError
from lab.train import cfc_aux
from lab.train.cfc_aux import CfCAuxConfig, build_run, forward_losses, train_cfc_aux, train_step

SMALL = dict(source="synthetic", synthetic="random_walk", synthetic_length=300, window=6,
             seq_len=5, horizons=(1, 3, 8), main_horizon=3, enc_dim=8, units=12, aux_units=10,
             backbone_units=16, batch_size=16, steps=30, eval_every=10, threads=1,
             progress=False, device="cpu")
CONSTANT = dict(source="synthetic", synthetic="constant", drift=0.01, synthetic_length=300,
                steps=200, eval_every=50, threads=1, progress=False, device="cpu")


def _config(**kw):
    return CfCAuxConfig(**{**SMALL, **kw})


def _grads(params):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def _reference(run, batch, *, main: bool, aux: bool):
    """Plain autograd through both paths, no AuxJoin: the encoder output feeds each used path."""
    for p in [*run.encoder.parameters(), *run.main.parameters(), *run.aux.parameters()]:
        p.grad = None
    enc = run.encoder(batch.x)
    loss = 0.0
    if main:
        loss = loss + F.binary_cross_entropy_with_logits(run.main(enc), batch.direction)
    if aux:
        long, short = run.aux(enc)
        per_h = 0.5 * (F.huber_loss(long, batch.long, reduction="none")
                       + F.huber_loss(short, batch.short, reduction="none")).mean(0)
        loss = loss + per_h.sum()
    loss.backward()
    return _grads(run.encoder.parameters()), _grads(run.aux.parameters())


def _ours(run, batch, lifted):
    for p in [*run.encoder.parameters(), *run.main.parameters(), *run.aux.parameters()]:
        p.grad = None
    out = forward_losses(run, batch, lifted)
    (out["loss"] + out["aux_loss"]).backward()
    return _grads(run.encoder.parameters()), _grads(run.aux.parameters())


def test_encoder_gradient_before_and_after_the_lift(monkeypatch):
    run = build_run(_config())
    batch = run.data.sample(16, torch.Generator().manual_seed(1))
    added, real_add = [], cfc_aux.aux_add  # numba_kernels.aux_add when installed

    def spy(dst, src):
        added.append(tuple(dst.shape))
        return real_add(dst, src)

    monkeypatch.setattr(cfc_aux, "aux_add", spy)
    main_only, aux_ref = _reference(run, batch, main=True, aux=True)
    main_only, _ = _reference(run, batch, main=True, aux=False)
    both, _ = _reference(run, batch, main=True, aux=True)
    aux_only, _ = _reference(run, batch, main=False, aux=True)

    before, aux_before = _ours(run, batch, lifted=False)
    assert added == []
    for ours, ref in zip(before, main_only):  # aux contributes exactly zero
        assert torch.equal(ours, ref)
    after, aux_after = _ours(run, batch, lifted=True)
    assert added == [(16, 5, 8)]  # once, on the encoder output (B, T, E)
    for ours, ref in zip(after, both):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-8)
    # The aux part is real, and it is exactly what the aux loss alone sends the encoder.
    diff = [a - b for a, b in zip(after, before)]
    assert max(d.abs().max() for d in diff) > 1e-4
    for d, ref in zip(diff, aux_only):
        torch.testing.assert_close(d, ref, rtol=1e-4, atol=1e-7)
    # The aux trunk and heads train the same way in both states.
    for a, b, c in zip(aux_before, aux_after, aux_ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-9)


def test_aux_add_is_the_kernel(monkeypatch):
    import numba_kernels

    calls = []
    real = numba_kernels.aux_add
    monkeypatch.setattr(numba_kernels, "aux_add", lambda d, s: calls.append(1) or real(d, s))
    dst, src = torch.randn(4, 5, 6), torch.randn(4, 5, 6)
    expected = dst + src
    assert cfc_aux.aux_add(dst, src) is dst and torch.equal(dst, expected)
    assert calls == [1]


def test_aux_optimizer_state_is_separate():
    run = build_run(_config(aux_lr=3e-3))
    main_ids = {id(p) for g in run.opt_main.param_groups for p in g["params"]}
    aux_ids = {id(p) for g in run.opt_aux.param_groups for p in g["params"]}
    assert main_ids == {id(p) for p in [*run.encoder.parameters(), *run.main.parameters()]}
    assert aux_ids == {id(p) for p in run.aux.parameters()}
    assert not main_ids & aux_ids
    assert run.opt_aux.param_groups[0]["lr"] == 3e-3
    assert run.opt_main.param_groups[0]["lr"] == run.config.lr
    train_step(run, 0)
    assert {id(p) for p in run.opt_main.state} == main_ids
    assert {id(p) for p in run.opt_aux.state} == aux_ids
    pointers = lambda opt: {t.data_ptr() for s in opt.state.values()  # noqa: E731
                            for t in s.values() if torch.is_tensor(t) and t.dim()}
    assert not pointers(run.opt_main) & pointers(run.opt_aux)


def test_main_path_is_untouched_by_aux_until_the_lift():
    """'none', 'never' and 'lift' draw the same batches and the same main init: their main
    losses agree exactly until the lift has fired, and differ after it."""
    lift_kw = dict(lift_huber=50.0, lift_acc=0.0, lift_window=0)  # fires at step 0
    none = train_cfc_aux(_config(aux="none", steps=12))["steps"]
    never = train_cfc_aux(_config(aux="never", steps=12))["steps"]
    lift = train_cfc_aux(_config(aux="lift", steps=12, **lift_kw))["steps"]
    assert [r["train_loss"] for r in none] == [r["train_loss"] for r in never]
    assert all(r["lifted"] == 0 and r["lift_step"] is None for r in never)
    assert lift[0]["lifted"] == 1 and lift[0]["lift_step"] == 0
    # Step 0's update is before the lift takes effect; from step 1 on the encoder moves apart.
    assert lift[1]["train_loss"] == never[1]["train_loss"]
    assert lift[5]["train_loss"] != never[5]["train_loss"]
    assert "aux_huber_ema" not in none[0] and "lifted" not in none[0]


def test_constant_signal_converges_and_lifts_inside_the_window():
    record = train_cfc_aux(CfCAuxConfig(**CONSTANT))
    rows = record["steps"]
    last = rows[-1]
    print("constant drift: aux Huber EMA", last["aux_huber_ema"], "direction-acc EMA",
          last["aux_acc_ema"], "lift step", last["lift_step"])
    assert record["status"] == "complete"
    for name, value in last["aux_huber_ema"].items():
        earlier = rows[-30]["aux_huber_ema"][name]
        assert value < 0.05 and value <= earlier  # converged: small and no longer rising
    for value in last["aux_acc_ema"].values():
        assert value == pytest.approx(1.0, abs=1e-3)
    assert last["lifted"] == 1 and 0 <= last["lift_step"] < 200
    fired = last["lift_step"]
    assert rows[fired]["lifted"] == 1 and (fired == 0 or rows[fired - 1]["lifted"] == 0)
    assert all(v < 0.4 for v in rows[fired]["aux_huber_ema"].values())
    assert all(v > 0.85 for v in rows[fired]["aux_acc_ema"].values())
    assert record["final"]["val_acc"] == 1.0


def test_no_lift_after_the_window():
    """A window that closes before the aux path is healthy keeps it blocked for good."""
    rows = train_cfc_aux(CfCAuxConfig(**{**CONSTANT, "steps": 120, "lift_window": 10}))["steps"]
    assert all(r["lifted"] == 0 and r["lift_step"] is None for r in rows)
    last = rows[-1]
    assert all(v < 0.4 for v in last["aux_huber_ema"].values())  # healthy, but too late
    assert all(v > 0.85 for v in last["aux_acc_ema"].values())


def test_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    config = _config(steps=12, checkpoint_every=5, lift_huber=50.0, lift_acc=0.0, lift_window=0)
    whole = train_cfc_aux(config)
    real_step = cfc_aux.train_step

    def interrupted(run, step):
        if step == 8:
            raise KeyboardInterrupt
        return real_step(run, step)

    monkeypatch.setattr(cfc_aux, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_cfc_aux(config, tmp_path / "run")
    monkeypatch.setattr(cfc_aux, "train_step", real_step)
    resumed = train_cfc_aux(config, tmp_path / "run")
    assert resumed["status"] == "complete"
    assert resumed["steps"] == whole["steps"]
    assert resumed["final"] == whole["final"]
    drop = lambda work: {k: v for k, v in work.items() if not k.endswith("wall_s")}  # noqa: E731
    assert drop(resumed["work"]) == drop(whole["work"])
    # What the record declares is what it holds (the analysis' completeness check).
    runs, metrics = records.load_runs(tmp_path), records.load_metrics(tmp_path)
    expect = cfc_aux.expectation(config)
    assert find_problems(runs, metrics, ["run"], expect.metrics, expect.final) == []


def test_expectation_declares_every_logged_metric():
    expect = cfc_aux.expectation(_config(eval_every=10))
    assert expect.axis == "step" and expect.count == 30
    assert set(expect.metrics) == {"train_loss", "train_acc", "aux_huber_ema/", "aux_acc_ema/",
                                   "lifted"}
    assert ("val_acc", 10, 9) in expect.periodic
    rows = train_cfc_aux(_config(eval_every=10))["steps"]
    assert [r["step"] for r in rows if r["val_acc"] is not None] == [9, 19, 29]
    assert set(rows[0]["aux_huber_ema"]) == {"h1", "h3", "h8"}
    assert cfc_aux.expectation(_config(aux="none")).metrics == ("train_loss", "train_acc")


def test_config_refuses_bad_values_by_name():
    with pytest.raises(ConfigError, match=r"horizons=\(5, 1, 20\) are not strictly increasing"):
        CfCAuxConfig(horizons=(5, 1, 20))
    with pytest.raises(ConfigError, match=r"main_horizon=2 is not one of horizons"):
        CfCAuxConfig(main_horizon=2)
    with pytest.raises(ConfigError, match=r"source='csv' needs csv_path"):
        CfCAuxConfig(source="csv")
    with pytest.raises(ConfigError, match=r"main_buckets=3 must divide units=64"):
        CfCAuxConfig(main_buckets=3)
    with pytest.raises(ConfigError, match=r"CfCAuxConfig.aux='maybe' is not allowed"):
        CfCAuxConfig(aux="maybe")
    with pytest.raises(ConfigError, match=r"CfCAuxConfig.lift_acc=1.5 is out of range"):
        CfCAuxConfig(lift_acc=1.5)
    assert CfCAuxConfig(horizons=[1, 5, 20]).horizons == (1, 5, 20)  # YAML / JSON lists


def test_bad_sources_fail_at_build_with_the_data_error(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("close\n1\n2\n")
    with pytest.raises(DataError, match=r"has no column 'price'"):
        build_run(CfCAuxConfig(source="csv", csv_path=str(path), column="price"))
    with pytest.raises(DataError, match=r"too short"):
        build_run(CfCAuxConfig(source="csv", csv_path=str(path), column="close"))


def test_multi_bucket_main_trunk():
    config = _config(main_buckets=3, main_tau_max=27.0)
    buckets = cfc_aux.main_buckets(config)
    assert [b[0] for b in buckets] == [4, 4, 4]
    edges = [tau for b in buckets for tau in b[1:]]
    assert edges == pytest.approx([1.0, 3.0, 3.0, 9.0, 9.0, 27.0])
    run = build_run(config)
    taus = 1 / run.main.trunk.cell.rate
    assert taus[0] == pytest.approx(1.0) and taus[-1] == pytest.approx(27.0, rel=1e-5)
    assert torch.equal(run.aux.trunk.cell.rate, torch.ones(10))  # the aux trunk: one bucket
    assert dataclasses.asdict(config)["main_buckets"] == 3


def test_health_emas_start_as_averages_then_decay():
    health = cfc_aux.AuxHealth(2, decay=0.9)
    health.update([4.0, 1.0], [0.0, 1.0])
    assert health.huber == [4.0, 1.0] and health.acc == [0.0, 1.0]  # the first value as is
    health.update([2.0, 1.0], [1.0, 1.0])
    assert health.huber == [3.0, 1.0] and health.acc == [0.5, 1.0]  # the mean of two
    for _ in range(20):
        health.update([0.0, 1.0], [1.0, 1.0])
    # Past 1 / (1 - decay) = 10 updates the step is 0.1: an exponential average.
    before = health.huber[0]
    health.update([1.0, 1.0], [1.0, 1.0])
    assert health.huber[0] == pytest.approx(0.9 * before + 0.1)
    assert health.huber[1] == 1.0 and health.acc[1] == 1.0  # a constant stays exact
    state = health.state_dict()
    fresh = cfc_aux.AuxHealth(2, decay=0.9)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
