"""Cascaded equilibrium propagation for a causal transformer, beside a backprop twin.

The EP gradient and its drift governor are a learning rule: ``lab.rules.ep`` (the maths, DESIGN
section 6). This module trains with them, beside a backprop twin, and records both.

Choosing beta. The estimate is one-sided (nudged minus free), so its error is O(beta) and it
is not neutral: on the default model, beta = 0.1 tracked the twin for ~300 steps, then EP's
residual stream grew (per-token |z_3| ~ 520 against the twin's ~ 32 at step 1100), its own
relaxation drifted by 20-30% and its validation loss fell behind (1.68 against 1.45 nats at step
1000; the governor's bound was 0.25 then). With the default beta = 0.01 the drift stays below
0.014 (median 0.003) over 3000 steps, the overall cosine with BP at the twin above 0.999, and EP
ends 1.2% above the twin's validation loss (beta = 0.003: 0.25%). The drift still creeps up with
training, so the governor's bound (0.05) is a guard against the runaway, not a routine event.

BP twin: a deep copy of the initial model trained by backprop with its own optimizer and
schedule of the same kind, on the same batches, in the same dtype (float32 by default), so the
record holds both learning curves on one step axis. Every ``cosine_every`` steps the EP gradient
is computed on a scratch copy of the *twin's* parameters, on that step's batch, and compared
with the twin's own BP gradient there: one state, per parameter tensor and overall.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ..data.identity import read_unchanged
from ..data.text import (
    TextError,
    bits_per_char,
    eval_windows,
    load_corpus,
    sample_batch,
    text_identity,
)
from ..device import configure_process, keeps_threads, resolve_device, seeded, sync
from ..experiment import Divergence, Expectation, Experiment
from ..lifecycle import train
from ..models.transformer import Transformer, language_model_loss
from ..rules.ep import Governor, ep_gradient
from .common import DTYPES
from .configs import VAL_FRACTION, EPConfig

SPECTRAL_ITERS = 200


# ---------------------------------------------------------------------------
# the twin and the diagnostics


def bp_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor
                ) -> tuple[list[torch.Tensor], float]:
    """Backprop's gradient of the mean next-token CE (model.parameters() order) and the CE."""
    loss = language_model_loss(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g
             for p, g in zip(model.parameters(), grads, strict=True)]
    return grads, float(loss.detach())


