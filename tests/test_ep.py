"""Cascaded EP: the backprop oracle, evaluation counts, the governor, the trainer and its record."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from analysis import find_problems
from lab import records
from lab.config import ConfigError
from lab.device import seeded
from lab.models.transformer import Transformer, language_model_loss
from lab.train import ep as ep_module
from lab.train.ep import (
    EPConfig,
    Governor,
    bp_gradient,
    build_ep,
    ep_gradient,
    expectation,
    gradient_cosines,
    scheduled_beta,
    spectral_norm,
    train_ep,
    train_step,
    work_per_step,
)

V, T, B = 11, 8, 4


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is fastest, and immune to a busy machine's descheduling."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(n_layers=3, dtype=torch.float64, seed=0):
    with seeded(seed):
        return Transformer(V, T, d_model=16, n_layers=n_layers, n_heads=2, mlp_ratio=2,
                           dtype=dtype)


def _batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)


def _tiny(**kw) -> EPConfig:
    """A run of a few seconds on the bundled corpus."""
    args = dict(seq_len=16, d_model=16, n_layers=2, n_heads=2, mlp_ratio=2, steps=6,
                batch_size=4, eval_every=3, eval_batches=2, cosine_every=2, warmup_steps=2,
                checkpoint_every=2, progress=False, threads=1, device="cpu")
    args.update(kw)
    return EPConfig(**args)


# ---------------------------------------------------------------------------
# the oracle: small beta reproduces backprop


@pytest.mark.parametrize("K", [1, 2, 3])
def test_small_beta_reproduces_backprop_for_every_tensor(K):
    model = _model(n_layers=3)
    x, y = _batch()
    bp, bp_loss = bp_gradient(model, x, y)
    ep = ep_gradient(model, x, y, beta=1e-4, K=K)
    cos = gradient_cosines(model, ep.grads, bp)
    names = [name for name, _ in model.named_parameters()]
    assert set(cos) == {"overall", *names}  # no tensor without a direction here
    for name in names:
        assert cos[name] > 0.9999, (name, cos[name])
    # Magnitudes too, not only directions: the EP gradient is BP's, not a multiple of it.
    for name, g_ep, g_bp in zip(names, ep.grads, bp, strict=True):
        assert (g_ep - g_bp).norm() <= 1e-3 * g_bp.norm() + 1e-12, name
    assert ep.free_loss == pytest.approx(bp_loss, rel=1e-12)


def state_cosines(model, x, y, beta: float, K: int) -> list[float]:
    """Per block: cosine of the relaxed residual z_l - f_l(z_{l-1}) with -dCE/dz_l (autograd)."""
    ep = ep_gradient(model, x, y, beta=beta, K=K)
    z = model.embed(x)
    states = []
    for block in model.blocks:
        z = block(z)
        z.retain_grad()
        states.append(z)
    language_model_loss(model.readout(z), y).backward()
    below = [model.embed(x).detach(), *ep.nudged_states[:-1]]
    out = []
    with torch.no_grad():
        for block, zn, zb, zs in zip(model.blocks, ep.nudged_states, below, states, strict=True):
            force, expected = (zn - block(zb)).flatten(), (-beta * y.numel() * zs.grad).flatten()
            out.append((float(torch.nn.functional.cosine_similarity(force, expected, dim=0)),
                        float(force.norm() / expected.norm())))
    return out


def test_relaxed_forces_are_the_backprop_state_gradients():
    """d_l = z_l - f_l(z_{l-1}) at the relaxed states ~ -beta * n * dCE/dz_l, per block."""
    x, y = _batch()
    for K in (1, 2, 3):
        for l, (cos, ratio) in enumerate(state_cosines(_model(n_layers=3), x, y, 1e-4, K)):
            assert cos > 0.9999, (K, l, cos)
            assert ratio == pytest.approx(1.0, abs=1e-3), (K, l, ratio)


def test_large_beta_departs_from_backprop():
    """The oracle can fail: at beta = 1 the cascade is visibly not backprop."""
    model = _model(n_layers=3)
    x, y = _batch()
    bp, _ = bp_gradient(model, x, y)
    ep = ep_gradient(model, x, y, beta=1.0, K=3)
    cos = gradient_cosines(model, ep.grads, bp)
    assert min(v for k, v in cos.items() if k != "overall") < 0.999


# ---------------------------------------------------------------------------
# dedup: what one EP step evaluates


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_block_and_readout_evaluations_per_step(K):
    """Free chain + K rebuilds of L blocks; the top force on rounds 0, 2, 4, ... only.

    Hooks log every block forward ("B") and every read-out ("R") in order, so the log shows
    where the top force was computed: before the rebuilds of even rounds, never of odd ones,
    plus one read-out after the last rebuild for the objective's CE.
    """
    L = 3
    model = _model(n_layers=L)
    log: list[str] = []
    for block in model.blocks:
        block.register_forward_hook(lambda *_: log.append("B"))
    model.head.register_forward_hook(lambda *_: log.append("R"))
    ep = ep_gradient(model, *_batch(), beta=1e-3, K=K)
    rounds = ["R" * (k % 2 == 0) + "B" * L for k in range(K)]
    assert "".join(log) == "B" * L + "".join(rounds) + "R"
    assert log.count("B") == L * (K + 1) == ep.counts["block_forwards"]
    assert log.count("R") == math.ceil(K / 2) + 1 == ep.counts["readouts"]
    assert ep.counts["top_forces"] == math.ceil(K / 2)
    assert ep.counts["input_vjps"] == K * (L - 1)
    # The work bill states the same counts.
    config = EPConfig(n_layers=L, K=K, d_model=16, n_heads=2)
    bill = work_per_step(config, _model(n_layers=L), K)["ep"]
    assert bill["block_forwards"] == ep.counts["block_forwards"]
    assert bill["input_vjps"] == ep.counts["input_vjps"]
    assert bill["readouts"] == ep.counts["readouts"]


def test_odd_rounds_reuse_the_top_force():
    """K = 2 reuses round 0's force; a fresh one at the round-1 states would differ by O(beta^2)."""
    model = _model(n_layers=2)
    x, y = _batch()
    one, two = (ep_gradient(model, x, y, beta=0.5, K=K) for K in (1, 2))
    # With the force reused, the top state's nudge is the same force added to a moved f_L.
    top_force = one.nudged_states[-1] - model.blocks[-1](one.nudged_states[0]).detach()
    reused = two.nudged_states[-1] - model.blocks[-1](two.nudged_states[0]).detach()
    torch.testing.assert_close(reused, top_force, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------
# the governor


def test_skipped_step_leaves_parameters_and_optimizer_state_unchanged():
    run = build_ep(_tiny(drift_bound=1.0, K=3))
    train_step(run, 0)  # a clean step: the optimizer now has moments to protect
    assert run.governor.skipped == 0
    params = {k: v.clone() for k, v in run.model.state_dict().items()}
    opt = {k: {n: t.clone() for n, t in s.items()}
           for k, s in run.optimizer.state_dict()["state"].items()}
    lr_step = run.scheduler.last_epoch
    twin = [p.clone() for p in run.twin.parameters()]
    run.governor.bound = 1e-12  # every drift is now too large
    row = train_step(run, 1)
    assert row["skipped"] == 1 and row["drift"] > 1e-12
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, params[k]), k
    state = run.optimizer.state_dict()["state"]
    assert state.keys() == opt.keys()
    for k, s in state.items():
        for n, t in s.items():
            assert torch.equal(t, opt[k][n]), (k, n)
    assert run.scheduler.last_epoch == lr_step
    assert all(p.grad is None for p in run.model.parameters())
    # The twin is not governed: it stepped on the same batch.
    assert any(not torch.equal(a, b) for a, b in zip(twin, run.twin.parameters(), strict=True))
    # The policy: beta's scale halves and K drops by one, for the next step.
    assert (run.governor.scale, run.governor.K, run.governor.skipped) == (0.5, 2, 1)
    assert train_step(run, 2)["beta"] == pytest.approx(0.5 * run.config.beta)


