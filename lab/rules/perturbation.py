"""Causal scalar observations of the loss: one perturbation estimator for every rule.

Node perturbation (Williams 1992; Werfel, Xie & Seung 2005) and the rules that
learn their feedback from it (Lansdell, Prakash & Kording 2020, "Learning to
solve the credit assignment problem", ICLR) all read the same quantity: how
the loss changes when a population is nudged. For population l with clean
activity h_l (shape (B, *U)) and directions xi_k ~ N(0, I) over the whole
population tensor, one observation is the directional derivative of the
batch loss L (the sum of the batch's cross-entropies, DESIGN section 3)

    central (default):  o_k = (L(h_l + s xi_k) - L(h_l - s xi_k)) / (2 s)    bias O(s^2)
    forward:            o_k = (L(h_l + s xi_k) - L(h_l)) / s                 bias O(s)

where L(.) re-runs only the layers above the population (``forward_from``):
the layers below are untouched by the perturbation. Then E[o_k xi_k] =
dL/dh_l, so ``estimate`` = mean_k o_k xi_k is unbiased (up to the difference's
bias), and ``residual(t)`` = mean_k (<t, xi_k> - o_k) xi_k is an unbiased
estimate of t - dL/dh_l: the gradient, with respect to a teaching signal t, of
the regression 0.5 mean_k (<t, xi_k> - o_k)^2 that lhfa and sdil descend.

The batch loss is the observed scalar, so with batch norm the observation
includes the coupling of examples through batch statistics (perturbed passes
recompute them; running statistics are untouched) and the estimate is
unbiased for autograd's gradient there too. ``per_example=True`` observes each
example's own loss instead (B scalars per pass, node perturbation's choice:
less variance, but biased under batch norm).

``basis="orthogonal"`` draws the directions of one call in blocks of mutually
orthogonal vectors of norm sqrt(D) (D = population size; a Haar-random
rotation of the scaled standard basis, Choromanski et al. 2018, "Structured
evolution with compact architectures for scalable policy optimization"): each
is still isotropic with E[xi xi^T] = I, and D of them reconstruct a gradient
exactly, which the oracle tests use.

Passes run in full float32 (``common.full_fp32``). Without batch norm the
perturbed copies of the batch are stacked into one forward (``chunk``
directions per pass, the same numbers as one pass per direction).

Cost, counted per call: ``loss_queries`` (logical batch-loss evaluations: one
per direction for ``forward``, whose clean loss comes from the caller's pass,
two for ``central``), ``observations`` (causal scalars: one per query, B per
query with ``per_example``), and the example-passes of each population, from
which ``macs`` bills the perturbed forward passes: only the layers above the
perturbed population.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import bounded
from ..models.mlp import MLP
from ..models.resnet import ResNet
from ..models.state import preserved_norm_stats
from .common import full_fp32

DIFFERENCES = ("central", "forward")
BASES = ("gaussian", "orthogonal")

# The perturbation's standard deviation next to activity of order 1 (normalised, rectified
# populations): the finite differences assume it small, and 1 is already as large as the
# signal (at 1e30 the perturbed passes overflowed float32 and calibration learned nothing).
PERT_SIGMA_MAX = 1.0


# Directions per population and step (nodepert) or event (lhfa, sdil): each costs its own
# perturbed forward passes. Tens of thousands serve to average out the estimate on a small
# model (the unbiasedness oracle draws 12,000); beyond this a typo (10**12) would only hang
# the run while it drew directions.
PERT_DIRECTIONS_MAX = 1 << 16


def pert_directions_field(default: int):
    """The ``pert_directions`` field of every perturbing rule's parameters."""
    return bounded(default, 1, PERT_DIRECTIONS_MAX)


def pert_sigma_field():
    """The ``pert_sigma`` field of every perturbing rule's parameters (a fresh Field each)."""
    return bounded(1e-3, 0.0, PERT_SIGMA_MAX, lo_open=True)


def below(model: nn.Module, hs: list[torch.Tensor], index: int) -> torch.Tensor | None:
    """The population ``forward_from`` needs besides population ``index``: the block input
    under a ResNet's inner population (its shortcut reads it); None otherwise."""
    return hs[index - 1] if isinstance(model, ResNet) and index % 2 else None


