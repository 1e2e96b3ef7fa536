"""Cascaded equilibrium propagation for a causal transformer, beside a backprop twin.

Equilibrium propagation (Scellier & Bengio 2017, "Equilibrium propagation: bridging the gap
between energy-based models and backpropagation") here in its layered, feed-forward form
(DESIGN section 6). With z0 = embed(x) and blocks f_1..f_L, the states z_1..z_L have the energy

    E(z) = sum_l 0.5 ||z_l - f_l(z_{l-1})||^2,       F(z) = E(z) + beta * n * CE(readout(z_L)),

where CE is the mean next-token cross-entropy over the n = B * T predicted tokens (so n * CE is
the summed loss). The free phase (beta = 0) has E = 0 at z_l = f_l(z_{l-1}): the ordinary
forward pass. The nudged fixed point of F satisfies, with d_l = z_l - f_l(z_{l-1}),

    d_L = -beta * n * dCE/dz_L,        d_l = J_{l+1}^T d_{l+1}   (J_{l+1} = df_{l+1}/dz_l),

which :func:`ep_gradient` reaches by K rounds of a cascade: the top force d_L (recomputed on even
rounds only: states move O(beta) per round, so reusing it on odd rounds costs O(beta^2)), the
lower forces by vector-Jacobian products through the previous round's block graphs, then a
bottom-up rebuild z_l = f_l(z_{l-1}) + d_l that keeps its graphs for the next round.

Sign convention. The parameter gradient is that of E / (n * beta) + CE(readout(z_L)) at the
relaxed states, with every z_l held fixed (detached) and f_l's graph from the last rebuild:
dE/dtheta_l = -(z_l - f_l)^T df_l/dtheta_l = -d_l^T df_l/dtheta_l. Since d_l -> -beta * n *
dCE/dz_l as beta -> 0 (the cascade is exactly backprop's recursion), dividing by n * beta gives
+dCE/dz_l^T df_l/dtheta_l: backprop's gradient of the mean CE, sign included. The embedding gets
its gradient through E as well: the last rebuild's block 0 reads a graphed z0 = embed(x); the
read-out gets its own through the CE term. So small beta reproduces BP (tests/test_ep.py checks
cosine > 0.9999 in float64), and the gradient goes into ``.grad`` for a stock optimizer.

Cost per EP step: L(K + 1) block forwards (free chain + K rebuilds; no further chain for the
parameter gradient, which reuses the last rebuild's graphs), K(L - 1) input VJPs, one
parameter backward through L blocks, ceil(K/2) top forces (the first also gives the free-phase
CE) and one read-out for the objective's CE. Block 0's graph is only needed by the last rebuild,
so the free phase and earlier rebuilds run it without one.

Drift governor: drift = sum_l ||z_l^nudged - z_l^free|| / sum_l ||z_l^free||. Above
``drift_bound`` the step is skipped: no ``.grad`` is written, neither ``optimizer.step()`` nor
``scheduler.step()`` is called (parameters, optimizer moments and the learning-rate schedule
stay where they were; the batch is consumed), and the governor adapts: beta's scale halves
(floor 1/64) and K drops by one (floor 1). After ``recover_after`` consecutive clean steps the
scale doubles and K grows by one, back up to the configured values. The beta in force is
schedule(step) * scale.

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
from typing import ClassVar

import torch
import torch.nn as nn

from ..config import (
    ConfigError,
    RunConfig,
    bounded,
    check_in_dtype,
    choice,
    configclass,
)
from ..data.identity import absolute, read_unchanged
from ..data.text import (
    TextError,
    bits_per_char,
    eval_windows,
    load_corpus,
    sample_batch,
    text_identity,
)
from ..device import (
    check_fits,
    check_threads,
    configure_process,
    keeps_threads,
    resolve_device,
    seeded,
    sync,
)
from ..models.transformer import Transformer, language_model_loss

DTYPES = {"float32": torch.float32, "float64": torch.float64}
VAL_FRACTION = 0.1  # the last 10% of the text is the validation split
BETA_SCALE_FLOOR = 1 / 64
SPECTRAL_ITERS = 200


@configclass
class EPConfig(RunConfig):
    """Everything one EP run depends on; ``asdict`` is stored in the record."""

    KIND: ClassVar[str] = "ep"  # the record kind its trainer writes (not a field)

    # data: "" = the bundled corpus (pydoc_data.topics), else a UTF-8 text file; a relative
    # path is made absolute on construction (against the working directory), so the record
    # names the file itself
    text_path: str = ""
    seq_len: int = bounded(64, 1)
    # model (the vocabulary comes from the data)
    d_model: int = bounded(64, 1)
    n_layers: int = bounded(3, 1)
    n_heads: int = bounded(4, 1)
    mlp_ratio: int = bounded(4, 1)
    dtype: str = choice("float32", tuple(DTYPES))
    # equilibrium propagation
    beta: float = bounded(0.01, 0.0, lo_open=True)
    beta_schedule: str = choice("constant", ("constant", "cosine"))
    beta_final: float = bounded(0.001, 0.0, lo_open=True)  # the cosine schedule's end value
    K: int = bounded(2, 1)
    drift_bound: float = bounded(0.05, 0.0)  # 0 = no governor
    recover_after: int = bounded(50, 1)  # clean steps before beta/K step back up
    # optimisation (EP and its twin alike)
    steps: int = bounded(3000, 1)
    batch_size: int = bounded(32, 1)
    optimizer: str = choice("adamw", ("adamw", "adam", "sgd"))
    lr: float = bounded(3e-3, 0.0, lo_open=True)
    weight_decay: float = bounded(0.01, 0.0)
    schedule: str = choice("cosine", ("cosine", "constant"))
    warmup_steps: int = bounded(100, 0)
    grad_clip: float = bounded(1.0, 0.0)  # max global grad norm; 0 = off
    # evaluation and diagnostics
    eval_every: int = bounded(500, 0)  # steps between validations (and the last); 0 = at the end
    eval_batches: int = bounded(0, 0)  # batches of batch_size windows; 0 = the whole split
    cosine_every: int = bounded(100, 0)  # steps between EP/BP cosines (and the last); 0 = never
    checkpoint_every: int = bounded(100, 0)  # steps (RunConfig's field, another default)

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ConfigError(f"EPConfig.d_model={self.d_model} is not divisible by "
                              f"n_heads={self.n_heads}; each head gets d_model / n_heads "
                              "channels")
        # Resolved once, where the config is built (`lab run` and its kernel share a working
        # directory): a run started elsewhere then differs visibly in its config instead of
        # silently reading another file of the same name.
        object.__setattr__(self, "text_path", absolute(self.text_path))
        _check_beta(self)
        if self.warmup_steps > self.steps:
            raise ConfigError(f"EPConfig.warmup_steps={self.warmup_steps} exceeds "
                              f"steps={self.steps}: the learning rate would still be warming up "
                              "when the run ends; use warmup_steps <= steps")

    def weight_floor(self) -> int:
        """At most the model's weight count: its blocks' matrices and the positions."""
        return self.n_layers * (4 + 2 * self.mlp_ratio) * self.d_model ** 2 \
            + self.seq_len * self.d_model

    def _check_model_fits(self) -> None:
        """ConfigError if the model and its twin cannot fit in memory (d_model=2**40 died
        in torch's allocator after the kernel started). A lower bound: the blocks' weights
        (4 + 2 mlp_ratio) d_model^2 per layer and the positions, for both models with their
        gradients; one step's free and nudged states, one layer's attention scores and MLP
        hidden units; the vocabulary and the optimizer's moments left out."""
        B, T, D, L = self.batch_size, self.seq_len, self.d_model, self.n_layers
        elements = 4 * self.weight_floor() + 2 * B * T * D * L + B * self.n_heads * T * T \
            + B * T * D * self.mlp_ratio
        check_fits("EPConfig", elements * torch.finfo(DTYPES[self.dtype]).bits // 8,
                   f"a transformer of n_layers={L}, d_model={D}, mlp_ratio={self.mlp_ratio} "
                   f"and its backprop twin, with one step of batch_size={B} windows of "
                   f"seq_len={T}, in {self.dtype},",
                   "give a smaller model, batch_size or seq_len")

    def preflight(self) -> None:
        """What the text decides, before a run starts (``lab run``, a sweep's pre-check,
        ``train_ep``): readable UTF-8, long enough for ``seq_len`` in both splits; and a
        device this machine has."""
        resolve_device(self.device)
        check_threads(self.threads)
        self._check_model_fits()
        # Here, not at construction: see CfCAuxConfig.preflight.
        if self.text_path and not Path(self.text_path).is_file():
            raise ConfigError(f"EPConfig.text_path={self.text_path!r} does not exist or is not "
                              "a file; expected a UTF-8 text file, or '' for the bundled corpus")
        try:
            load_corpus(self.text_path, seq_len=self.seq_len, val_fraction=VAL_FRACTION)
        except (TextError, OSError) as err:
            raise ConfigError(f"EPConfig: {err}") from None


def _check_beta(config: EPConfig) -> None:
    """beta (and a cosine schedule's end value) large enough to move the states at all."""
    # The top force is about beta per element on states of order 1: below the dtype's machine
    # epsilon the nudge is lost to rounding (drift 0; only the read-out learns), and far below
    # it E / (n beta) turns into NaN. The governor cannot catch that: zero drift looks clean.
    eps = float(torch.finfo(DTYPES[config.dtype]).eps)
    names = ("beta", "beta_final") if config.beta_schedule == "cosine" else ("beta",)
    # Far above the dtype's range the nudged phase overflows at its first step.
    check_in_dtype(config, names, config.dtype, by="nudged phase")
    for name in names:
        value = getattr(config, name)
        if value < eps:
            raise ConfigError(f"EPConfig.{name}={value!r} is too small for "
                              f"dtype={config.dtype!r}: below its machine epsilon ({eps:.4g}) "
                              "the nudge is lost to rounding and EP computes no gradient; "
                              f"allowed: {name} >= {eps:.4g}")
    # The schedule anneals: beta's error is O(beta) (see the module doc), so it starts at the
    # exploratory value and ends at the less biased beta_final; ending higher makes no sense.
    if config.beta_schedule == "cosine" and config.beta_final > config.beta:
        raise ConfigError(f"EPConfig.beta_final={config.beta_final!r} > beta={config.beta!r}: "
                          "beta_schedule='cosine' anneals beta down to beta_final (a smaller "
                          "beta is a less biased estimate); use beta_final <= beta, or "
                          "beta_schedule='constant'")


# ---------------------------------------------------------------------------
# the EP gradient


@dataclass
class EPResult:
    """One EP gradient: per-parameter gradients (model.parameters() order) and diagnostics."""

    grads: list[torch.Tensor]
    free_loss: float  # CE at the free states: the training loss of this step
    objective: float  # E / (n beta) + CE at the relaxed states
    drift: float  # sum ||z_nudged - z_free|| / sum ||z_free||
    free_states: list[torch.Tensor]  # z_1 .. z_L, (B, T, D) each
    nudged_states: list[torch.Tensor]
    counts: dict  # evaluations the design implies (checked by hooks in the tests)


def _top_force(model: Transformer, z_top: torch.Tensor, y: torch.Tensor, beta: float):
    """d_L = -beta * n * dCE/dz_L at z_L, and CE there."""
    z = z_top.detach().requires_grad_(True)
    ce = language_model_loss(model.readout(z), y)
    (grad,) = torch.autograd.grad(ce, z)
    return -beta * y.numel() * grad, float(ce.detach())


def ep_gradient(model: Transformer, x: torch.Tensor, y: torch.Tensor, beta: float,
                K: int) -> EPResult:
    """The EP parameter gradient of the mean next-token CE on one batch (see the module doc).

    x, y: (B, T) int64 inputs and targets. Reads the model; writes nothing into ``.grad``.
    """
    if beta <= 0 or not math.isfinite(beta):
        raise ValueError(f"beta={beta!r} is not allowed; the nudging strength must be > 0")
    if K < 1:
        raise ValueError(f"K={K!r} is not allowed; EP needs at least one nudged round (K >= 1)")
    blocks, L, n = model.blocks, len(model.blocks), y.numel()
    # Free phase. ins[l] is block l's input as a leaf (so a VJP stops there), outs[l] its
    # graphed output. Block 0's graph is never used by a VJP (no force below z_1 is needed).
    with torch.no_grad():
        z0 = model.embed(x)  # (B, T, D)
        outs = [blocks[0](z0)]
    ins = [z0]
    for l in range(1, L):
        ins.append(outs[-1].detach().requires_grad_(True))
        outs.append(blocks[l](ins[-1]))
    free = [o.detach() for o in outs]
    states = list(free)
    forces: list[torch.Tensor | None] = [None] * L
    counts = {"block_forwards": L, "input_vjps": 0, "top_forces": 0, "readouts": 0}
    free_loss = math.nan
    for k in range(K):
        if k % 2 == 0:
            forces[L - 1], ce = _top_force(model, states[L - 1], y, beta)
            counts["top_forces"] += 1
            counts["readouts"] += 1
            if k == 0:
                free_loss = ce  # round 0 reads the free z_L: its CE is the free-phase loss
        for l in range(L - 2, -1, -1):
            # d_l = J_{l+1}^T d_{l+1}, through the graph block l+1 kept in the previous pass.
            (forces[l],) = torch.autograd.grad(outs[l + 1], ins[l + 1], forces[l + 1])
            counts["input_vjps"] += 1
        last = k == K - 1
        if last:
            ins = [model.embed(x)]  # graphed z0: the embedding's gradient flows through E
            outs = [blocks[0](ins[0])]
        else:
            with torch.no_grad():
                outs = [blocks[0](z0)]
            ins = [z0]
        states[0] = outs[0].detach() + forces[0]
        for l in range(1, L):
            ins.append(states[l - 1].requires_grad_(True))
            outs.append(blocks[l](ins[l]))
            states[l] = outs[l].detach() + forces[l]
        counts["block_forwards"] += L
    # Parameter gradient of E / (n beta) + CE at the relaxed states, from the last rebuild's
    # graphs: dE/d(out_l) = -(z_l - out_l), so each block's output gets -residual / (n beta).
    residuals = [z.detach() - o.detach() for z, o in zip(states, outs, strict=True)]
    energy = sum(0.5 * float(r.pow(2).sum()) for r in residuals)
    ce_relaxed = language_model_loss(model.readout(states[L - 1].detach()), y)
    counts["readouts"] += 1
    params = list(model.parameters())
    grads = torch.autograd.grad(
        [*outs, ce_relaxed], params,
        grad_outputs=[*(-r / (n * beta) for r in residuals), torch.ones_like(ce_relaxed)],
        allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    nudged = [z.detach() for z in states]
    with torch.no_grad():
        moved = sum(float((a - b).norm()) for a, b in zip(nudged, free, strict=True))
        drift = moved / max(sum(float(b.norm()) for b in free), 1e-12)
    return EPResult(grads=grads, free_loss=free_loss,
                    objective=energy / (n * beta) + float(ce_relaxed.detach()), drift=drift,
                    free_states=free, nudged_states=nudged, counts=counts)


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
# governor and schedules


class Governor:
    """The drift governor's state: beta's scale, the K in force, clean steps since a change."""

    def __init__(self, config: EPConfig):
        self.bound, self.recover_after = config.drift_bound, config.recover_after
        self.K_max = config.K
        self.scale, self.K, self.clean, self.skipped = 1.0, config.K, 0, 0

    def update(self, drift: float) -> bool:
        """Account one step's drift; True when the step must be skipped."""
        if self.bound > 0 and not drift <= self.bound:  # a NaN drift is skipped too
            self.scale = max(self.scale / 2, BETA_SCALE_FLOOR)
            self.K = max(self.K - 1, 1)
            self.clean, self.skipped = 0, self.skipped + 1
            return True
        self.clean += 1
        if self.clean >= self.recover_after and (self.scale < 1 or self.K < self.K_max):
            self.scale = min(self.scale * 2, 1.0)
            self.K = min(self.K + 1, self.K_max)
            self.clean = 0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "K": self.K, "clean": self.clean, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.K = state["scale"], state["K"]
        self.clean, self.skipped = state["clean"], state["skipped"]


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


def expectation(config: EPConfig):
    """What a complete EP run holds (a pure function of the config)."""
    from ..lifecycle import Expectation

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


@keeps_threads
def train_ep(config: EPConfig, out_dir: str | Path | None = None, *,
             run_id: str | None = None) -> dict:
    """Train EP and its BP twin per ``config``; returns the run record (saved under out_dir).

    The record's ``steps`` holds one row per step (see :func:`expectation`); with ``out_dir``
    a killed run resumes from its last checkpoint of the same config.
    """
    from ..lifecycle import Divergence, Lifecycle, check_start

    check_start(config, EPConfig, out_dir, caller="train_ep",
                run_id=run_id)  # before anything is made
    run = build_ep(config)
    with Lifecycle(kind=EPConfig.KIND, config=config, expect=expectation(config), out_dir=out_dir,
                   run_id=run_id, device=str(run.device), parts=run.parts(),
                   checkpoint_every=config.checkpoint_every, progress=config.progress,
                   desc=f"ep seed {config.seed}",
                   # The twin is the reference EP is judged by: its blowing up voids the run.
                   divergence=Divergence(eval_keys=("val_loss", "bp_val_loss"),
                                         companion_keys=("bp_train_loss",),
                                         # states that overflowed in the nudged phase: the
                                         # governor's skips would only repeat it every step
                                         finite_keys=("drift",),
                                         finite_hint=": the nudged phase overflowed (is "
                                         f"beta={config.beta!r} too large for dtype "
                                         f"{config.dtype}?)"),
                   data={"text": run.text, "split": run.corpus.split_sizes()}) as life:
        done = life.start()
        if life.finished:
            return life.result()
        if done == 0:
            # The loss at initialisation, on fixed training windows (no draw from the
            # batch generator, so the data order does not depend on it).
            probe = tuple(t.to(run.device) for t in eval_windows(
                run.corpus.train, config.seq_len, config.batch_size))
            life.baseline(evaluate(run.model, probe, config.batch_size))
        diverged = False
        for step in life.rows():
            if not life.log(train_step(run, step)):
                diverged = True  # the record says why (a non-finite drift or loss)
                break
        final = _evaluate_both(run)
        steps = len(life.rows_logged)
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
        work = {**run_bill(config, run.model, life.rows_logged), "eval_windows_used": used,
                "eval_batches_used": -(-used // config.batch_size)}
        return life.finish(final=final, work=work)


__all__ = ["EPConfig", "EPResult", "EPRun", "Governor", "TextError", "bp_gradient",
           "build_ep", "ep_gradient", "evaluate", "expectation",
           "gradient_cosines", "run_bill", "scheduled_beta", "spectral_norm", "train_ep",
           "train_step", "work_per_step"]