def test_governor_policy_floors_and_recovery():
    gov = Governor(EPConfig(K=3, drift_bound=0.1, recover_after=2))
    for _ in range(10):
        assert gov.update(0.2) is True
    assert (gov.scale, gov.K, gov.skipped) == (1 / 64, 1, 10)
    assert gov.update(math.nan) is True  # a NaN drift is never clean
    assert gov.update(0.05) is False
    assert (gov.scale, gov.K) == (1 / 64, 1)
    assert gov.update(0.1) is False  # at the bound is clean; 2 clean steps: one step back up
    assert (gov.scale, gov.K) == (1 / 32, 2)
    for _ in range(20):
        gov.update(0.0)
    assert (gov.scale, gov.K) == (1.0, 3)  # never beyond the configured values
    off = Governor(EPConfig(drift_bound=0.0))
    assert off.update(1e9) is False


def test_beta_schedules():
    constant = EPConfig(beta=0.2, steps=11)
    assert [scheduled_beta(constant, s) for s in (0, 5, 10)] == [0.2, 0.2, 0.2]
    cosine = EPConfig(beta=0.2, beta_final=0.02, beta_schedule="cosine", steps=11)
    assert scheduled_beta(cosine, 0) == pytest.approx(0.2)
    assert scheduled_beta(cosine, 5) == pytest.approx(0.11)
    assert scheduled_beta(cosine, 10) == pytest.approx(0.02)


