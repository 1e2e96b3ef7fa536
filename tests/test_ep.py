"""Cascaded EP: the backprop oracle, evaluation counts, the governor, the trainer and its record."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
import torch

from analysis import find_problems
from lab import records
from lab.config import ConfigError
from lab.data.text import eval_windows, sample_batch
from lab.device import seeded
from lab.models.transformer import Transformer, language_model_loss
from lab.rules.ep import Governor, ep_gradient
from lab.train import ep as ep_module
from lab.train.ep import (
    EPConfig,
    bp_gradient,
    build_ep,
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


def _relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all parameters as one vector."""
    a, b = torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b])
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("K", [1, 2, 3])
def test_ep_bias_is_first_order_in_beta(K):
    """The cosine with BP is ~1 by construction; the bias is what beta changes, and it is
    O(beta): in float64, ten times less beta gives ten times less relative error (log-log
    slope 1; an O(beta^2) bias would give 2, no bias a rounding floor with slope ~0)."""
    model = _model(n_layers=3)
    x, y = _batch()
    bp, _ = bp_gradient(model, x, y)
    errors = [_relative_error(ep_gradient(model, x, y, beta=beta, K=K).grads, bp)
              for beta in (1e-3, 1e-2)]
    slope = math.log10(errors[1] / errors[0])
    assert 0.8 < slope < 1.2, (errors, slope)
    # A real bias, far above float64 rounding, yet small at these beta.
    assert 1e-7 < errors[0] < errors[1] < 1e-2, errors


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
    constant = EPConfig(beta=0.2, steps=11, warmup_steps=0)
    assert [scheduled_beta(constant, s) for s in (0, 5, 10)] == [0.2, 0.2, 0.2]
    cosine = EPConfig(beta=0.2, beta_final=0.02, beta_schedule="cosine", steps=11,
                      warmup_steps=0)
    assert scheduled_beta(cosine, 0) == pytest.approx(0.2)
    assert scheduled_beta(cosine, 5) == pytest.approx(0.11)
    assert scheduled_beta(cosine, 10) == pytest.approx(0.02)


# ---------------------------------------------------------------------------
# bad inputs