def gradient_cosines(model: nn.Module, a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """Cosine between two gradients, per named parameter tensor and overall.

    A tensor where either gradient is exactly zero has no direction and is left out.
    """
    out, dot, na, nb = {}, 0.0, 0.0, 0.0
    for (name, _), ga, gb in zip(model.named_parameters(), a, b, strict=True):
        ga, gb = ga.double().flatten(), gb.double().flatten()
        d, sa, sb = float(ga @ gb), float(ga @ ga), float(gb @ gb)
        dot, na, nb = dot + d, na + sa, nb + sb
        if sa > 0 and sb > 0:
            out[name] = d / math.sqrt(sa * sb)
    overall = dot / math.sqrt(na * nb) if na > 0 and nb > 0 else math.nan
    return {"overall": overall, **out}


def spectral_norm(weight: torch.Tensor, iters: int = SPECTRAL_ITERS) -> float:
    """Largest singular value by power iteration from a fixed start (deterministic)."""
    w = weight.detach().double()
    v = torch.ones(w.shape[1], dtype=w.dtype, device=w.device) / math.sqrt(w.shape[1])
    sigma = 0.0
    for _ in range(iters):
        u = w @ v
        u = u / u.norm().clamp_min(1e-300)
        v = w.T @ u
        sigma = float(v.norm())
        v = v / max(sigma, 1e-300)
    return sigma


# ---------------------------------------------------------------------------
# schedules


def scheduled_beta(config: EPConfig, step: int) -> float:
    """beta before the governor's scale: constant, or cosine from beta to beta_final."""
    if config.beta_schedule == "constant" or config.steps == 1:
        return config.beta
    t = step / (config.steps - 1)
    return config.beta_final + 0.5 * (config.beta - config.beta_final) * (1 + math.cos(math.pi * t))


def _optimizer(config: EPConfig, params):
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(params, lr=config.lr, momentum=0.9, weight_decay=config.weight_decay)


def _scheduler(config: EPConfig, optimizer):
    """Linear warm-up, then cosine decay to 10% of lr (or constant), per optimizer step."""
    warm, total = config.warmup_steps, config.steps

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if config.schedule == "constant":
            return 1.0
        t = min((step - warm) / max(total - warm, 1), 1.0)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------
# the run


@dataclass
class EPRun:
    """The live objects of an EP run (what a notebook may want to inspect)."""

    config: EPConfig
    device: torch.device
    corpus: object
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: object
    twin: Transformer
    twin_optimizer: torch.optim.Optimizer
    twin_scheduler: object
    governor: Governor
    generator: torch.Generator  # batch order, shared by EP and its twin
    scratch: Transformer  # the twin's parameters, for the cosine at one state
    val: tuple  # (inputs, targets) of the validation windows, on the device
    text: dict  # the text's identity, of the very bytes read (record["data"]["text"])

    def parts(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "twin": self.twin, "twin_optimizer": self.twin_optimizer,
                "twin_scheduler": self.twin_scheduler, "governor": self.governor,
                "generator": self.generator}


def build_ep(config: EPConfig) -> EPRun:
    """Data, model, twin, optimizers, schedules, governor, all fixed by ``config.seed``."""
    device = resolve_device(config.device)
    configure_process(config.threads)
    def read():
        return load_corpus(config.text_path, seq_len=config.seq_len, val_fraction=VAL_FRACTION)
    # (the bundled text changes only with Python; a user's file is hashed as it is read)
    text, corpus = (read_unchanged(config.text_path, read) if config.text_path
                    else (text_identity(""), read()))
    with seeded(config.seed):
        model = Transformer(corpus.vocab_size, config.seq_len, config.d_model, config.n_layers,
                            config.n_heads, config.mlp_ratio,
                            dtype=DTYPES[config.dtype]).to(device)
    twin = copy.deepcopy(model)
    optimizer = _optimizer(config, model.parameters())
    twin_optimizer = _optimizer(config, twin.parameters())
    n_windows = config.eval_batches * config.batch_size
    held = (len(corpus.val) - 1) // config.seq_len  # the split's non-overlapping windows
    if n_windows > held:
        # eval_windows keeps all `held` then; the record's eval_batches would say more than
        # was evaluated, so say it here, and the bill holds the count used (eval_windows_used).
        warnings.warn(f"EPConfig.eval_batches={config.eval_batches} asks for "
                      f"{config.eval_batches} x batch_size {config.batch_size} = {n_windows} "
                      f"validation windows of seq_len {config.seq_len}, but the validation "
                      f"split holds {held}: every validation pass uses those {held} (the bill's "
                      f"eval_windows_used); eval_batches=0 means the whole split",
                      stacklevel=2)
    val = tuple(t.to(device) for t in eval_windows(corpus.val, config.seq_len, n_windows))
    return EPRun(config, device, corpus, model, optimizer, _scheduler(config, optimizer), twin,
                 twin_optimizer, _scheduler(config, twin_optimizer), Governor(config),
                 torch.Generator().manual_seed(config.seed), copy.deepcopy(model), val, text)


@torch.no_grad()
def evaluate(model: Transformer, windows: tuple, batch_size: int) -> float:
    """Mean next-character CE (nats) over the given windows."""
    x, y = windows
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]  # (b, T)
        total += language_model_loss(model(xb), yb).double() * yb.numel()
    return float(total) / y.numel()


def expectation(config: EPConfig) -> Expectation:
    """What a complete EP run holds (a pure function of the config)."""
    periodic = []
    if config.cosine_every:
        periodic += [("cos/", config.cosine_every, 0),
                     ("embed_spectral_norm", config.cosine_every, 0),
                     ("bp_embed_spectral_norm", config.cosine_every, 0)]
    if config.eval_every:
        periodic += [(name, config.eval_every, config.eval_every - 1)
                     for name in ("val_loss", "val_bpc", "bp_val_loss", "bp_val_bpc")]
    return Expectation(
        axis="step", count=config.steps, stride=1,
        metrics=("beta", "K", "drift", "skipped", "ep_objective", "train_loss", "grad_norm",
                 "bp_train_loss", "bp_grad_norm", "lr"),
        periodic=tuple(periodic),
        final=("val_loss", "val_bpc", "bp_val_loss", "bp_val_bpc", "skipped_steps"))


