"""The CfC-aux trainer (lab.train.cfc_aux): gradient routing at the encoder against plain
autograd, separate optimizers, the lift and its window, the constant-signal run, resume; then
exact oracles (float64 losses and accuracies from their definitions, the health EMAs update by
update, a hand replay of the loop, the record's final metrics and bill, the checkpoint)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from analysis import find_problems
from lab import records
from lab.config import ConfigError
from lab.data import DataError
from lab.data.prices import MultiHorizonLoader, synthetic_prices, vega_prices
from lab.rules import aux_lift
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
    added, real_add = [], aux_lift.aux_add  # numba_kernels.aux_add when installed

    def spy(dst, src):
        added.append(tuple(dst.shape))
        return real_add(dst, src)

    monkeypatch.setattr(aux_lift, "aux_add", spy)
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
    assert aux_lift.aux_add(dst, src) is dst and torch.equal(dst, expected)
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


def test_resume_equals_an_uninterrupted_run(tmp_path, train_steps):
    config = _config(steps=12, checkpoint_every=5, lift_huber=50.0, lift_acc=0.0, lift_window=0)
    whole = train_cfc_aux(config)
    train_steps(cfc_aux, stop_at=8)
    with pytest.raises(KeyboardInterrupt):
        train_cfc_aux(config, tmp_path / "run")
    train_steps(cfc_aux)
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
    health = aux_lift.AuxHealth(2, decay=0.9)
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
    fresh = aux_lift.AuxHealth(2, decay=0.9)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


# --- Oracles that pin exact numbers, wiring and the record (issue 15, mutation testing) ----------


def test_csv_source_needs_both_the_file_and_the_column(tmp_path):
    for kw in (dict(csv_path="p.csv"), dict(column="close"), {}):
        with pytest.raises(ConfigError, match=r"^CfCAuxConfig\.source='csv' needs csv_path "
                                              r"\(the file\) and column \(the price column\)"):
            CfCAuxConfig(source="csv", **kw)
    (tmp_path / "p.csv").write_text("close\n1\n")
    assert CfCAuxConfig(source="csv", csv_path=str(tmp_path / "p.csv"),
                        column="close").column == "close"


def test_load_prices_passes_every_source_setting(tmp_path):
    config = CfCAuxConfig(source="synthetic", synthetic="regimes", synthetic_length=321,
                          drift=0.003, volatility=0.02, regime_length=7, seed=5)
    prices, name = cfc_aux.load_prices(config)
    expected = synthetic_prices("regimes", length=321, drift=0.003, volatility=0.02,
                                regime_length=7, seed=5)
    np.testing.assert_array_equal(prices, expected)
    assert name == "synthetic regimes"
    prices, name = cfc_aux.load_prices(CfCAuxConfig(source="vega", symbol="IBM"))
    np.testing.assert_array_equal(prices, vega_prices("IBM"))
    assert name == "vega_datasets stocks IBM"
    path = tmp_path / "p.csv"
    path.write_text("close\n1\n2\n4\n")
    prices, name = cfc_aux.load_prices(CfCAuxConfig(source="csv", csv_path=str(path),
                                                    column="close"))
    np.testing.assert_array_equal(prices, [1.0, 2.0, 4.0])
    assert name == f"{path}:close"


def test_run_data_is_the_loader_built_from_the_config():
    config = _config(val_fraction=0.5)
    run = build_run(config)
    prices, _ = cfc_aux.load_prices(config)
    ref = MultiHorizonLoader(prices, window=6, seq_len=5, horizons=(1, 3, 8), main_horizon=3,
                             val_fraction=0.5)
    assert torch.equal(run.data.train_ends, ref.train_ends)
    assert torch.equal(run.data.val_ends, ref.val_ends)
    for field in ("features", "long", "short", "direction"):
        assert torch.equal(getattr(run.data, field), getattr(ref, field))
    # The loader knows the series by its source's name (it is in the loader's errors).
    with pytest.raises(DataError, match=r"^synthetic random_walk has 20 prices, too short"):
        build_run(_config(synthetic_length=20))


def test_build_run_puts_data_and_every_module_on_the_resolved_device(monkeypatch):
    # 'meta' stands in for an accelerator: nothing may stay on the CPU default.
    monkeypatch.setattr(cfc_aux, "resolve_device", lambda name: torch.device("meta"))
    run = build_run(_config())
    assert run.device.type == "meta"
    for field in ("features", "long", "short", "direction"):
        assert getattr(run.data, field).device.type == "meta"
    for module in (run.encoder, run.main, run.aux):
        assert all(p.device.type == "meta" for p in module.parameters())
        assert all(b.device.type == "meta" for b in module.buffers())


def test_optimizers_read_their_learning_rates_from_the_config():
    run = build_run(_config(lr=2.5e-3, aux_lr=7e-4))
    assert [g["lr"] for g in run.opt_main.param_groups] == [2.5e-3]
    assert [g["lr"] for g in run.opt_aux.param_groups] == [7e-4]
    for opt in (run.opt_main, run.opt_aux):  # plain Adam: torch's defaults but the lr
        assert type(opt) is torch.optim.Adam and len(opt.param_groups) == 1
        group = opt.param_groups[0]
        assert (group["betas"], group["eps"], group["weight_decay"], group["amsgrad"]) == \
            ((0.9, 0.999), 1e-8, 0, False)


def test_encoder_is_two_linear_tanh_layers():
    torch.manual_seed(0)
    enc = cfc_aux.Encoder(6, 8).double()
    first, second = [m for m in enc.net if isinstance(m, torch.nn.Linear)]
    assert first.weight.shape == (8, 6) and second.weight.shape == (8, 8)
    x = torch.randn(3, 5, 6, dtype=torch.float64)  # (B, T, window)
    expected = torch.tanh(torch.tanh(x @ first.weight.T + first.bias) @ second.weight.T
                          + second.bias)
    torch.testing.assert_close(enc(x), expected, rtol=1e-12, atol=0)


def test_trunks_and_heads_follow_the_config():
    config = _config(mode="pure", activation="silu", backbone_units=7)
    run = build_run(config)
    for trunk, units in ((run.main.trunk, 12), (run.aux.trunk, 10)):
        cell = trunk.cell
        assert (cell.mode, cell.activation) == ("pure", "silu")
        assert (cell.input_size, cell.hidden_size) == (8, units)
        assert cell.backbone[0].out_features == 7 and cell.heads.in_features == 7
    assert (run.main.head.in_features, run.main.head.out_features) == (12, 1)
    assert (run.aux.heads.in_features, run.aux.heads.out_features) == (10, 6)
    default = build_run(_config()).main.trunk.cell
    assert (default.mode, default.activation) == ("default", "lecun_tanh")


def _huber(d, delta):
    a = d.abs()
    return torch.where(a <= delta, 0.5 * d**2, delta * (a - 0.5 * delta))


def test_forward_losses_match_a_direct_float64_computation():
    """Huber (own delta, both branches), BCE and the direction accuracy, with ties."""
    run = build_run(_config(huber_delta=0.05))
    for module in (run.encoder, run.main, run.aux):
        module.double()
    b = run.data.sample(16, torch.Generator().manual_seed(3))
    long_t, short_t = b.long.double(), b.short.double().clone()
    short_t[:5] = long_t[:5]  # outcome ties: long > short is False there
    with torch.no_grad():  # prediction ties on the first horizon: both heads the same row
        run.aux.heads.weight[3] = run.aux.heads.weight[0]
        run.aux.heads.bias[3] = run.aux.heads.bias[0]
    batch = SimpleNamespace(x=b.x.double(), long=long_t, short=short_t,
                            direction=b.direction.double())
    out = forward_losses(run, batch, lifted=False)

    e = run.encoder(batch.x)
    z = run.main.head(run.main.trunk(e)[1])[:, 0]
    y = run.aux.heads(run.aux.trunk(e)[1])
    long_p, short_p = y[:, :3], y[:, 3:]
    assert torch.equal(long_p[:, 0], short_p[:, 0]) and (long_t[:5] == short_t[:5]).all()
    d = torch.cat([long_p - long_t, short_p - short_t])
    assert (d.abs() < 0.05).any() and (d.abs() > 0.05).any()  # both Huber branches
    per_h = 0.5 * (_huber(long_p - long_t, 0.05) + _huber(short_p - short_t, 0.05)).mean(0)
    torch.testing.assert_close(out["aux_huber"], per_h.detach(), rtol=1e-10, atol=0)
    torch.testing.assert_close(out["aux_loss"], per_h.sum(), rtol=1e-10, atol=0)
    p = torch.sigmoid(z)
    bce = -(batch.direction * p.log() + (1 - batch.direction) * (1 - p).log()).mean()
    torch.testing.assert_close(out["loss"], bce, rtol=1e-10, atol=0)
    torch.testing.assert_close(out["logits"], z, rtol=1e-12, atol=0)
    acc = ((long_p > short_p) == (long_t > short_t)).double().mean(0)
    assert out["aux_acc"].tolist() == acc.tolist()
    assert acc[0] == (long_t[:, 0] <= short_t[:, 0]).double().mean()  # the tie counts as "not >"


def test_health_first_update_takes_the_value_exactly():
    health = aux_lift.AuxHealth(3, decay=0.95)
    health.update([0.1, 0.7, 2.3], [0.3, 0.0625, 0.9])
    assert health.huber == [0.1, 0.7, 2.3] and health.acc == [0.3, 0.0625, 0.9]
    assert health.updates == 1 and not health.lifted and health.lift_step is None


def _preview(run):
    """The aux Huber and accuracy of the batch the next train_step draws (same params)."""
    state = run.generator.get_state()
    batch = run.data.sample(run.config.batch_size, run.generator)
    run.generator.set_state(state)
    out = forward_losses(run, batch, False)
    return out["aux_huber"].tolist(), out["aux_acc"].tolist(), batch


def test_train_step_row_is_recomputed_from_its_batch(monkeypatch):
    run = build_run(_config())
    with torch.no_grad():
        run.main.head.bias.fill_(0.5)  # logits near 0.5: some in (0, 1), so "> 0" is tested
    seen = []
    real = cfc_aux.forward_losses

    def spy(r, batch, lifted):
        seen.append((batch, real(r, batch, lifted)))
        return seen[-1][1]

    monkeypatch.setattr(cfc_aux, "forward_losses", spy)
    huber, acc, _ = _preview(run)
    seen.clear()
    row = train_step(run, 0)
    (batch, out), = seen
    z = out["logits"].detach()
    assert ((z > 0) & (z < 1)).any()
    assert row["train_acc"] == float(((z > 0).float() == batch.direction).float().mean())
    assert 0 < row["train_acc"] < 1 and row["train_acc"] != 0.5
    assert row["train_loss"] == float(F.binary_cross_entropy_with_logits(z, batch.direction))
    # First update: the EMAs are this batch's values exactly.
    assert list(row["aux_huber_ema"].values()) == huber
    assert list(row["aux_acc_ema"].values()) == acc
    # A zero head gives logits of exactly 0: predicted "down" for all (0 is not > 0).
    with torch.no_grad():
        run.main.head.weight.zero_()
        run.main.head.bias.zero_()
    seen.clear()
    row = train_step(run, 1)
    (batch, out), = seen
    assert torch.equal(out["logits"].detach(), torch.zeros(16))
    assert 0 < batch.direction.mean() < 1 and batch.direction.mean() != 0.5
    assert row["train_acc"] == float((batch.direction == 0).float().mean())


def test_lift_window_is_exclusive_and_the_lift_irreversible():
    config = _config(lift_huber=50.0, lift_acc=0.0, lift_window=4)
    run = build_run(config)
    row = train_step(run, 4)  # healthy, but step 4 is outside a window of 4 steps (0..3)
    assert min(row["aux_acc_ema"].values()) > 0.0
    assert row["lifted"] == 0 and row["lift_step"] is None and not run.health.lifted
    row = train_step(run, 3)
    assert row["lifted"] == 1 and row["lift_step"] == 3
    run.config = dataclasses.replace(config, lift_huber=1e-9, lift_acc=0.999)  # never healthy
    row = train_step(run, 2)
    assert row["lifted"] == 1 and row["lift_step"] == 3 and run.health.lifted


def test_lift_thresholds_are_strict():
    """Huber EMA < lift_huber and accuracy EMA > lift_acc: equality does not lift."""
    config = _config(lift_window=0)
    run = build_run(config)
    huber, acc, _ = _preview(run)
    run.config = dataclasses.replace(config, lift_huber=max(huber), lift_acc=0.0)
    assert train_step(run, 0)["lifted"] == 0
    run = build_run(config)
    run.config = dataclasses.replace(config, lift_huber=2 * max(huber), lift_acc=min(acc))
    assert train_step(run, 0)["lifted"] == 0
    run = build_run(config)  # just inside both bounds: it lifts
    run.config = dataclasses.replace(config, lift_huber=max(huber) * (1 + 1e-6),
                                     lift_acc=min(acc) - 1e-6)
    row = train_step(run, 0)
    assert row["lifted"] == 1 and row["lift_step"] == 0


# --- the lift's accuracy arm (issue 36): the Huber arm alone must not lift -------------------


def _crafted_rows(monkeypatch, huber, acc, **kw):
    """A run whose aux signals per step are the given (steps x horizons) values: the real
    forward pass, with its aux Huber and accuracy replaced before the trainer's EMAs and lift
    decision read them (default thresholds: Huber EMA < 0.4, accuracy EMA > 0.85)."""
    real, step = cfc_aux.forward_losses, iter(range(len(huber)))

    def crafted(run, batch, lifted):
        out, s = real(run, batch, lifted), next(step)
        # float64: 0.85 itself, not float32's 0.85000002 (which is above the threshold)
        out["aux_huber"], out["aux_acc"] = (torch.tensor(v[s], dtype=torch.float64)
                                            for v in (huber, acc))
        return out
    monkeypatch.setattr(cfc_aux, "forward_losses", crafted)
    return train_cfc_aux(_config(steps=len(huber), eval_every=0, **kw))["steps"]


def _first_healthy(rows, config):
    """The first step < lift_window at which every recorded EMA is past its threshold (the
    lift rule read off the rows, apart from the trainer's own decision), or None."""
    window = config.lift_window or len(rows)
    return next((s for s, r in enumerate(rows[:window])
                 if all(v < config.lift_huber for v in r["aux_huber_ema"].values())
                 and all(v > config.lift_acc for v in r["aux_acc_ema"].values())), None)


@pytest.mark.parametrize("acc", [(0.8, 0.84, 0.5), (1.0, 0.85, 1.0)],
                         ids=["all-below", "one-at-the-threshold"])
def test_no_lift_while_only_the_huber_arm_holds(monkeypatch, acc):
    """Huber EMA 0.1 on every horizon from step 0; accuracy EMAs constant, all below 0.85 or
    one exactly at it (strict: not above): the lift never fires."""
    rows = _crafted_rows(monkeypatch, [[0.1, 0.1, 0.1]] * 30, [list(acc)] * 30)
    config = _config()
    assert (config.lift_huber, config.lift_acc, config.lift_window) == (0.4, 0.85, 200)
    for r in rows:  # a constant input keeps its EMA exactly at that constant
        assert list(r["aux_huber_ema"].values()) == [0.1] * 3
        assert list(r["aux_acc_ema"].values()) == list(acc)
    assert all(r["lifted"] == 0 and r["lift_step"] is None for r in rows)


def test_lift_fires_at_the_step_the_accuracy_crosses_last(monkeypatch):
    """Raw signals whose EMAs (plain averages over the first 20 updates at decay 0.95) are
    computed by hand: Huber [1, 0, 0, ...] on h1 averages 1/n, below 0.4 from update 3
    (step 2); accuracy [0, 1, 1, ...] on h3 averages (n-1)/n, above 0.85 from update 7
    (6/7 = 0.857; 5/6 = 0.833), and [0.5, 1, ...] on h8 from update 4. So the Huber arm
    holds from step 2 and the accuracy arm from step 6: the lift fires at step 6 exactly."""
    n = 12
    huber = [[1.0 if s == 0 else 0.0, 0.1, 0.1] for s in range(n)]
    acc = [[1.0, 0.0 if s == 0 else 1.0, 0.5 if s == 0 else 1.0] for s in range(n)]
    rows = _crafted_rows(monkeypatch, huber, acc)
    config = _config()
    huber_arm = [all(v < 0.4 for v in r["aux_huber_ema"].values()) for r in rows]
    acc_arm = [all(v > 0.85 for v in r["aux_acc_ema"].values()) for r in rows]
    assert huber_arm.index(True) == 2 and all(huber_arm[2:])
    assert acc_arm.index(True) == 6 and all(acc_arm[6:])
    assert rows[5]["aux_acc_ema"]["h3"] == pytest.approx(5 / 6, abs=1e-12)
    assert rows[6]["aux_acc_ema"]["h3"] == pytest.approx(6 / 7, abs=1e-12)
    assert _first_healthy(rows, config) == 6
    assert [r["lifted"] for r in rows] == [int(s >= 6) for s in range(n)]
    assert all(r["lift_step"] == (6 if s >= 6 else None) for s, r in enumerate(rows))


@pytest.mark.parametrize("drift", [0.01, 0.005])
def test_lift_of_a_trained_aux_path_waits_for_its_accuracy(drift):
    """Unforced training on a drifting random walk (default thresholds): the aux Huber EMA
    falls below 0.4 well before the direction-accuracy EMA passes 0.85 (drift 0.01) or while
    it never does (drift 0.005). The lift fires exactly at the first step where both arms
    hold, read off the recorded EMAs, with the Huber arm already holding the step before;
    or never."""
    config = _config(synthetic="random_walk", drift=drift, steps=150, eval_every=0)
    rows = train_cfc_aux(config)["steps"]
    huber_arm = [all(v < config.lift_huber for v in r["aux_huber_ema"].values()) for r in rows]
    acc_arm = [all(v > config.lift_acc for v in r["aux_acc_ema"].values()) for r in rows]
    expected = _first_healthy(rows, config)
    assert any(huber_arm), "the Huber arm never held: the case tests nothing"
    if drift == 0.005:
        assert expected is None and not any(acc_arm)
        assert all(r["lifted"] == 0 and r["lift_step"] is None for r in rows)
        return
    assert expected is not None and expected > huber_arm.index(True)
    assert huber_arm[expected - 1] and not acc_arm[expected - 1]  # the accuracy crossed last
    assert rows[-1]["lift_step"] == expected
    assert [r["lifted"] for r in rows] == [int(s >= expected) for s in range(len(rows))]


def test_expectation_without_periodic_validation():
    expect = cfc_aux.expectation(_config(eval_every=0))
    assert expect.periodic == () and expect.final == ("val_loss", "val_acc")
    assert cfc_aux.expectation(_config()).final == ("val_loss", "val_acc")
    rows = train_cfc_aux(_config(eval_every=0, steps=3))["steps"]
    assert all(r["val_loss"] is None and r["val_acc"] is None for r in rows)


def test_record_holds_the_run_its_final_metrics_and_bill(tmp_path, capsys):
    config = _config(steps=7, eval_every=3, progress=True, lift_huber=50.0, lift_acc=0.0,
                     lift_window=0)
    start = time.perf_counter()
    record = train_cfc_aux(config, tmp_path / "r", run_id="my-run")
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    rows = record["steps"]
    assert record["run_id"] == "my-run" and record["kind"] == "cfc_aux"
    assert record["environment"]["device"] == "cpu" and record["status"] == "complete"
    # The progress bar: its label and the last row's loss and lift state.
    assert "cfc-aux lift seed 0" in err
    assert f"lifted=1, loss={rows[-1]['train_loss']:.3f}]" in err  # tqdm sorts the keys
    for r in rows:  # validated on the cadence (steps 2, 5) and at the last step (6)
        if (r["step"] + 1) % 3 and r["step"] != 6:
            assert r["val_loss"] is None and r["val_acc"] is None
        else:
            assert r["val_loss"] is not None and r["val_acc"] is not None
    assert record["work"]["optimizer_steps"] == 7
    assert record["work"]["train_examples"] == 7 * 16
    assert 0 < record["work"]["train_wall_s"] < elapsed
    # Final metrics recomputed from the checkpointed model; the checkpoint names every part.
    ckpt = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    assert set(ckpt["parts"]) == {"encoder", "main", "opt_main", "health", "generator", "aux",
                                  "opt_aux"}
    run = build_run(config)
    assert ckpt["baseline"] == cfc_aux.initial_loss(run) == rows[0]["train_loss"]
    run.encoder.load_state_dict(ckpt["parts"]["encoder"])
    run.main.load_state_dict(ckpt["parts"]["main"])
    final = record["final"]
    with torch.no_grad():  # every validation example, computed here from the definition
        val = run.data.validation()
        z = run.main(run.encoder(val.x)).double()
        p, y = torch.sigmoid(z), val.direction.double()
        val_loss = float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())
        hits, ups = int(((z > 0).double() == y).sum()), int(y.sum())
    n = len(val.direction)
    assert n == len(run.data.val_ends) > 1
    assert final["val_loss"] == pytest.approx(val_loss, rel=1e-6)
    # Exact fractions of the validation examples (not float32 means).
    assert final["val_acc"] == hits / n and final["val_up_fraction"] == ups / n
    assert final["lifted"] == 1 and final["lift_step"] == 0 == rows[-1]["lift_step"]
    assert ckpt["parts"]["health"]["lifted"] and ckpt["parts"]["health"]["updates"] == 7
    # No aux path: the bar says lifted=0; progress=False: no bar at all.
    none = train_cfc_aux(_config(aux="none", steps=2, progress=True))
    err = capsys.readouterr().err
    assert "cfc-aux none seed 0" in err
    assert f"lifted=0, loss={none['steps'][-1]['train_loss']:.3f}]" in err
    train_cfc_aux(_config(steps=2))
    assert "cfc-aux" not in capsys.readouterr().err