@pytest.mark.parametrize("kw, message", [
    (dict(beta=0.0), r"EPConfig.beta=0.0 is out of range; allowed: \(0.0, inf\)"),
    (dict(beta=-0.1), r"EPConfig.beta=-0.1 is out of range; allowed: \(0.0, inf\)"),
    (dict(K=0), r"EPConfig.K=0 is out of range; allowed: \[1, inf\)"),
    (dict(n_layers=0), r"EPConfig.n_layers=0 is out of range; allowed: \[1, inf\)"),
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


def test_the_last_step_is_validated_and_measured_off_the_cadence():
    # steps 7 with eval_every 3 and cosine_every 4: the trajectory ended at step 5 / 4
    record = train_ep(_tiny(steps=7, eval_every=3, cosine_every=4, checkpoint_every=0))
    rows = record["steps"]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 5, 6]
    assert [r["step"] for r in rows if "cos" in r] == [0, 4, 6]
    per_step = record["work"]["ep"]["macs"]  # K never changes here (no skipped step)
    assert record["work"]["cosine_ep_macs_total"] == 3 * per_step


def test_run_holds_what_it_declares(tmp_path):
    config = _tiny()
    record = train_ep(config, tmp_path / "run", run_id="run")
    assert record["status"] == "complete", record["error"]
    rows = record["steps"]
    assert [r["step"] for r in rows] == list(range(config.steps))
    assert [r["skipped"] for r in rows] == [0] * config.steps
    names = {n for n, _ in build_ep(config).model.named_parameters()}
    last = config.steps - 1  # 5: cosines on the cadence (0, 2, 4) and at the last step
    for row in rows:
        assert ("cos" in row) == (row["step"] % 2 == 0 or row["step"] == last)
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


def test_interrupted_run_resumes_to_the_same_record(tmp_path, train_steps):
    config = _tiny(steps=5, eval_every=2, checkpoint_every=2)
    whole = train_ep(config, tmp_path / "whole")
    train_steps(ep_module, stop_at=3)  # a kill after the checkpoint at 2 rows
    with pytest.raises(KeyboardInterrupt):
        train_ep(config, tmp_path / "cut")
    train_steps(ep_module)
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
    return build_ep(dataclasses.replace(config, steps=1, warmup_steps=0)).corpus.vocab_size


def test_notebook_declares_every_config_field_at_smoke_size():
    from pathlib import Path

    from lab.config import field_names
    from lab.notebook import declared_parameters, notebook_defaults

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "02-train-ep-transformer.ipynb"
    assert list(declared_parameters(notebook)) == field_names(EPConfig) + ["out_dir"]
    defaults, config = notebook_defaults(notebook), EPConfig()
    smoke = {"seq_len", "d_model", "n_layers", "n_heads", "steps", "batch_size", "eval_every",
             "eval_batches", "cosine_every", "checkpoint_every", "progress", "warmup_steps"}
    for name in field_names(EPConfig):
        if name not in smoke:
            assert defaults[name] == getattr(config, name), name
    assert defaults["steps"] <= 50 and defaults["progress"] is False
    assert defaults["out_dir"] == "run-02-train-ep-transformer"  # its own folder
    assert defaults["warmup_steps"] <= defaults["steps"]  # else EPConfig refuses the defaults


# ---------------------------------------------------------------------------
# exact values: oracles recomputed from the returned states, the formulas and torch itself


def _small_states_model(seed=0):
    """A model whose states are tiny (|z| << 1): the drift's 1e-12 guard must not bind."""
    model = _model(n_layers=3, seed=seed)
    with torch.no_grad():
        model.tok.weight.mul_(1e-4)
        model.pos.weight.mul_(1e-4)
        for name, p in model.blocks.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(1e-4)
    return model


@pytest.mark.parametrize("small", [False, True])
def test_objective_drift_and_free_states_recomputed_from_the_states(small):
    """objective = E / (n beta) + CE and drift, recomputed from the returned states."""
    model = _small_states_model() if small else _model(n_layers=3)
    x, y = _batch()
    beta, n = 0.3, y.numel()  # a large beta: the energy term is far from negligible
    ep = ep_gradient(model, x, y, beta=beta, K=3)
    with torch.no_grad():
        z = model.embed(x)
        free = []
        for block in model.blocks:
            z = block(z)
            free.append(z)
        below = [model.embed(x), *ep.nudged_states[:-1]]
        energy = sum(0.5 * float((zn - block(zb)).pow(2).sum())
                     for block, zn, zb in zip(model.blocks, ep.nudged_states, below, strict=True))
        ce = float(language_model_loss(model.readout(ep.nudged_states[-1]), y))
        free_ce = float(language_model_loss(model.readout(free[-1]), y))
        moved = sum(float((a - b).norm()) for a, b in zip(ep.nudged_states, free, strict=True))
        drift = moved / sum(float(b.norm()) for b in free)
    assert len(ep.free_states) == len(ep.nudged_states) == 3
    for got, want in zip(ep.free_states, free, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0.0)
    if not small:
        assert energy / (n * beta) > 1e-4 * ce  # far above the 1e-10 tolerance below
    assert ep.objective == pytest.approx(energy / (n * beta) + ce, rel=1e-10)
    assert ep.free_loss == pytest.approx(free_ce, rel=1e-12)
    if small:
        assert sum(float(b.norm()) for b in free) < 0.1  # the guard would bind at 1
    assert 0 < ep.drift == pytest.approx(drift, rel=1e-10)


def test_unused_parameter_gets_a_zero_gradient():
    """A parameter the loss never reads has no autograd path: both gradients give zeros."""
    model = _model(n_layers=2)
    model.unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    x, y = _batch()
    at = [name for name, _ in model.named_parameters()].index("unused")
    for grads in (ep_gradient(model, x, y, beta=1e-3, K=2).grads, bp_gradient(model, x, y)[0]):
        assert len(grads) == len(list(model.parameters()))
        assert torch.equal(grads[at], torch.zeros(3, dtype=torch.float64))
        assert all(g.shape == p.shape for g, p in zip(grads, model.parameters(), strict=True))


def test_cosines_leave_out_tensors_without_a_direction_on_either_side():
    model = _model(n_layers=1)
    a = [torch.ones_like(p) for p in model.parameters()]
    b = [torch.ones_like(p) for p in model.parameters()]
    a[2] = torch.zeros_like(a[2])  # zero in the first gradient only
    names = [n for n, _ in model.named_parameters()]
    cos = gradient_cosines(model, a, b)
    assert names[2] not in cos and cos[names[0]] == pytest.approx(1.0)
    sizes = [p.numel() for p in model.parameters()]
    assert cos["overall"] == pytest.approx(math.sqrt((sum(sizes) - sizes[2]) / sum(sizes)),
                                           rel=1e-12)
    zero = [torch.zeros_like(p) for p in model.parameters()]
    for left, right in ((zero, b), (a, zero), (zero, zero)):
        cos = gradient_cosines(model, left, right)
        assert list(cos) == ["overall"] and math.isnan(cos["overall"])
    with pytest.raises(ValueError, match=r"zip\(\) argument 3 is shorter"):
        gradient_cosines(model, a, b[:-1])


def test_both_embedding_norms_are_read_at_the_steps_start():
    # EP's norm was read after its update and the twin's before its own: one update apart
    # (the twin at step s matched EP at step s - 1).
    run = build_ep(_tiny(cosine_every=1))
    twin_start = spectral_norm(run.twin.tok.weight)
    assert spectral_norm(run.model.tok.weight) == twin_start  # the twin starts as EP does
    row = train_step(run, 0)
    assert row["embed_spectral_norm"] == row["bp_embed_spectral_norm"] == twin_start
    ep_after, twin_after = (spectral_norm(m.tok.weight) for m in (run.model, run.twin))
    assert ep_after != twin_start and twin_after != twin_start  # both models moved
    row = train_step(run, 1)
    assert (row["embed_spectral_norm"], row["bp_embed_spectral_norm"]) == (ep_after, twin_after)


def test_spectral_norm_of_small_and_zero_matrices():
    w = 1e-4 * torch.randn(30, 7, generator=torch.Generator().manual_seed(1))  # sigma << 1
    assert spectral_norm(w) == pytest.approx(float(torch.linalg.matrix_norm(w, ord=2)),
                                             rel=1e-6)
    assert spectral_norm(torch.zeros(5, 3)) == 0.0


def test_governor_trace_and_state():
    """The clean-step counter, the recovery cadence and the ceilings, step by step."""
    gov = Governor(EPConfig(K=10, drift_bound=0.1, recover_after=2))
    assert gov.state_dict() == {"scale": 1.0, "K": 10, "clean": 0, "skipped": 0}
    for i in range(1, 6):  # clean steps at the configured values: nothing to recover
        assert gov.update(0.01) is False
        assert gov.state_dict() == {"scale": 1.0, "K": 10, "clean": i, "skipped": 0}
    for _ in range(8):  # scale reaches its ceiling 2 recoveries before K does
        gov.update(1.0)
    assert gov.state_dict() == {"scale": 1 / 64, "K": 2, "clean": 0, "skipped": 8}
    trace = []
    for _ in range(20):
        gov.update(0.0)
        trace.append((gov.scale, gov.K, gov.clean))
    expected, scale, K = [], 1 / 64, 2
    for i in range(1, 21):
        if i % 2 == 0 and (scale < 1 or K < 10):
            scale, K = min(2 * scale, 1.0), min(K + 1, 10)
            expected.append((scale, K, 0))
        else:
            expected.append((scale, K, expected[-1][2] + 1 if expected else 1))
    assert trace == expected
    assert trace[-1][:2] == (1.0, 10) and max(s for s, _, _ in trace) == 1.0
    restored = Governor(EPConfig(K=10))
    restored.load_state_dict(gov.state_dict())
    assert restored.state_dict() == gov.state_dict()


def test_cosine_beta_schedule_with_two_steps():
    config = EPConfig(beta=0.2, beta_final=0.05, beta_schedule="cosine", steps=2,
                      warmup_steps=0)
    assert [scheduled_beta(config, s) for s in (0, 1)] == pytest.approx([0.2, 0.05], rel=1e-12)
    assert scheduled_beta(dataclasses.replace(config, steps=1), 0) == 0.2


@pytest.mark.parametrize("name, kind", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam),
                                        ("sgd", torch.optim.SGD)])