def forward_from(model: nn.Module, index: int, h: torch.Tensor,
                 below: torch.Tensor | None = None):
    """The logits when population ``index`` reads ``h``: only the layers above re-run.

    For a ResNet, an inner population (odd index, block b) feeds that block's
    second conv, whose shortcut reads the block's input, the population below
    (``below``, shape (B, *U_below), repeated to h's batch when h stacks
    several copies). For an MLP, the hidden layers above and the read-out.
    """
    if isinstance(model, MLP):
        for layer in model.hidden[index + 1:]:
            h = F.relu(layer(h))
        return model.fc(h)  # (B', n_classes)
    if index % 2:  # inner population of block b: finish the block
        b = (index - 1) // 2
        block = model.blocks[b]
        x = below.repeat(len(h) // len(below), *[1] * (below.ndim - 1))
        h = F.relu(block.residual_scale * block.norm2(block.conv2(h)) + block.shortcut(x))
        start = b + 1
    else:  # the stem (0) or the outer population of block index // 2 - 1
        start = index // 2
    for b in range(start, len(model.blocks)):
        h = model.blocks[b](h, lambda i, t: t, 1 + 2 * b)
    return model.fc(h.mean(dim=tuple(range(2, h.ndim))))  # (B', n_classes)


def layers_above(model: nn.Module, index: int) -> list[str]:
    """Names (as in ``model.layer_macs``) of the layers ``forward_from(index)`` runs."""
    if isinstance(model, MLP):
        return [f"hidden.{j}" for j in range(index + 1, len(model.hidden))] + ["fc"]
    if index % 2:
        b = (index - 1) // 2
        names = [f"blocks.{b}.conv2"]
        start = b + 1
    else:
        names, start = [], index // 2
    for b in range(start, len(model.blocks)):
        names += [f"blocks.{b}.conv1", f"blocks.{b}.conv2"]
    return names + ["fc"]


@dataclass
class Probe:
    """One population's directions and observations from one call."""

    index: int
    directions: torch.Tensor  # (K, B, *U)
    observations: torch.Tensor  # (K,) batch loss, or (K, B) per example

    def _dots(self, t: torch.Tensor) -> torch.Tensor:
        """<t, xi_k> in the observations' shape: (K,) or (K, B)."""
        prod = self.directions * t.unsqueeze(0)  # (K, B, *U)
        dims = tuple(range(1 if self.observations.ndim == 1 else 2, prod.ndim))
        return prod.sum(dim=dims)

    def _weighted(self, w: torch.Tensor) -> torch.Tensor:
        """mean_k w_k xi_k, w of shape (K,) or (K, B). -> (B, *U)"""
        shape = w.shape + (1,) * (self.directions.ndim - w.ndim)
        return (w.view(shape) * self.directions).mean(0)

    def estimate(self) -> torch.Tensor:
        """mean_k o_k xi_k: the estimate of d(sum loss)/dh. (B, *U)"""
        return self._weighted(self.observations)

    def curvature(self, u: torch.Tensor) -> torch.Tensor:
        """mean_k <u, xi_k>^2 (summed over examples if per example): the regression's
        curvature along a change u of the teaching signal, on the observed directions."""
        squares = self._dots(u).square()  # (K,) or (K, B)
        return (squares.sum(1) if squares.ndim > 1 else squares).mean()

    def residual(self, t: torch.Tensor) -> torch.Tensor:
        """mean_k (<t, xi_k> - o_k) xi_k: d/dt of 0.5 mean_k (<t, xi_k> - o_k)^2. (B, *U)"""
        return self._weighted(self._dots(t) - self.observations)


class PerturbationEstimator:
    """Directional derivatives of the loss at one population at a time (module docstring)."""

    def __init__(self, model: nn.Module, *, sigma: float, directions: int,
                 difference: str = "central", basis: str = "gaussian",
                 per_example: bool = False, generator: torch.Generator, chunk: int = 64):
        if not isinstance(model, (ResNet, MLP)):
            raise ValueError(f"the perturbation estimator needs a lab.models ResNet or MLP (it "
                             f"re-runs the layers above a population), got "
                             f"{type(model).__name__}")
        if difference not in DIFFERENCES:
            raise ValueError(f"difference={difference!r} is not allowed; choose from "
                             f"{DIFFERENCES}")
        if basis not in BASES:
            raise ValueError(f"basis={basis!r} is not allowed; choose from {BASES}")
        if not (sigma > 0 and directions >= 1 and chunk >= 1):
            raise ValueError(f"sigma={sigma} must be > 0, directions={directions} and "
                             f"chunk={chunk} at least 1")
        self.model, self.sigma, self.directions = model, sigma, directions
        self.difference, self.basis, self.per_example = difference, basis, per_example
        self.generator = generator
        self.has_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                            for m in model.modules())
        self.chunk = 1 if self.has_norm else chunk
        self.loss_queries = 0
        self.observations = 0
        self.example_passes: dict[int, int] = {}
        self.elements = 0  # perturbed elements over all passes (element-wise bill)

    # -- directions -------------------------------------------------------------

    def draw(self, like: torch.Tensor, k: int) -> torch.Tensor:
        """k directions shaped like ``like`` (B, *U), drawn on the CPU generator. (k, B, *U)"""
        d = like.numel()
        if self.basis == "gaussian":
            z = torch.randn((k, d), generator=self.generator, dtype=torch.float64)
        else:
            blocks, left = [], k
            while left > 0:
                m = min(left, d)
                g = torch.randn((d, m), generator=self.generator, dtype=torch.float64)
                q, r = torch.linalg.qr(g)  # (d, m) orthonormal columns
                q = q * torch.sign(torch.diagonal(r))  # Haar measure (sign fix)
                blocks.append(q.T * math.sqrt(d))
                left -= m
            z = torch.cat(blocks)
        return z.view(k, *like.shape).to(like)

    # -- observations -----------------------------------------------------------------

    def _losses(self, index, hs, y, below) -> torch.Tensor:
        """Loss of each stacked copy: hs (n, B, *U) -> (n,) or (n, B) per example."""
        n, batch = hs.shape[0], hs.shape[1]
        out = []
        for start in range(0, n, self.chunk):
            part = hs[start:start + self.chunk]
            m = len(part)
            logits = forward_from(self.model, index, part.reshape(m * batch, *hs.shape[2:]),
                                  below)
            losses = F.cross_entropy(logits, y.repeat(m), reduction="none").view(m, batch)
            out.append(losses if self.per_example else losses.sum(1))
        return torch.cat(out)

    @torch.no_grad()
    def observe(self, index: int, h: torch.Tensor, y: torch.Tensor,
                clean_loss: torch.Tensor | None = None,
                below: torch.Tensor | None = None) -> Probe:
        """``directions`` observations at population ``index`` (clean activity ``h``).

        ``clean_loss`` (the batch's summed loss, or per-example losses with
        ``per_example``) is needed by ``forward`` differences; ``below`` is
        the population under an inner one (see ``forward_from``). The model
        runs in its current mode; batch-norm running statistics stay put.
        """
        h = h.detach()
        k, s = self.directions, self.sigma
        xi = self.draw(h, k)  # (K, B, *U)
        with preserved_norm_stats(self.model), full_fp32():
            if self.difference == "central":
                plus = self._losses(index, h + s * xi, y, below)
                minus = self._losses(index, h - s * xi, y, below)
                obs, passes = (plus - minus) / (2 * s), 2 * k
            else:
                if clean_loss is None:
                    raise ValueError("forward differences need the clean loss of the batch")
                obs, passes = (self._losses(index, h + s * xi, y, below) - clean_loss) / s, k
        self.loss_queries += passes
        self.observations += passes * (len(y) if self.per_example else 1)
        self.example_passes[index] = self.example_passes.get(index, 0) + passes * len(y)
        self.elements += passes * h.numel()
        return Probe(index, xi, obs)

    # -- bill ---------------------------------------------------------------------------

    def macs(self, layer_macs: dict[str, int]) -> int:
        """Perturbed-forward MACs so far: per population, example-passes x layers above."""
        return sum(n * sum(layer_macs[name] for name in layers_above(self.model, i))
                   for i, n in self.example_passes.items())

    def elementwise(self) -> int:
        """Per perturbed element: draw, scale and add, and the dot product with the direction."""
        return 4 * self.elements

    def counts(self) -> dict:
        return {"loss_queries": self.loss_queries, "observations": self.observations,
                "example_passes": sum(self.example_passes.values())}

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "loss_queries": self.loss_queries,
                "observations": self.observations, "example_passes": dict(self.example_passes),
                "elements": self.elements}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.loss_queries, self.observations = state["loss_queries"], state["observations"]
        self.example_passes = {int(k): v for k, v in state["example_passes"].items()}
        self.elements = state["elements"]
