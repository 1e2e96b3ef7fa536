"""Node perturbation (Williams 1992; Werfel, Xie & Seung 2005, "Learning curves
for stochastic gradient descent in linear feedforward networks"; Lillicrap et
al. 2020 review).

Each population's teaching signal is the shared perturbation estimator's
(``lab.rules.perturbation``, the one lhfa and sdil learn from): for
population l, ``pert_directions`` directions xi ~ N(0, I); each example's own
loss change (L_i(h_l + s xi) - L_i(h_l)) / s (forward differences: the clean
losses come from the training pass) times xi, averaged over directions, is an
unbiased estimate of d(loss_i)/dh_l as s -> 0. Populations are perturbed one
at a time and only the layers above re-run, so one population's noise never
enters another's estimate. Each layer then updates from the local correlation
of its input with that estimate through its own local derivative; the
read-out uses the output error, which it sees locally. Perturbed passes
recompute batch statistics from the perturbed batch (as a training-mode pass
must) and leave BN's running statistics untouched. Observing each example's
own loss omits the coupling between examples through batch statistics
(autograd's gradient includes it), so with batch norm the estimate is biased;
without batch norm it is unbiased.

All passes run in full float32 (``common.full_fp32``): with TF32
convolutions, cuDNN's default on recent GPUs, the loss change at sigma = 1e-3
has a median relative error near 30%.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import configclass
from .base import Rule, StepResult
from .common import Segments, check_targets, derive_seed, full_fp32
from .feedback import check_supported
from .perturbation import PerturbationEstimator, below, pert_directions_field, pert_sigma_field
from .registry import register


@configclass
class NodePertParams:
    pert_sigma: float = pert_sigma_field()
    pert_directions: int = pert_directions_field(1)


@register
class NodePerturbation(Rule):
    name = "nodepert"
    Params = NodePertParams

    def __init__(self, model, params=None, *, seed=0):
        super().__init__(model, params, seed=seed)
        check_supported(model, self.name)
        self.estimator = PerturbationEstimator(
            model, sigma=self.params.pert_sigma, directions=self.params.pert_directions,
            difference="forward", per_example=True,
            generator=torch.Generator().manual_seed(derive_seed(seed, "nodepert")))

    def compute_gradients(self, x, y, step, record=False):
        segments = Segments()
        with full_fp32():
            logits = self.model(x, tap=segments)  # (B, K)
        check_targets(y, logits)
        losses = F.cross_entropy(logits, y, reduction="none")  # (B,)
        hs = [h.detach() for h in segments.outputs]
        clean = losses.detach()
        # d(loss_i)/dh per example, i.e. d(sum loss)/dh: what Segments.inject expects.
        with self.keeping_state(step):  # the draws and the bill's counts
            signals = [self.estimator.observe(i, h, y, clean,
                                              below(self.model, hs, i)).estimate()
                       for i, h in enumerate(hs)]
        loss = losses.mean()
        loss.backward()  # the read-out only
        segments.inject(signals, len(y))
        return StepResult(loss.detach(), logits.detach(), signals if record else None)

    def final_metrics(self, x, y):
        return {"perturbation": self.estimator.counts()}

    def state_dict(self):
        return {"estimator": self.estimator.state_dict()}

    def load_state_dict(self, state):
        self.estimator.load_state_dict(state["estimator"])

    def work(self, layer_macs, examples):
        # Only the layers above each perturbed population re-run, pass by pass.
        return {**super().work(layer_macs, examples),
                "perturbation": self.estimator.macs(layer_macs)}

    def elementwise(self, examples):
        return {"perturbation": self.estimator.elementwise()}