def test_optimizer_hyperparameters_read_back(name, kind):
    config = EPConfig(optimizer=name, lr=0.0123, weight_decay=0.0456)
    opt = ep_module._optimizer(config, [torch.nn.Parameter(torch.zeros(2))])
    assert type(opt) is kind
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.0123, 0.0456)
    if name == "sgd":
        assert group["momentum"] == 0.9


def _lr_factor(step: int, warm: int, total: int, schedule: str) -> float:
    """The learning-rate schedule written out: linear warm-up, then cosine 1 -> 0.1 (held)."""
    if step < warm:
        return (step + 1) / warm
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return 0.1 + 0.9 * (0.5 + 0.5 * math.cos(math.pi * progress))


@pytest.mark.parametrize("schedule, warm, total", [("cosine", 3, 10), ("cosine", 3, 4),
                                                   ("cosine", 0, 6), ("constant", 4, 9),
                                                   ("cosine", 5, 5)])
def test_learning_rate_schedule_matches_the_formula(schedule, warm, total):
    config = EPConfig(lr=0.5, schedule=schedule, warmup_steps=warm, steps=total)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = ep_module._scheduler(config, opt)
    for step in range(total + 4):  # beyond the end the schedule holds its floor
        assert opt.param_groups[0]["lr"] == pytest.approx(
            0.5 * _lr_factor(step, warm, total, schedule), rel=1e-12, abs=1e-15), step
        opt.step()
        scheduler.step()
    if schedule == "cosine":
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05, rel=1e-12)


def test_build_wires_the_config_into_model_data_and_parts():
    config = _tiny(seq_len=12, d_model=8, n_layers=3, n_heads=4, mlp_ratio=5, dtype="float64",
                   eval_batches=3, batch_size=2, optimizer="sgd", lr=0.07)
    run = build_ep(config)
    for model in (run.model, run.twin, run.scratch):
        assert (model.max_len, model.d_model, len(model.blocks)) == (12, 8, 3)
        assert model.n_heads == 4 and model.mlp_ratio == 5
        assert model.blocks[0].mlp.fc.out_features == 40  # mlp_ratio * d_model
        assert all(p.dtype == torch.float64 for p in model.parameters())
    assert len(run.val[0]) == 6 and run.val[0].shape == run.val[1].shape == (6, 12)
    want = eval_windows(run.corpus.val, 12, 6)
    assert torch.equal(run.val[0], want[0]) and torch.equal(run.val[1], want[1])
    whole = build_ep(dataclasses.replace(config, eval_batches=0))
    assert len(whole.val[0]) == len(eval_windows(whole.corpus.val, 12)[0]) > 6
    parts = run.parts()
    assert parts == {"model": run.model, "optimizer": run.optimizer,
                     "scheduler": run.scheduler, "twin": run.twin,
                     "twin_optimizer": run.twin_optimizer, "twin_scheduler": run.twin_scheduler,
                     "governor": run.governor, "generator": run.generator}
    for opt, model in ((run.optimizer, run.model), (run.twin_optimizer, run.twin)):
        assert type(opt) is torch.optim.SGD  # warm-up step 0 of 2: half the rate
        assert opt.param_groups[0]["initial_lr"] == 0.07
        assert opt.param_groups[0]["lr"] == pytest.approx(0.035, rel=1e-12)
        assert opt.param_groups[0]["params"] == list(model.parameters())