def _interrupt_at(monkeypatch, step):
    real = cfc_aux.train_step

    def interrupted(run, s):
        if s == step:
            raise KeyboardInterrupt
        return real(run, s)

    monkeypatch.setattr(cfc_aux, "train_step", interrupted)
    return real


def test_checkpoint_cadence_and_the_resumed_divergence_baseline(tmp_path, monkeypatch):
    config = _config(steps=8, checkpoint_every=3)
    real = _interrupt_at(monkeypatch, 5)
    with pytest.raises(KeyboardInterrupt):
        train_cfc_aux(config, tmp_path / "a")
    assert torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["rows"] == 3
    # Resumed after one row: the baseline stays the loss at initialisation, not the loss of
    # the resumed model.
    config = _config(steps=4, checkpoint_every=1)
    whole = train_cfc_aux(config)
    _interrupt_at(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        train_cfc_aux(config, tmp_path / "b")
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["rows"] == 1
    monkeypatch.setattr(cfc_aux, "train_step", real)
    resumed = train_cfc_aux(config, tmp_path / "b")
    assert resumed["steps"] == whole["steps"]
    baseline = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["baseline"]
    assert baseline == whole["steps"][0]["train_loss"]


def test_divergence_uses_the_configured_factor():
    config = _config(diverge_factor=1.05, eval_every=0)
    record = train_cfc_aux(config)
    rows = record["steps"]
    base = rows[0]["train_loss"]
    over = [i for i, r in enumerate(rows) if r["train_loss"] > 1.05 * base]
    assert over, "the test needs a batch loss above 1.05 x the first"
    assert record["status"] == "diverged" and len(rows) == over[0] + 1
    assert "exceeds 1.05 x the loss at initialisation" in record["error"]


def test_a_non_finite_validation_loss_stops_the_run(monkeypatch):
    monkeypatch.setattr(cfc_aux, "evaluate", lambda run: {"val_loss": float("nan"),
                                                          "val_acc": 0.5})
    record = train_cfc_aux(_config(steps=6, eval_every=2))
    assert record["status"] == "diverged" and len(record["steps"]) == 2
    assert "non-finite evaluation loss val_loss=nan at step 1" in record["error"]


def test_the_training_loop_is_train_step_then_evaluate():
    """A replay by hand (build_run, train_step per step, evaluate after every eval_every-th
    update and the last) gives exactly the recorded rows and final metrics."""
    config = _config(steps=9, eval_every=4, lift_huber=50.0, lift_acc=0.0, lift_window=0)
    record = train_cfc_aux(config)
    run = build_run(config)
    for step, logged in enumerate(record["steps"]):
        row = train_step(run, step)
        if (step + 1) % 4 == 0 or step == 8:
            row.update(cfc_aux.evaluate(run))
            assert row["val_loss"] is not None
        else:
            row.update(val_loss=None, val_acc=None)
        assert logged == {"step": step, **row}
    final = record["final"]
    assert {k: final[k] for k in ("val_loss", "val_acc")} == cfc_aux.evaluate(run)
    assert (final["lifted"], final["lift_step"]) == (1, 0)
    assert len(record["steps"]) == 9


def test_the_lift_takes_effect_from_the_next_step(monkeypatch):
    """forward_losses is called with lifted=False up to and including the lift step, True
    after it: the lift decided at step s joins the gradients from step s + 1."""
    seen = []
    real = cfc_aux.forward_losses
    monkeypatch.setattr(cfc_aux, "forward_losses",
                        lambda run, batch, lifted: seen.append(lifted) or real(run, batch, lifted))
    rows = train_cfc_aux(CfCAuxConfig(**{**CONSTANT, "steps": 60, "eval_every": 0}))["steps"]
    fired = rows[-1]["lift_step"]
    assert fired is not None and 0 < fired < 59
    assert seen == [step > fired for step in range(60)]
    assert [r["lifted"] for r in rows] == [int(step >= fired) for step in range(60)]
    assert all(r["lift_step"] == (fired if step >= fired else None)
               for step, r in enumerate(rows))


def test_health_emas_equal_the_running_rule_update_by_update():
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(40, 4, generator=gen, dtype=torch.float64).tolist()
    health = aux_lift.AuxHealth(2, decay=0.8)
    huber, acc = [0.0, 0.0], [0.0, 0.0]
    for n, (h0, h1, a0, a1) in enumerate(values, start=1):
        health.update([h0, h1], [a0, a1])
        rate = max(1 - 0.8, 1 / n)  # plain averages for n <= 5, then decay 0.8
        huber = [m + rate * (v - m) for m, v in zip(huber, (h0, h1))]
        acc = [m + rate * (v - m) for m, v in zip(acc, (a0, a1))]
        assert health.huber == huber and health.acc == acc and health.updates == n
        if n == 5:  # after 5 updates (rate 1/n each) the EMA is the plain mean
            mean = [sum(v[i] for v in values[:5]) / 5 for i in range(2)]
            assert health.huber == pytest.approx(mean, rel=1e-12)


# --- trial-epcfc findings: data identity, the split, seeds, wall time over sessions ----------


def _csv(path, seed: int, n: int = 300) -> None:
    prices = synthetic_prices("random_walk", length=n, drift=0.0005, volatility=0.02, seed=seed)
    path.write_text("close\n" + "\n".join(f"{p:.6f}" for p in prices) + "\n")


def test_relative_csv_path_is_made_absolute_and_a_missing_one_refused(tmp_path, monkeypatch):
    _csv(tmp_path / "p.csv", 0)
    monkeypatch.chdir(tmp_path)
    config = CfCAuxConfig(source="csv", csv_path="p.csv", column="close")
    assert config.csv_path == str(tmp_path / "p.csv")
    # It builds (a config naming a file that exists only on the cluster its runs were made
    # on still lists them); it cannot start.
    gone = CfCAuxConfig(source="csv", csv_path="gone.csv", column="close")
    with pytest.raises(ConfigError) as err:
        gone.preflight()
    assert str(err.value) == (f"CfCAuxConfig.csv_path={str(tmp_path / 'gone.csv')!r} does not "
                              "exist or is not a file; expected a CSV file with a header row "
                              "naming column='close'")


def test_resume_on_a_changed_csv_is_refused_and_the_record_names_the_data(tmp_path,
                                                                         monkeypatch):
    import hashlib

    from lab.lifecycle import CheckpointError

    path = tmp_path / "p.csv"
    _csv(path, 0)
    config = _config(source="csv", csv_path=str(path), column="close", steps=12,
                     checkpoint_every=5, eval_every=0)
    _interrupt_at(monkeypatch, 8)
    with pytest.raises(KeyboardInterrupt):
        train_cfc_aux(config, tmp_path / "run")
    monkeypatch.undo()
    raw = path.read_bytes()
    data = records.load_record(tmp_path / "run")["data"]
    loader = build_run(config).data
    assert data == {"csv": {"path": str(path), "size": len(raw),
                            "sha256": hashlib.sha256(raw).hexdigest()},
                    "split": {"n_train": len(loader.train_ends), "n_val": len(loader.val_ends),
                              "val_fraction": len(loader.val_ends) / (
                                  len(loader.train_ends) + len(loader.val_ends))}}
    # One digit of the last price changed: same size, other content.
    changed = raw[:-2] + (b"1" if raw[-2:-1] != b"1" else b"2") + raw[-1:]
    path.write_bytes(changed)
    with pytest.raises(CheckpointError, match=r"belongs to a run trained on other data "
                                              r"\(csv\.sha256: '[0-9a-f]{64}' there vs "
                                              r"'[0-9a-f]{64}' now\); resuming would mix"):
        train_cfc_aux(config, tmp_path / "run")
    path.write_bytes(raw)
    assert train_cfc_aux(config, tmp_path / "run")["status"] == "complete"


def test_record_holds_the_split_the_loader_made():
    with pytest.warns(UserWarning) as caught:
        record = train_cfc_aux(CfCAuxConfig(source="vega", symbol="GOOG", steps=2,
                                            eval_every=0, progress=False, threads=1,
                                            device="cpu"))
    messages = [str(w.message) for w in caught]
    assert any("val_fraction=0.2 cannot be honoured" in m for m in messages), messages
    assert any("batch_size=32 is more than the 2 training examples" in m for m in messages)
    # GOOG's 68 months at the default window, seq_len and horizons: the clamp gives 2 / 4.
    assert record["data"]["split"] == {"n_train": 2, "n_val": 4, "val_fraction": 4 / 6}


def test_a_vega_run_records_the_series_and_notices_a_change(tmp_path, monkeypatch):
    # The bundled series has no file path to hash: a changed vega_datasets went unnoticed.
    import hashlib

    from lab.data import prices
    from lab.data.identity import changed_files

    goog = prices.vega_prices("GOOG")
    config = CfCAuxConfig(source="vega", symbol="GOOG", steps=2, eval_every=0, progress=False,
                          threads=1, device="cpu", batch_size=2)
    record = train_cfc_aux(config, tmp_path / "run")
    assert record["data"]["vega"] == {
        "vega": "GOOG", "length": 68,
        "sha256": hashlib.sha256(np.asarray(goog, dtype=np.float64).tobytes()).hexdigest()}
    assert changed_files(record["data"]) == []
    monkeypatch.setattr(prices, "vega_prices", lambda symbol: goog * 1.01)
    assert changed_files(record["data"]) == ["vega_datasets stocks (GOOG): other prices (sha256)"]
    monkeypatch.setattr(prices, "vega_prices", lambda symbol: goog[:-1])
    assert changed_files(record["data"]) == ["vega_datasets stocks (GOOG): 68 months then, 67 now"]


def test_seed_is_bounded_by_what_torch_accepts():
    from lab.config import SEED_MAX

    assert _config(seed=SEED_MAX).seed == 2**63 - 1
    with pytest.raises(ConfigError) as err:
        _config(seed=2**64)
    assert str(err.value) == ("CfCAuxConfig.seed=18446744073709551616 is out of range; "
                              "allowed: [0, 9223372036854775807]")


def test_train_wall_time_covers_every_session(tmp_path, train_steps):
    """After a resume, train_wall_s is the whole run's (beside whole-run step counts)."""
    config = _config(steps=6, checkpoint_every=2, eval_every=0)
    train_steps(cfc_aux, stop_at=4, delay=0.1)
    with pytest.raises(KeyboardInterrupt):
        train_cfc_aux(config, tmp_path / "run")
    train_steps(cfc_aux, delay=0.1)
    record = train_cfc_aux(config, tmp_path / "run")
    assert record["work"]["optimizer_steps"] == 6
    # Six rows of >= 0.1 s; the last session alone ran two (about 0.2 s).
    assert 0.6 <= record["work"]["train_wall_s"] < 60


def test_csv_settings_without_the_csv_source_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^CfCAuxConfig.csv_path='.*missing.csv' / column='' "
                                          r"are read only with source='csv' \(source is "
                                          r"'vega'\)"):
        CfCAuxConfig(source="vega", csv_path=str(tmp_path / "missing.csv"))