def _apply(params, grads, optimizer, scheduler, clip: float) -> float:
    """Write ``grads`` into ``.grad``, clip, step optimizer and schedule; the norm before clip."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g.to(p.dtype)
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip else math.inf))
    optimizer.step()
    scheduler.step()
    return norm


def train_step(run: EPRun, step: int) -> dict:
    """One EP step and one twin step on the same batch; the row they leave."""
    cfg, gov = run.config, run.governor
    x, y = (t.to(run.device) for t in sample_batch(run.corpus.train, cfg.batch_size,
                                                   cfg.seq_len, run.generator))
    beta, K = scheduled_beta(cfg, step) * gov.scale, gov.K
    row: dict = {"beta": beta, "K": K, "lr": run.optimizer.param_groups[0]["lr"]}
    # On their cadences and at the last step too (when a cadence does not divide `steps`),
    # so a run's trajectory ends with a measurement of the trained network.
    last = step + 1 == cfg.steps
    measure = cfg.cosine_every and (step % cfg.cosine_every == 0 or last)

    start = time.perf_counter()
    params = list(run.model.parameters())
    ep = ep_gradient(run.model, x, y, beta, K)
    skipped = gov.update(ep.drift)
    grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in ep.grads))
    if measure:  # before the update, as the twin's below: both models at this step's start
        row["embed_spectral_norm"] = spectral_norm(run.model.tok.weight)
    if not skipped:
        _apply(params, ep.grads, run.optimizer, run.scheduler, cfg.grad_clip)
    for p in params:
        p.grad = None
    sync(run.device)
    row.update(drift=ep.drift, skipped=int(skipped), ep_objective=ep.objective,
               train_loss=ep.free_loss, grad_norm=grad_norm,
               ep_wall_s=time.perf_counter() - start)

    start = time.perf_counter()
    twin_params = list(run.twin.parameters())
    bp_grads, bp_loss = bp_gradient(run.twin, x, y)
    if measure:
        # The EP gradient at the twin's parameters (before its update), same batch: one state.
        run.scratch.load_state_dict(run.twin.state_dict())
        at_twin = ep_gradient(run.scratch, x, y, beta, K)
        row["cos"] = gradient_cosines(run.twin, at_twin.grads, bp_grads)
        row["bp_embed_spectral_norm"] = spectral_norm(run.twin.tok.weight)
    bp_norm = _apply(twin_params, bp_grads, run.twin_optimizer, run.twin_scheduler,
                     cfg.grad_clip)
    for p in twin_params:
        p.grad = None
    sync(run.device)
    row.update(bp_train_loss=bp_loss, bp_grad_norm=bp_norm,
               bp_wall_s=time.perf_counter() - start)

    if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last):
        row.update(_evaluate_both(run))
    return row


def _evaluate_both(run: EPRun) -> dict:
    loss = evaluate(run.model, run.val, run.config.batch_size)
    bp_loss = evaluate(run.twin, run.val, run.config.batch_size)
    return {"val_loss": loss, "val_bpc": bits_per_char(loss), "bp_val_loss": bp_loss,
            "bp_val_bpc": bits_per_char(bp_loss)}


def work_per_step(config: EPConfig, model: Transformer, K: int) -> dict:
    """Evaluation counts and multiply-accumulates of one EP step and one BP step.

    Backward products cost about twice a forward (input and weight gradients), an input-only
    VJP about one forward; element-wise work is not counted.
    """
    L, tokens = config.n_layers, config.batch_size * config.seq_len
    block, head = model.block_macs(config.seq_len) * tokens, model.readout_macs() * tokens
    tops = (K + 1) // 2
    ep = {"block_forwards": L * (K + 1), "input_vjps": K * (L - 1), "param_backward_blocks": L,
          "readouts": tops + 1}
    ep["macs"] = (block * (ep["block_forwards"] + ep["input_vjps"] + 2 * L)
                  + head * (2 * tops + 3))
    # Head terms: each top force is a forward + an input VJP (2); the relaxed CE is a
    # forward, the head's weight gradient and its input gradient (3): its input z_L is
    # detached, but ln_f's own parameters, below the head, need the head's input VJP.
    bp = {"block_forwards": L, "readouts": 1, "macs": 3 * (block * L + head)}
    return {"ep": ep, "bp": bp, "ep_over_bp_macs": ep["macs"] / bp["macs"]}


def run_bill(config: EPConfig, model: Transformer, rows: list[dict]) -> dict:
    """The run's bill from its rows: ``work_per_step`` at the configured K (the nominal
    step), and totals that bill each step at the K it ran.

    The governor lowers K, so ``ep_macs_total`` sums each row's own K (``steps_at_K`` counts
    them); a skipped step is billed too, its gradient was computed. The cosine diagnostic's
    extra EP pass (at the twin's parameters, same beta and K) is diagnostic work: billed apart
    as ``cosine_ep_macs_total``, never folded into training (as in ``lab.diagnostics.work``);
    it reuses the twin's own BP gradient, so it adds no BP work.
    """
    nominal = work_per_step(config, model, config.K)
    macs_at = {}  # K -> EP MACs of one step at that K

    def macs(K: int) -> int:
        if K not in macs_at:
            macs_at[K] = work_per_step(config, model, K)["ep"]["macs"]
        return macs_at[K]

    steps_at_K: dict[str, int] = {}
    ep_total = cosine_total = 0
    for row in rows:
        K = int(row["K"])
        steps_at_K[str(K)] = steps_at_K.get(str(K), 0) + 1
        ep_total += macs(K)
        if "cos" in row:  # the rows it was measured on (its cadence and the last step)
            cosine_total += macs(K)
    return {**nominal, "steps": len(rows), "steps_at_K": dict(sorted(steps_at_K.items())),
            "ep_macs_total": ep_total, "bp_macs_total": nominal["bp"]["macs"] * len(rows),
            "cosine_ep_macs_total": cosine_total}


def _final(run: EPRun, rows: list[dict], diverged: bool) -> tuple[dict, dict]:
    """Both models' validation after the last step, the governor's count, and the bill."""
    config = run.config
    final = _evaluate_both(run)
    steps = len(rows)
    final["skipped_steps"] = run.governor.skipped
    # Steps EP actually updated on: 0 means the record holds only the twin's learning.
    final["ep_updates"] = steps - run.governor.skipped
    # (A diverged run's last step is skipped too, its drift not finite: no advice on
    # drift_bound for that, the divergence message says what happened.)
    if steps and final["ep_updates"] == 0 and not diverged:
        warnings.warn(f"EP never updated: the drift governor skipped all {steps} steps "
                      f"(drift above drift_bound={config.drift_bound}); only the BP twin "
                      "learned. Lower beta, or raise drift_bound", stacklevel=2)
    # What every validation pass evaluated: eval_batches is what was asked, and a split
    # with fewer windows clamps it (build_ep warns).
    used = len(run.val[0])
    work = {**run_bill(config, run.model, rows), "eval_windows_used": used,
            "eval_batches_used": -(-used // config.batch_size)}
    return final, work


# ---------------------------------------------------------------------------
# the experiment, as lab.lifecycle.train drives it


class EP(Experiment):
    """An EP run beside its backprop twin: one row per step."""

    kind, config_class = EPConfig.KIND, EPConfig

    def build(self, config: EPConfig) -> EPRun:
        return build_ep(config)

    def expectation(self, config: EPConfig) -> Expectation:
        return expectation(config)

    def divergence(self, config: EPConfig) -> Divergence:
        # The twin is the reference EP is judged by: its blowing up voids the run. A drift
        # that is not finite means the nudged phase overflowed, which the governor's skips
        # would only repeat every step.
        return Divergence(eval_keys=("val_loss", "bp_val_loss"), companion_keys=("bp_train_loss",),
                          finite_keys=("drift",),
                          finite_hint=": the nudged phase overflowed (is "
                          f"beta={config.beta!r} too large for dtype {config.dtype}?)")

    def data_identity(self, run: EPRun) -> dict:
        return {"text": run.text, "split": run.corpus.split_sizes()}

    def describe(self, config: EPConfig) -> str:
        return f"ep seed {config.seed}"

    def prepare(self, run: EPRun, life) -> None:
        # The loss at initialisation, on fixed training windows (no draw from the batch
        # generator, so the data order does not depend on it).
        probe = tuple(t.to(run.device) for t in eval_windows(
            run.corpus.train, run.config.seq_len, run.config.batch_size))
        life.baseline(evaluate(run.model, probe, run.config.batch_size))

    def step(self, run: EPRun, step: int, life) -> dict:
        return train_step(run, step)

    def finish(self, run: EPRun, rows: list[dict], diverged: bool) -> tuple[dict, dict]:
        return _final(run, rows, diverged)


EXPERIMENT = EP()


@keeps_threads
def train_ep(config: EPConfig, out_dir: str | Path | None = None, *,
             run_id: str | None = None) -> dict:
    """Train EP and its BP twin per ``config``; returns the run record (saved under out_dir).

    The record's ``steps`` holds one row per step (see :func:`expectation`); with ``out_dir``
    a killed run resumes from its last checkpoint of the same config.
    """
    return train(EXPERIMENT, config, out_dir, run_id=run_id)


__all__ = ["EPConfig", "EPRun", "TextError", "bp_gradient", "build_ep", "evaluate",
           "expectation", "gradient_cosines", "run_bill", "scheduled_beta", "spectral_norm",
           "train_ep", "train_step", "work_per_step"]