def test_expectation_declares_exact_metrics():
    both = expectation(_tiny(cosine_every=2, eval_every=3, steps=7))
    assert (both.axis, both.count, both.stride) == ("step", 7, 1)
    assert both.metrics == ("beta", "K", "drift", "skipped", "ep_objective", "train_loss",
                            "grad_norm", "bp_train_loss", "bp_grad_norm", "lr")
    assert both.periodic == (("cos/", 2, 0), ("embed_spectral_norm", 2, 0),
                             ("bp_embed_spectral_norm", 2, 0), ("val_loss", 3, 2),
                             ("val_bpc", 3, 2), ("bp_val_loss", 3, 2), ("bp_val_bpc", 3, 2))
    assert both.final == ("val_loss", "val_bpc", "bp_val_loss", "bp_val_bpc", "skipped_steps")
    assert expectation(_tiny(cosine_every=0, eval_every=0)).periodic == ()


@pytest.mark.parametrize("clip", [0.0, 1e-3, 1e3])
def test_apply_clips_like_torch_and_casts_to_the_parameter_dtype(clip):
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    grads = [torch.randn(4, 3, generator=gen, dtype=torch.float64),
             torch.randn(5, generator=gen, dtype=torch.float64)]  # float64 into float32
    params = [torch.nn.Parameter(s.clone()) for s in start]
    opt = torch.optim.SGD(params, lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    norm = ep_module._apply(params, grads, opt, sched, clip)
    # The oracle: torch's own clipping on a copy, then a plain SGD step.
    ref = [torch.nn.Parameter(s.clone()) for s in start]
    for p, g in zip(ref, grads, strict=True):
        p.grad = g.float()
    want_norm = torch.nn.utils.clip_grad_norm_(ref, clip if clip else math.inf)
    assert norm == pytest.approx(float(want_norm), rel=1e-6)
    assert norm == pytest.approx(math.sqrt(sum(float(g.pow(2).sum()) for g in grads)), rel=1e-6)
    for p, r, s in zip(params, ref, start, strict=True):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.detach(), s - 0.5 * r.grad, rtol=1e-6, atol=1e-7)
    if clip == 0.0:  # off: the full gradient
        torch.testing.assert_close(params[1].detach(), start[1] - 0.5 * grads[1].float())
    assert opt.param_groups[0]["lr"] == 0.25  # the schedule stepped once
    with pytest.raises(ValueError, match=r"zip\(\) argument 2 is shorter"):
        ep_module._apply(params, grads[:1], opt, sched, clip)


def test_train_step_updates_match_the_gradients_clipped():
    """One step of each model, recomputed: same batch, the EP/BP gradient, clip, SGD."""
    config = _tiny(dtype="float64", optimizer="sgd", weight_decay=0.0, lr=0.1, warmup_steps=0,
                   grad_clip=1e-3, beta=0.05, beta_final=0.01, beta_schedule="cosine",
                   steps=5, cosine_every=0, eval_every=0)
    run = build_ep(config)
    run.governor.scale = 0.5  # the beta in force is schedule(step) * scale
    step = 2
    gen = torch.Generator()
    gen.set_state(run.generator.get_state())
    x, y = sample_batch(run.corpus.train, config.batch_size, config.seq_len, gen)
    beta = scheduled_beta(config, step) * 0.5
    assert beta != config.beta * 0.5
    ep_grads = ep_gradient(run.model, x, y, beta, config.K).grads
    bp_grads, bp_loss = bp_gradient(run.twin, x, y)
    before = ([p.detach().clone() for p in run.model.parameters()],
              [p.detach().clone() for p in run.twin.parameters()])
    t0 = time.perf_counter()
    row = train_step(run, step)
    wall = time.perf_counter() - t0
    assert row["beta"] == pytest.approx(beta, rel=1e-12) and row["lr"] == pytest.approx(0.1)
    assert row["bp_train_loss"] == pytest.approx(bp_loss, rel=1e-12)
    for grads, start, model, key in ((ep_grads, before[0], run.model, "grad_norm"),
                                     (bp_grads, before[1], run.twin, "bp_grad_norm")):
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        assert row[key] == pytest.approx(norm, rel=1e-10)
        assert norm > 100 * config.grad_clip  # the clip binds
        coef = config.grad_clip / (norm + 1e-6)  # torch's clip_grad_norm_ rule
        for g, s, p in zip(grads, start, model.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), s - 0.1 * g * coef,
                                       rtol=1e-9, atol=1e-12)
    assert 0 < row["ep_wall_s"] and 0 < row["bp_wall_s"]
    assert row["ep_wall_s"] + row["bp_wall_s"] <= wall