@pytest.mark.parametrize("case, message", [
    ("column", "has no column 'price'"),
    ("short", "too short"),
])
def test_a_series_the_run_cannot_use_is_refused_before_a_kernel(tmp_path, capsys, monkeypatch,
                                                                case, message):
    from pathlib import Path

    import lab.notebook
    from lab.cli import main as cli_main

    monkeypatch.setattr(lab.notebook, "_papermill",
                        lambda *a, **k: pytest.fail("a kernel was started"))
    path = tmp_path / "p.csv"
    rows = 2000 if case == "column" else 12
    path.write_text("close\n" + "\n".join(str(100 + i % 7) for i in range(rows)) + "\n")
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "03-train-cfc-aux.ipynb"
    out = tmp_path / "r"
    column = "price" if case == "column" else "close"
    assert cli_main(["run", str(notebook), "--out", str(out), "-p", "source", "csv",
                     "-p", "csv_path", str(path), "-p", "column", column]) == 2
    err = capsys.readouterr().err
    assert "error: CfCAuxConfig: " in err and message in err
    assert not out.exists()


@pytest.mark.parametrize("case, message", [
    ("text", r"not a number: 'abc' at row 0 \(.*text\.csv:price; "),
    ("empty", r"price CSV '.*empty\.csv' is empty \(0 bytes\); expected a header row naming "
              r"the column 'price', then one price per row"),
    ("flat", r".*flat\.csv:price: the validation split does not move: prices 468\.\.584 "),
])
def test_the_trials_bad_csvs_are_refused_before_a_run_naming_the_file(tmp_path, case, message):
    """Trial findings F6 / F7, with the trial's files: the run's pre-check (what ``lab run``
    and a sweep call) refuses each with the data error, not NaN prices or val_acc 1.0."""
    walk = 100 * np.exp(np.cumsum(0.01 * np.random.default_rng(0).standard_normal(600)))
    walk[100:] = walk[100]  # flat after the first 100 prices
    path = tmp_path / f"{case}.csv"
    path.write_text({"text": "date,price\n" + "".join(f"{i},abc\n" for i in range(600)),
                     "empty": "",
                     "flat": "date,price\n" + "".join(f"{i},{v}\n" for i, v in enumerate(walk)),
                     }[case])
    config = CfCAuxConfig(source="csv", csv_path=str(path), column="price")
    with pytest.raises(ConfigError, match=r"^CfCAuxConfig: " + message):
        config.preflight()


