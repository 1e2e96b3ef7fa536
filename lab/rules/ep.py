"""Cascaded equilibrium propagation's gradient for a causal transformer, and its drift governor.

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
schedule(step) * scale (``lab.train.ep.scheduled_beta``).

The trainer (``lab.train.ep``) runs this beside a backprop twin and records both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.transformer import Transformer, language_model_loss

BETA_SCALE_FLOOR = 1 / 64


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


# ---------------------------------------------------------------------------
# the drift governor


class Governor:
    """The drift governor's state: beta's scale, the K in force, clean steps since a change.

    ``config`` gives ``drift_bound`` (0: no governor), ``recover_after`` and the K to return
    to (``lab.train.ep.EPConfig``).
    """

    def __init__(self, config):
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