# ---------------------------------------------------------------------------
# bad inputs


@pytest.mark.parametrize("kw, message", [
    (dict(beta=0.0), r"EPConfig.beta=0.0 is out of range; allowed: \(0.0, inf\]"),
    (dict(beta=-0.1), r"EPConfig.beta=-0.1 is out of range; allowed: \(0.0, inf\]"),
    (dict(K=0), r"EPConfig.K=0 is out of range; allowed: \[1, inf\]"),
    (dict(n_layers=0), r"EPConfig.n_layers=0 is out of range; allowed: \[1, inf\]"),
    (dict(d_model=30, n_heads=4), r"EPConfig.d_model=30 is not divisible by n_heads=4"),
    (dict(optimizer="lbfgs"), r"EPConfig.optimizer='lbfgs' is not allowed; choose one of: "
                              r"'adamw', 'adam', 'sgd'"),
])
def test_bad_config_is_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        EPConfig(**kw)


def test_bad_arguments_to_the_gradient_are_refused():
    model = _model()
    x, y = _batch()
    with pytest.raises(ValueError, match=r"beta=0.0 is not allowed; the nudging strength must "
                                         r"be > 0"):
        ep_gradient(model, x, y, beta=0.0, K=1)
    with pytest.raises(ValueError, match=r"K=0 is not allowed; EP needs at least one nudged"):
        ep_gradient(model, x, y, beta=0.1, K=0)