# --- trial6 findings F3 and minor notes: an unreachable lift_acc, oversized batches ----------


def test_lift_acc_of_one_is_refused_as_it_could_never_be_passed():
    # The lift needs accuracy EMA > lift_acc, and an accuracy is never above 1.
    with pytest.raises(ConfigError) as err:
        CfCAuxConfig(lift_acc=1.0)
    assert str(err.value) == "CfCAuxConfig.lift_acc=1.0 is out of range; allowed: [0.0, 1.0)"
    assert CfCAuxConfig(lift_acc=0.0).lift_acc == 0.0  # the lower end still allowed
    assert CfCAuxConfig(lift_acc=0.999).lift_acc == 0.999


def test_a_batch_larger_than_the_training_split_warns_naming_both():
    import warnings

    n_train = build_run(_config()).data.split_sizes()["n_train"]
    with pytest.warns(UserWarning) as caught:
        build_run(_config(batch_size=n_train + 1))
    assert [str(w.message) for w in caught] == [
        f"CfCAuxConfig.batch_size={n_train + 1} is more than the {n_train} training examples "
        "of synthetic random_walk: each batch draws examples with replacement, so it repeats "
        f"them; batch_size <= {n_train} draws fewer repeats"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_run(_config(batch_size=n_train))  # every example once, on average: silent


def test_a_synthetic_series_too_long_to_hold_is_refused():
    # 10^12 steps reached numpy's MemoryError (7 TiB) in preflight instead of a message.
    with pytest.raises(ConfigError, match=r"^CfCAuxConfig.synthetic_length=1000000000000 is "
                       r"out of range; allowed: \[2, 1000000\]$"):
        CfCAuxConfig(source="synthetic", synthetic_length=10**12)
    assert CfCAuxConfig(source="synthetic", synthetic_length=10**6).synthetic_length == 10**6


def test_a_vega_symbol_with_another_source_is_refused():
    # Ignored by a csv or synthetic run, yet part of its identity.
    with pytest.raises(ConfigError, match=r"^CfCAuxConfig.symbol='IBM' is read only with "
                       r"source='vega' \(source is 'synthetic'\); leave it at 'all'"):
        CfCAuxConfig(source="synthetic", symbol="IBM")
    assert CfCAuxConfig(source="vega", symbol="IBM").symbol == "IBM"


@pytest.mark.parametrize("field, value", [("units", 10**9), ("batch_size", 10**9),
                                          ("backbone_units", 10**9)])
def test_a_model_larger_than_the_machine_is_refused_before_a_run_starts(
        tmp_path, capsys, field, value):
    # units=10**9 died in torch's allocator after the kernel started, leaving a failed run.
    from lab.cli import main as cli_main

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "03-train-cfc-aux.ipynb"
    config = CfCAuxConfig(**{field: value})
    with pytest.raises(ConfigError, match=rf"^CfCAuxConfig: the encoder and trunks of .*"
                       rf"{field}={value}.* need at least .* GiB, more than this machine's .* "
                       r"GiB; give smaller sizes or batch_size$"):
        config.preflight()
    assert cli_main(["run", str(notebook), "--out", str(tmp_path / "r"),
                     "-p", field, str(value), "-p", "steps", "2"]) == 2
    assert "more than this machine's" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("kwargs", [{}, {"aux": "none"},
                                    {"mode": "pure", "units": 16, "backbone_units": 8}])
def test_the_weight_floor_is_at_most_the_models_weights(kwargs):
    config = CfCAuxConfig(steps=2, **kwargs)
    run = build_run(config)
    parts = (run.encoder, run.main, run.aux)
    count = sum(p.numel() for part in parts if part is not None for p in part.parameters())
    # A lower bound (default mode's heads hold four rows per unit, counted as one), but
    # within a factor of three of the weights, so a memory check on it is no formality.
    assert count / 3 <= config.weight_floor() <= count


def test_the_recorded_csv_hash_is_of_the_prices_trained_on(tmp_path, monkeypatch):
    # As for EP's text: the CSV was read at build time and hashed again at start.
    from lab.data.identity import FileChanged, read_unchanged
    from lab.train import cfc_aux

    path = tmp_path / "p.csv"
    path.write_text("close\n" + "\n".join(f"{100 + (i % 7) * 0.5:.2f}" for i in range(400)))
    ident, text = read_unchanged(path, path.read_text)
    assert ident["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    read = cfc_aux.load_prices

    def read_then_replace(config):
        prices = read(config)
        path.write_text(path.read_text().replace("100.00", "999.99"))
        return prices
    monkeypatch.setattr(cfc_aux, "load_prices", read_then_replace)
    config = cfc_aux.CfCAuxConfig(source="csv", csv_path=str(path), column="close")
    with pytest.raises(FileChanged, match=f"data file {path} changed while this run read it"):
        cfc_aux.build_run(config)


def test_metadata_changes_during_a_read_are_not_content_changes(tmp_path):
    # ctime moves with a chmod, `touch -a` or a hard link made meanwhile: not a new content.
    import os

    from lab.data.identity import file_identity, read_unchanged

    path = tmp_path / "p.csv"
    path.write_text("close\n1\n2\n")

    def read_while_others_look():
        os.chmod(path, 0o600)
        os.link(path, tmp_path / "hard")
        os.utime(path, ns=(1, path.stat().st_mtime_ns))  # atime only
        return path.read_text()
    ident, text = read_unchanged(path, read_while_others_look)
    assert ident == file_identity(path) and text == "close\n1\n2\n"


def test_lift_fires_only_strictly_past_both_bounds_inside_the_window():
    def health(huber, acc):
        h = aux_lift.AuxHealth(2, decay=0.9)
        h.update(huber, acc)
        return h

    on_the_bound = health([0.4, 0.1], [0.9, 0.9])  # a Huber EMA equal to its bound
    on_the_bound.consider_lift(3, 0.4, 0.85, 200)
    assert not on_the_bound.lifted and on_the_bound.lift_step is None
    ready = health([0.39, 0.1], [0.86, 0.9])
    late = health([0.39, 0.1], [0.86, 0.9])
    late.consider_lift(200, 0.4, 0.85, 200)  # the window holds steps 0..199
    assert not late.lifted
    ready.consider_lift(199, 0.4, 0.85, 200)
    assert ready.lifted and ready.lift_step == 199
    ready.update([9.0, 9.0], [0.0, 0.0])  # sick again: the lift is irreversible
    ready.consider_lift(250, 0.4, 0.85, 0)
    assert ready.lifted and ready.lift_step == 199
    no_deadline = health([0.39, 0.1], [0.86, 0.9])
    no_deadline.consider_lift(10**6, 0.4, 0.85, 0)
    assert no_deadline.lift_step == 10**6