@pytest.mark.parametrize("K", [1, 2, 3, 5])
def test_work_bill_is_the_analytic_formula(K):
    """The bill from the counts: forwards, input VJPs and the parameter backward (x2) through
    the blocks; per top force a read-out forward and its VJP; the objective's read-out and its
    parameter backward (x3); BP: forward + backward (x3) of everything."""
    L, B_, T_ = 3, 3, 5  # batch size and length differ: the token count is their product
    config = EPConfig(n_layers=L, K=K, d_model=16, n_heads=2, mlp_ratio=3, batch_size=B_,
                      seq_len=T_)
    model = Transformer(V, T_, d_model=16, n_layers=L, n_heads=2, mlp_ratio=3)
    bill = work_per_step(config, model, K)
    block = model.block_macs(T_) * B_ * T_
    head = model.readout_macs() * B_ * T_
    counts = ep_gradient(_model(n_layers=L), *_batch(), beta=1e-3, K=K).counts
    tops = counts["top_forces"]
    assert bill["ep"] == {
        "block_forwards": counts["block_forwards"], "input_vjps": counts["input_vjps"],
        "param_backward_blocks": L, "readouts": counts["readouts"],
        "macs": block * (counts["block_forwards"] + counts["input_vjps"] + 2 * L)
        + head * (2 * tops + 3)}
    assert bill["bp"] == {"block_forwards": L, "readouts": 1, "macs": 3 * (L * block + head)}
    assert bill["ep_over_bp_macs"] == pytest.approx(bill["ep"]["macs"] / bill["bp"]["macs"],
                                                    rel=1e-15)
    assert set(bill) == {"ep", "bp", "ep_over_bp_macs"}


def test_trainer_record_names_baseline_progress_and_bill(tmp_path, capsys):
    config = _tiny(steps=3, seed=3, eval_every=0, cosine_every=0, checkpoint_every=0,
                   progress=True)
    record = train_ep(config, tmp_path / "dir", run_id="custom")
    assert record["status"] == "complete", record["error"]
    assert (record["run_id"], record["kind"]) == ("custom", "ep")
    assert record["environment"]["device"] == "cpu"
    assert "ep seed 3" in capsys.readouterr().err  # the progress bar, named
    # The divergence baseline: the initial model's CE on the fixed training probe windows.
    run = build_ep(config)
    probe = eval_windows(run.corpus.train, config.seq_len, config.batch_size)
    assert probe[0].shape == (config.batch_size, config.seq_len)
    saved = torch.load(tmp_path / "dir" / "checkpoint.pt", weights_only=True)
    assert saved["baseline"] == pytest.approx(ep_module.evaluate(run.model, probe, 4), rel=1e-12)
    bill = work_per_step(config, run.model, config.K)
    wall = record["work"].pop("train_wall_s")  # the lifecycle's, whole run
    assert 0 < wall < 60
    assert record["work"] == {**bill, "steps": 3, "steps_at_K": {"2": 3},
                              "ep_macs_total": 3 * bill["ep"]["macs"],
                              "bp_macs_total": 3 * bill["bp"]["macs"],
                              "cosine_ep_macs_total": 0,
                              # eval_batches=2 x batch_size 4: the bundled split holds more
                              "eval_windows_used": 8, "eval_batches_used": 2}
    assert len(run.val[0]) == 8
    quiet = train_ep(dataclasses.replace(config, progress=False))
    assert quiet["run_id"] == "in-memory" and capsys.readouterr().err == ""


def test_checkpoints_follow_checkpoint_every(tmp_path, train_steps):
    config = _tiny(steps=5, eval_every=0, cosine_every=0, checkpoint_every=2)
    train_steps(ep_module, stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        train_ep(config, tmp_path / "cut")
    saved = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert saved["rows"] == 2  # checkpoints at 2 rows (not every row, not only at the end)
    assert set(saved["parts"]) == {"model", "optimizer", "scheduler", "twin", "twin_optimizer",
                                   "twin_scheduler", "governor", "generator"}


# ---------------------------------------------------------------------------
# trial-epcfc findings: data identity, the bill at the K that ran, seeds, beta, schedules

EP_NOTEBOOK = __import__("pathlib").Path(__file__).resolve().parents[1] / "notebooks" / \
    "02-train-ep-transformer.ipynb"


def _corpus(path, seed: int, words=("alpha", "beta", "gamma", "delta", "eps")) -> None:
    import random

    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(words) for _ in range(800)), encoding="utf-8")


def test_relative_text_path_is_made_absolute_and_a_missing_one_refused(tmp_path, monkeypatch):
    _corpus(tmp_path / "small.txt", 0)
    monkeypatch.chdir(tmp_path)
    assert _tiny(text_path="small.txt").text_path == str(tmp_path / "small.txt")
    assert _tiny(text_path="").text_path == ""  # the bundled corpus
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ConfigError) as err:
        _tiny(text_path="nope.txt").preflight()  # it builds (see the CSV case); it cannot start
    assert str(err.value) == (f"EPConfig.text_path={missing!r} does not exist or is not a file; "
                              "expected a UTF-8 text file, or '' for the bundled corpus")


