"""Node perturbation (Williams 1992; Werfel, Xie & Seung 2005, "Learning curves
for stochastic gradient descent in linear feedforward networks"; Lillicrap et
al. 2020 review).

A clean pass and ``pert_directions`` perturbed passes, each adding noise
xi_l ~ N(0, s^2) at every population. The per-example loss change gives the
teaching signal (L_pert - L_clean) / s^2 * xi_l, an unbiased estimate of
d(loss)/dh_l as s -> 0, averaged over directions. Each layer then updates from
the local correlation of its input with that estimate through its own local
derivative. The read-out layer uses the output error, which it sees locally.
Perturbed passes recompute batch statistics from the perturbed batch (as a
training-mode pass must) and leave BN's running statistics untouched. The
estimate uses each example's own loss change, so with batch norm it omits the
coupling between examples through batch statistics (autograd's gradient
includes it) and is biased; without batch norm it is unbiased.

The clean and perturbed passes run in full float32 (``common.full_fp32``):
with TF32 convolutions, cuDNN's default on recent GPUs, the loss change at
sigma = 1e-3 has a median relative error near 30%.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import bounded, validate
from ..models.state import preserved_norm_stats
from .base import Rule, StepResult
from .common import Segments, derive_seed, full_fp32
from .feedback import check_supported
from .registry import register


@dataclass(frozen=True)
class NodePertParams:
    pert_sigma: float = bounded(1e-3, 0.0, lo_open=True)
    pert_directions: int = bounded(1, 1)

    def __post_init__(self):
        validate(self)


@register
class NodePerturbation(Rule):
    name = "nodepert"
    Params = NodePertParams

    def __init__(self, model, params=None, *, seed=0):
        super().__init__(model, params, seed=seed)
        check_supported(model, self.name)
        self.generator = torch.Generator().manual_seed(derive_seed(seed, "nodepert"))
        self.units = 0

    def _noise(self, like: torch.Tensor) -> torch.Tensor:
        # Drawn on the CPU generator so a run gives the same noise on any device.
        z = torch.randn(like.shape, generator=self.generator, dtype=like.dtype)
        return (z * self.params.pert_sigma).to(like.device)

    @torch.no_grad()
    def estimate(self, x, y, clean_losses) -> list[torch.Tensor]:
        """Mean over directions of (L_pert - L_clean) / s^2 * xi_l, per population."""
        s2 = self.params.pert_sigma ** 2
        total = None
        for _ in range(self.params.pert_directions):
            noise: list[torch.Tensor] = []

            def perturb(index, h, noise=noise):
                xi = self._noise(h)
                noise.append(xi)
                return h + xi

            with preserved_norm_stats(self.model):
                losses = F.cross_entropy(self.model(x, tap=perturb), y, reduction="none")
            scale = (losses - clean_losses) / s2  # (B,)
            terms = [scale.view(-1, *[1] * (xi.ndim - 1)) * xi for xi in noise]
            total = terms if total is None else [t + u for t, u in zip(total, terms)]
        return [t / self.params.pert_directions for t in total]

    def compute_gradients(self, x, y, step, record=False):
        segments = Segments()
        with full_fp32():
            logits = self.model(x, tap=segments)  # (B, K)
            losses = F.cross_entropy(logits, y, reduction="none")
            signals = self.estimate(x, y, losses.detach())
        loss = losses.mean()
        self.units = sum(h[0].numel() for h in segments.outputs)
        loss.backward()  # the read-out only
        segments.inject(signals, len(y))
        return StepResult(loss.detach(), logits.detach(), signals if record else None)

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])

    def work(self, layer_macs, examples):
        forward = sum(layer_macs.values())
        return {**super().work(layer_macs, examples),
                "perturbation": self.params.pert_directions * forward * examples}

    def elementwise(self, examples):
        # Per direction and unit: draw, add, scale, accumulate.
        return {"perturbation": 4 * self.params.pert_directions * self.units * examples}