def test_bad_text_file_is_refused_by_the_trainer(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("abc" * 10, encoding="utf-8")
    with pytest.raises(ValueError, match=r"is too short: 30 characters"):
        build_ep(_tiny(text_path=str(path)))


# ---------------------------------------------------------------------------
# diagnostics


def test_spectral_norm_matches_svd():
    w = torch.randn(40, 12, generator=torch.Generator().manual_seed(0))
    assert spectral_norm(w) == pytest.approx(float(torch.linalg.matrix_norm(w, ord=2)),
                                             rel=1e-6)


def test_cosines_per_tensor_and_overall():
    model = _model(n_layers=1)
    a = [torch.ones_like(p) for p in model.parameters()]
    b = [torch.ones_like(p) for p in model.parameters()]
    b[0] = -b[0]
    b[1] = torch.zeros_like(b[1])  # no direction: left out
    cos = gradient_cosines(model, a, b)
    names = [n for n, _ in model.named_parameters()]
    assert cos[names[0]] == pytest.approx(-1.0) and names[1] not in cos
    assert cos[names[2]] == pytest.approx(1.0)
    sizes = [p.numel() for p in model.parameters()]
    expected = (sum(sizes) - 2 * sizes[0] - sizes[1]) / math.sqrt(sum(sizes) * (sum(sizes) -
                                                                                 sizes[1]))
    assert cos["overall"] == pytest.approx(expected)


# ---------------------------------------------------------------------------
# the trainer and its record


def test_run_holds_what_it_declares(tmp_path):
    config = _tiny()
    record = train_ep(config, tmp_path / "run", run_id="run")
    assert record["status"] == "complete", record["error"]
    rows = record["steps"]
    assert [r["step"] for r in rows] == list(range(config.steps))
    assert [r["skipped"] for r in rows] == [0] * config.steps
    names = {n for n, _ in build_ep(config).model.named_parameters()}
    for row in rows:
        assert ("cos" in row) == (row["step"] % 2 == 0)
        assert ("val_loss" in row) == (row["step"] % 3 == 2)
        if "cos" in row:
            assert set(row["cos"]) == {"overall", *names}
            assert row["cos"]["overall"] > 0.99  # beta 0.05 on a tiny model: close to BP
    # The analysis's completeness check agrees with the trainer's declaration.
    runs, metrics = records.load_runs(tmp_path), records.load_metrics(tmp_path)
    assert find_problems(runs, metrics, ["run"]) == []
    assert record["expect"] == expectation(config).as_dict()
    assert record["final"]["val_bpc"] == pytest.approx(record["final"]["val_loss"] / math.log(2))
    assert record["final"]["skipped_steps"] == 0
    assert record["work"]["steps"] == config.steps
    # Step 0's losses are the same model on the same batch, twice.
    assert rows[0]["train_loss"] == pytest.approx(rows[0]["bp_train_loss"], rel=1e-6)


def test_interrupted_run_resumes_to_the_same_record(tmp_path, monkeypatch):
    config = _tiny(steps=5, eval_every=2, checkpoint_every=2)
    whole = train_ep(config, tmp_path / "whole")
    real = ep_module.train_step

    def interrupted(run, step):
        if step == 3:
            raise KeyboardInterrupt  # a kill after the checkpoint at 2 rows
        return real(run, step)

    monkeypatch.setattr(ep_module, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_ep(config, tmp_path / "cut")
    monkeypatch.setattr(ep_module, "train_step", real)
    resumed = train_ep(config, tmp_path / "cut")
    assert records.without_timings(resumed["steps"]) == records.without_timings(whole["steps"])
    assert resumed["final"] == whole["final"]


def test_float64_run_matches_backprop_closely(tmp_path):
    """At small beta in float64 the EP run and its twin stay together step by step."""
    record = train_ep(_tiny(dtype="float64", beta=1e-4, steps=4, eval_every=4))
    for row in record["steps"]:
        assert row["train_loss"] == pytest.approx(row["bp_train_loss"], rel=1e-5)
    assert record["final"]["val_loss"] == pytest.approx(record["final"]["bp_val_loss"],
                                                        rel=1e-5)


@pytest.mark.slow
def test_ep_tracks_backprop_on_the_corpus():
    """A small version of the README's training result: EP within 5% of its BP twin."""
    config = _tiny(d_model=32, n_layers=2, n_heads=4, seq_len=32, batch_size=16, steps=150,
                   lr=3e-3, eval_every=150, eval_batches=8, cosine_every=50, warmup_steps=20)
    record = train_ep(config)
    final = record["final"]
    assert final["val_loss"] < 0.8 * math.log(record_vocab(config))  # it learned something
    assert final["val_loss"] <= 1.05 * final["bp_val_loss"]


def record_vocab(config: EPConfig) -> int:
    return build_ep(dataclasses.replace(config, steps=1)).corpus.vocab_size


def test_notebook_declares_every_config_field_at_smoke_size():
    from pathlib import Path

    from lab.config import field_names
    from lab.notebook import declared_parameters, notebook_defaults

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "02-train-ep-transformer.ipynb"
    assert list(declared_parameters(notebook)) == field_names(EPConfig) + ["out_dir"]
    defaults, config = notebook_defaults(notebook), EPConfig()
    smoke = {"seq_len", "d_model", "n_layers", "n_heads", "steps", "batch_size", "eval_every",
             "eval_batches", "cosine_every", "checkpoint_every", "progress"}
    for name in field_names(EPConfig):
        if name not in smoke:
            assert defaults[name] == getattr(config, name), name
    assert defaults["steps"] <= 50 and defaults["progress"] is False and defaults["out_dir"] == "."