def test_lab_run_refuses_a_missing_text_file_with_exit_2_creating_nothing(tmp_path, capsys,
                                                                          monkeypatch):
    import lab.notebook
    from lab.cli import main as cli_main

    monkeypatch.setattr(lab.notebook, "_papermill",
                        lambda *a, **k: pytest.fail("a kernel was started"))
    out = tmp_path / "r"
    assert cli_main(["run", str(EP_NOTEBOOK), "--out", str(out), "-p", "text_path",
                     str(tmp_path / "nope.txt")]) == 2
    assert f"EPConfig.text_path='{tmp_path / 'nope.txt'}' does not exist" in \
        capsys.readouterr().err
    assert not out.exists()


def test_record_identifies_the_text_and_a_resume_on_changed_text_is_refused(tmp_path,
                                                                            train_steps):
    import hashlib

    from lab.lifecycle import CheckpointError

    corpus = tmp_path / "corp.txt"
    _corpus(corpus, 0)
    config = _tiny(text_path=str(corpus), steps=5, eval_every=0, cosine_every=0,
                   checkpoint_every=2)
    train_steps(ep_module, stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        train_ep(config, tmp_path / "run")
    train_steps(ep_module)
    raw = corpus.read_bytes()
    saved = records.load_record(tmp_path / "run")["data"]
    n_val = round(len(raw) * 0.1)  # ASCII: one byte per character; the last 10% validates
    assert saved == {"text": {"path": str(corpus), "size": len(raw),
                              "sha256": hashlib.sha256(raw).hexdigest()},
                     "split": {"train_chars": len(raw) - n_val, "val_chars": n_val}}
    _corpus(corpus, 1, words=("eps", "delta", "gamma", "beta", "alpha", "zeta"))  # other text
    new = corpus.read_bytes()
    with pytest.raises(CheckpointError) as err:
        train_ep(config, tmp_path / "run")
    n_new = round(len(new) * 0.1)
    split = "".join(f"split.{key}: {then} there vs {now} now; " for key, then, now in (
        ("train_chars", len(raw) - n_val, len(new) - n_new), ("val_chars", n_val, n_new))
        if then != now)
    assert str(err.value) == (
        f"{tmp_path / 'run' / 'checkpoint.pt'} belongs to a run trained on other data "
        f"({split}text.sha256: {hashlib.sha256(raw).hexdigest()!r} there vs "
        f"{hashlib.sha256(new).hexdigest()!r} now; text.size: {len(raw)} there vs {len(new)} "
        "now); resuming would mix two datasets in one run. Restore the data the run began "
        "with, or use another output directory (or move this one aside) to start afresh")
    assert records.load_record(tmp_path / "run")["status"] == "running"  # untouched
    corpus.write_bytes(raw)  # the original text back: the run resumes and completes
    assert train_ep(config, tmp_path / "run")["status"] == "complete"


def test_bundled_corpus_is_identified_by_its_hash():
    import hashlib

    from lab.data.text import bundled_text

    text = bundled_text()
    record = train_ep(_tiny(steps=1, warmup_steps=0, eval_every=0, cosine_every=0))
    n_val = round(len(text) * 0.1)
    assert record["data"] == {"text": {
        "source": "pydoc_data.topics", "chars": len(text),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()},
        "split": {"train_chars": len(text) - n_val, "val_chars": n_val}}


def test_record_holds_the_split_the_trainer_used(tmp_path):
    """Trial finding F5: the record names the character split, equal to what the trainer
    trained and validated on (non-ASCII text: characters, not bytes, are counted)."""
    corpus = tmp_path / "t.txt"
    text = "héllo wörld, " * 77  # 1001 characters, 1155 bytes
    corpus.write_text(text, encoding="utf-8")
    config = _tiny(text_path=str(corpus), steps=1, warmup_steps=0, eval_every=0,
                   cosine_every=0, checkpoint_every=0, eval_batches=0)  # (the split's 6)
    record = train_ep(config, tmp_path / "run")
    run = build_ep(config)
    assert record["data"]["split"] == {"train_chars": 901, "val_chars": 100}  # 1001 - 100
    # What the trainer samples from and validates on, read back from its own streams.
    assert (len(run.corpus.train), len(run.corpus.val)) == (901, 100)
    assert run.corpus.decode(run.corpus.val) == text[901:]
    assert records.load_record(tmp_path / "run")["data"] == record["data"]


def test_seed_is_bounded_by_what_torch_accepts():
    from lab.config import SEED_MAX

    assert _tiny(seed=SEED_MAX).seed == 2**63 - 1
    with pytest.raises(ConfigError) as err:
        _tiny(seed=2**64)
    assert str(err.value) == ("EPConfig.seed=18446744073709551616 is out of range; allowed: "
                              "[0, 9223372036854775807]")


@pytest.mark.parametrize("kw, name, value, eps", [
    (dict(beta=1e-8), "beta", 1e-8, "1.192e-07"),
    (dict(beta=1e-17, dtype="float64"), "beta", 1e-17, "2.22e-16"),
    (dict(beta=0.1, beta_final=1e-9, beta_schedule="cosine"), "beta_final", 1e-9, "1.192e-07"),
])
def test_beta_below_the_dtypes_epsilon_is_refused(kw, name, value, eps):
    dtype = kw.get("dtype", "float32")
    with pytest.raises(ConfigError) as err:
        _tiny(**kw)
    assert str(err.value) == (
        f"EPConfig.{name}={value!r} is too small for dtype={dtype!r}: below its machine "
        f"epsilon ({eps}) the nudge is lost to rounding and EP computes no gradient; allowed: "
        f"{name} >= {eps}")


def test_beta_at_the_dtypes_epsilon_is_allowed():
    assert _tiny(beta=1e-8, dtype="float64").beta == 1e-8
    eps32 = float(torch.finfo(torch.float32).eps)
    assert _tiny(beta=eps32).beta == eps32
    # beta_final only matters to the cosine schedule; the constant one never reads it.
    assert _tiny(beta_final=1e-12).beta_final == 1e-12


def test_cosine_schedule_that_would_raise_beta_is_refused():
    with pytest.raises(ConfigError) as err:
        _tiny(beta=0.01, beta_final=1.0, beta_schedule="cosine")
    assert str(err.value) == (
        "EPConfig.beta_final=1.0 > beta=0.01: beta_schedule='cosine' anneals beta down to "
        "beta_final (a smaller beta is a less biased estimate); use beta_final <= beta, or "
        "beta_schedule='constant'")
    assert _tiny(beta=0.01, beta_final=1.0).beta_final == 1.0  # constant: not read
    assert _tiny(beta=0.01, beta_final=0.01, beta_schedule="cosine").beta == 0.01


def test_warmup_longer_than_the_run_is_refused():
    with pytest.raises(ConfigError) as err:
        _tiny(steps=30, warmup_steps=31)
    assert str(err.value) == ("EPConfig.warmup_steps=31 exceeds steps=30: the learning rate "
                              "would still be warming up when the run ends; use warmup_steps "
                              "<= steps")
    assert _tiny(steps=30, warmup_steps=30).warmup_steps == 30  # peak reached at the last step


def test_a_run_whose_every_step_was_skipped_says_so():
    config = _tiny(beta=100.0, drift_bound=0.01, steps=3, eval_every=0, cosine_every=0,
                   warmup_steps=0)
    with pytest.warns(UserWarning) as caught:
        record = train_ep(config)
    messages = [str(w.message) for w in caught]
    assert ("EP never updated: the drift governor skipped all 3 steps (drift above "
            "drift_bound=0.01); only the BP twin learned. Lower beta, or raise drift_bound"
            ) in messages
    assert record["final"]["skipped_steps"] == 3 and record["final"]["ep_updates"] == 0
    assert [row["skipped"] for row in record["steps"]] == [1, 1, 1]


def test_the_bill_charges_each_step_at_the_K_it_ran_and_the_cosine_pass_apart():
    config = _tiny(beta=1.0, K=3, drift_bound=0.01, recover_after=2, steps=12, warmup_steps=0,
                   eval_every=0, cosine_every=3)
    record = train_ep(config)
    rows, work = record["steps"], record["work"]
    ks = [row["K"] for row in rows]
    assert len(set(ks)) >= 2, ks  # the governor moved K: the case the bill must follow
    model = build_ep(config).model
    at = {K: work_per_step(config, model, K)["ep"]["macs"] for K in set(ks)}
    assert work["ep_macs_total"] == sum(at[K] for K in ks)
    assert work["steps_at_K"] == {str(K): ks.count(K) for K in sorted(set(ks))}
    assert work["cosine_ep_macs_total"] == sum(at[row["K"]] for row in rows if "cos" in row)
    assert work["cosine_ep_macs_total"] > 0
    nominal = work_per_step(config, model, 3)
    assert work["ep"] == nominal["ep"] and work["bp"] == nominal["bp"]  # per step, nominal
    assert work["bp_macs_total"] == 12 * nominal["bp"]["macs"] and work["steps"] == 12
    assert work["ep_macs_total"] < 12 * nominal["ep"]["macs"]  # K fell below 3 on some steps


def test_train_wall_time_covers_every_session(tmp_path, train_steps):
    """A resumed run's train_wall_s is the whole run's, not the last session's."""
    config = _tiny(steps=6, eval_every=0, cosine_every=0, checkpoint_every=2, warmup_steps=0)
    train_steps(ep_module, stop_at=4, delay=0.1)
    with pytest.raises(KeyboardInterrupt):
        train_ep(config, tmp_path / "run")
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert saved["rows"] == 4 and saved["wall_s"] >= 0.4  # four slow rows, carried
    train_steps(ep_module, delay=0.1)
    resumed = train_ep(config, tmp_path / "run")
    # Six rows of >= 0.1 s each; the last session alone ran two (about 0.2 s).
    assert 0.6 <= resumed["work"]["train_wall_s"] < 60


@pytest.mark.parametrize("content, message", [
    (b"", "is empty; a corpus needs text"),
    (b"abc" * 10, "is too short: 30 characters"),
    (b"\xff\xfe\x00bad" * 400, "UTF-8"),
])
def test_a_text_the_run_cannot_use_is_refused_before_a_kernel(tmp_path, capsys, monkeypatch,
                                                              content, message):
    import lab.notebook
    from lab.cli import main as cli_main

    monkeypatch.setattr(lab.notebook, "_papermill",
                        lambda *a, **k: pytest.fail("a kernel was started"))
    text = tmp_path / "t.txt"
    text.write_bytes(content)
    out = tmp_path / "r"
    assert cli_main(["run", str(EP_NOTEBOOK), "--out", str(out), "-p", "text_path",
                     str(text)]) == 2
    err = capsys.readouterr().err
    assert "error: EPConfig: " in err and message in err
    assert not out.exists()
    with pytest.raises(ConfigError, match=message):  # the Python API refuses it alike
        train_ep(_tiny(text_path=str(text)), tmp_path / "py")
    assert not (tmp_path / "py").exists()


# --- trial6 finding F6: eval_batches above what the validation split holds ------------------


def test_eval_batches_beyond_the_split_warn_once_and_the_bill_has_what_was_used(tmp_path):
    import warnings

    path = tmp_path / "small.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 6, encoding="utf-8")
    config = _tiny(text_path=str(path), steps=2, eval_every=0, cosine_every=0,
                   checkpoint_every=0, eval_batches=1000)
    run = build_ep(dataclasses.replace(config, eval_batches=0))  # the whole split
    held = (len(run.corpus.val) - 1) // config.seq_len
    assert held == len(run.val[0]) == 1  # 270 characters: the split holds one window
    with pytest.warns(UserWarning) as caught:
        record = train_ep(config, tmp_path / "run")
    assert [str(w.message) for w in caught] == [
        "EPConfig.eval_batches=1000 asks for 1000 x batch_size 4 = 4000 validation windows "
        "of seq_len 16, but the validation split holds 1: every validation pass uses those 1 "
        "(the bill's eval_windows_used); eval_batches=0 means the whole split"]
    assert record["status"] == "complete", record["error"]
    assert record["config"]["eval_batches"] == 1000  # what was asked stays as asked ...
    assert (record["work"]["eval_windows_used"], record["work"]["eval_batches_used"]) == (1, 1)
    # ... and the windows evaluated are the whole split's, as eval_batches=0 would take.
    with pytest.warns(UserWarning, match=r"eval_batches=1000 asks for"):
        clamped = build_ep(config)
    assert all(torch.equal(a, b) for a, b in zip(clamped.val, run.val))
    with warnings.catch_warnings():  # a request the split can meet is silent
        warnings.simplefilter("error")
        build_ep(dataclasses.replace(config, eval_batches=0))
        build_ep(_tiny(eval_batches=2))


@pytest.mark.parametrize("field, value", [
    ("d_model", 2**40), ("batch_size", 10**11), ("n_layers", 10**6), ("mlp_ratio", 10**9)])
def test_a_model_larger_than_the_machine_is_refused_before_a_run_starts(
        tmp_path, capsys, field, value):
    # d_model=2**40 died in torch's allocator after the kernel started, leaving a failed run.
    from lab.cli import main as cli_main

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "02-train-ep-transformer.ipynb"
    extra = {"n_heads": 1} if field == "d_model" else {}
    config = EPConfig(**{field: value}, **extra)
    with pytest.raises(ConfigError, match=rf"^EPConfig: a transformer of .*{field}={value}.* "
                       r"need at least .* GiB, more than this machine's .* GiB; give a "
                       r"smaller model, batch_size or seq_len$"):
        config.preflight()
    args = [a for k, v in {field: value, **extra, "steps": 2, "warmup_steps": 0}.items()
            for a in ("-p", k, str(v))]
    assert cli_main(["run", str(notebook), "--out",
                     str(tmp_path / "r"), *args]) == 2
    assert "more than this machine's" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("kwargs", [{}, {"d_model": 32, "n_layers": 2, "mlp_ratio": 2}])
def test_the_weight_floor_is_at_most_the_models_weights(kwargs):
    config = EPConfig(**kwargs)
    model = Transformer(10, config.seq_len, config.d_model, config.n_layers, config.n_heads,
                        config.mlp_ratio)
    count = sum(p.numel() for p in model.parameters())
    # A lower bound, and a tight one: what it leaves out is exactly the biases and norms
    # ((9 + mlp_ratio) d_model per block, 2 d_model for the last norm) and the
    # 10-character vocabulary's embedding and read-out.
    D, L, m = config.d_model, config.n_layers, config.mlp_ratio
    assert count - config.weight_floor() == L * (9 + m) * D + 2 * D + 2 * 10 * D + 10


def test_the_recorded_text_hash_is_of_the_text_trained_on(tmp_path, monkeypatch):
    # The text was read at build time and hashed again for the record at start: a file
    # replaced in between was recorded as the new content while the run trained on the old.
    from lab.data.identity import FileChanged, file_identity

    path = tmp_path / "t.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    record = train_ep(_tiny(text_path=str(path), steps=2, eval_every=1, cosine_every=1,
                            warmup_steps=0), tmp_path / "ok")
    assert record["data"]["text"] == file_identity(path)
    read = ep_module.load_corpus

    def read_then_replace(*args, **kwargs):
        corpus = read(*args, **kwargs)
        path.write_text(path.read_text()[::-1])  # same size, other content
        return corpus
    monkeypatch.setattr(ep_module, "load_corpus", read_then_replace)
    with pytest.raises(FileChanged, match=f"data file {path} changed while this run read it"):
        train_ep(_tiny(text_path=str(path)), tmp_path / "r")
    assert not (tmp_path / "r" / "record.json").exists()
