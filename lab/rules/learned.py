"""Feedback learned from causal scalar observations: ``lhfa`` and ``sdil``.

Lansdell, Prakash & Kording 2020 ("Learning to solve the credit assignment
problem", ICLR) learn feedback weights by regressing them on the loss's
response to perturbations of the network's activity, and show that such
feedback beats fixed random feedback. Both rules here read the same
observations, from ``perturbation.PerturbationEstimator`` (for population l,
directions xi_k and o_k ~ <dL/dh_l, xi_k>, L each example's own loss by
default, ``pert_per_example``: B scalars per pass for the same MACs, biased
under batch norm; or the batch's summed loss, unbiased), and descend the same
regression

    0.5 mean_k (<t_l, xi_k> - o_k)^2,
    whose gradient in t_l is R_l = mean_k (<t_l, xi_k> - o_k) xi_k,

an unbiased estimate of t_l - dL/dh_l. A *calibration event* observes every
population on one batch and takes one step of each feedback tensor; events
run ``warmup_steps`` / ``a_warmup_steps`` times before training (in
``prepare``, on batches drawn by the rule's own generator, so the data order
is untouched) and then every ``pert_every`` optimizer steps on the step's
batch, after the step's gradients are written (the step uses the feedback as
it was). Feedback tensors change by a direct update, outside the optimizer
(no momentum, no weight decay on them): normalised LMS, X -= eta_A ||G||^2 /
c(G) G, where c(G) = mean_k <t(G), xi_k>^2 is the curvature of the observed
regression along its gradient G, and t(G) the teaching signal the same map
produces with G in place of X. eta_A = 1 then fits the observed directions
exactly along G (a Kaczmarz-like projection), and any 0 < eta_A < 2 is stable
however noisy the observations; the network's scale does not enter eta_A.
With a complete orthogonal set of directions (exact observations),
eta_A = 1 is steepest descent with exact line search.

``lhfa`` (learned hierarchical FA): fa's transport (fixed-random B at W's
scale to start), whose B_l learn. t_l is fa's teaching signal at the
population a layer reads; the part of t_l that B_l makes is conv^T(delta, B_l)
(delta: the fa gradient at the layer's output), so the regression's gradient
in B_l is the layer's weight correlation of R_l with delta: one product per
layer and event, the layers above held fixed (a local regression, as in the
paper's layer-wise scheme).

``sdil`` (learned direct feedback with an apical compartment): per population
an apical vectoriser A_l (K x units) maps the output error e = softmax - onehot
(B x K) to the population, I_l = e A_l, a learned DFA (Nokland 2016). A_l starts
as dfa's fixed random D_l, scaled by ``feedback_scale`` (0.01 by default), with
its component along the all-ones class vector removed: e 1 = 0, so that
component never changes e A_l and the regression's gradient e^T R_l never
touches it; A_l then converges to the minimum-norm
least-squares map from e to dL/dh_l. Each population has the mixed apical
compartment of ``apical.py`` (DESIGN section 5), as ``kp_traffic`` does (gain
calibrated after the A warm-up; the predictor trained on instruction-off
(h, T) pairs; ``traffic_sign`` and ``traffic_rule`` as there): the used signal
is injected at the population like dfa's projected error, and autograd
gives the weight correlation of the producing layer through its local
norm/ReLU derivative. No signal travels between layers. The read-out learns
from e, which it sees.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import SEED_MAX, ConfigError, Diverged, bounded, choice, configclass, validate
from ..models.resnet import ResNet
from ..models.state import preserved_norm_stats
from .apical import (
    PREDICTORS,
    TRAFFIC_MODELS,
    TRAFFIC_RATIO_MAX,
    TRAFFIC_RULES,
    TRAFFIC_SIGNS,
    Apical,
    check_calibrated,
)
from .base import Rule, StepResult, check_example_needs
from .common import Segments, derive_seed, full_fp32, output_error, parameters_frozen
from .feedback import FeedbackAlignment, check_supported
from .perturbation import (
    BASES,
    DIFFERENCES,
    PerturbationEstimator,
    below,
    pert_directions_field,
    pert_sigma_field,
)
from .registry import register
from .traffic import _conv_weight_grad


def _need_resnet(model, name):
    if not isinstance(model, ResNet):
        raise ConfigError(f"rule {name!r} needs a lab.models.ResNet (its perturbations re-run "
                          f"the layers above a population), got {type(model).__name__}")


def _estimator(model, p, seed: int, name: str) -> PerturbationEstimator:
    """The rule's perturbation estimator from its ``pert_*`` parameters, on its own stream."""
    return PerturbationEstimator(
        model, sigma=p.pert_sigma, directions=p.pert_directions,
        difference=p.pert_difference, basis=p.pert_basis, per_example=p.pert_per_example,
        generator=torch.Generator().manual_seed(derive_seed(seed, name, "perturb")))


def _check_fit(name: str, fit: float, loss: torch.Tensor, sigma: float, event: int) -> None:
    """A calibration event whose observations are not finite teaches nothing: its NLMS
    steps are skipped (curvature not > 0), so say so instead of running on as plain fa /
    dfa. At the first event the weights are the initial ones, so pert_sigma is at fault;
    later it is the weights that grew (a rate too large): the run diverged."""
    if math.isfinite(fit) or not bool(torch.isfinite(loss).all()):
        return  # (a non-finite loss is the run diverging, which the lifecycle reports)
    if event == 0:
        raise FloatingPointError(
            f"rule {name!r}: the first calibration event fits the perturbation observations "
            f"as {fit} though the loss is finite: the perturbed passes overflowed at the "
            f"initial weights (rule_params.pert_sigma={sigma}); give a smaller pert_sigma")
    raise Diverged(
        f"rule {name!r}: calibration event {event + 1} fits the perturbation observations "
        f"as {fit} though the loss is finite: the perturbed passes overflowed "
        f"(pert_sigma={sigma}), the weights having grown since the first event")


def _draw_batch(x, y, size, generator):
    pick = torch.randperm(len(x), generator=generator)[:size].to(x.device)
    return x[pick], y[pick]


@configclass
class LHFAParams:
    feedback_scale: float = bounded(1.0, 0.0, lo_open=True)  # ||B|| / ||W|| at initialisation
    feedback_seed: int = bounded(0, 0, SEED_MAX)
    pert_sigma: float = pert_sigma_field()
    pert_every: int = bounded(10, 1)  # optimizer steps between calibration events
    pert_directions: int = pert_directions_field(4)  # per population and event
    pert_difference: str = choice("central", DIFFERENCES)
    pert_basis: str = choice("gaussian", BASES)
    # Observe each example's own loss (B scalars per pass) rather than the batch's sum:
    # far more observations for the same passes (on a fixed ResNet-20, 40 events moved the
    # mean alignment from 0 to 0.27 this way, to 0.03 with sums), biased under batch norm.
    pert_per_example: bool = True
    eta_A: float = bounded(0.5, 0.0, 2.0, lo_open=True)  # NLMS step, stable below 2
    warmup_steps: int = bounded(10, 0)  # calibration events before training
    calibration_batch: int = bounded(128, 1)  # examples per warm-up event

    def __post_init__(self):
        validate(self)


def _reader(model: ResNet, index: int) -> nn.Module:
    """The Conv/Linear that reads population ``index`` (besides a shortcut)."""
    if index % 2:
        return model.blocks[(index - 1) // 2].conv2
    b = index // 2
    return model.blocks[b].conv1 if b < len(model.blocks) else model.fc


def _pooled(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(2, x.ndim))) if x.ndim > 2 else x


@register
class LearnedFA(FeedbackAlignment):
    """fa whose B learns from perturbation observations (``lhfa``; module docstring)."""

    name = "lhfa"
    Params = LHFAParams
    row_metrics = ("feedback/mean_cos", "perturbation/loss_queries", "calibration/events")

    @staticmethod
    def example_needs(params) -> dict[str, int]:
        return {"calibration_batch": params.calibration_batch} if params.warmup_steps else {}

    def __init__(self, model, params=None, *, seed=0):
        super().__init__(model, params, seed=seed)
        _need_resnet(model, self.name)
        p = self.params
        self.estimator = _estimator(model, p, seed, "lhfa")
        self.batch_generator = torch.Generator().manual_seed(derive_seed(seed, "lhfa", "batch"))
        modules = [m for _, m in self.layers]
        # Population read by each B-carrying layer, in the order of self.layers.
        self.reads = [next(i for i in range(len(model.population_names))
                           if _reader(model, i) is m) for m in modules]
        self.events = 0
        self.calibration_examples = 0
        self.fit = math.nan  # mean over layers of ||R|| / ||estimate||, last event

    def compute_gradients(self, x, y, step, record=False):
        out = super().compute_gradients(x, y, step, record)
        if step is not None and self.steps % self.params.pert_every == 0:
            self.calibrate(x, y)
        return out

    def prepare(self, x, y):
        check_example_needs(self.name, self.example_needs(self.params), len(x))
        self.model.train()
        for _ in range(self.params.warmup_steps):
            self.calibrate(*_draw_batch(x, y, self.params.calibration_batch,
                                        self.batch_generator))

    def fa_signals(self, x, y):
        """Populations, clean loss (summed, or per example), fa teaching, delta per B layer.

        No ``.grad`` is written (``torch.autograd.grad``); running statistics stay.
        """
        hs, outs = [], {}

        def keep(index, h):
            if not h.requires_grad:  # (the parameters below it are frozen for the pass)
                h = h.detach().requires_grad_(True)
            hs.append(h)
            return h

        handles = [m.register_forward_hook(
            lambda mod, inp, out: outs.__setitem__(id(mod), out)) for _, m in self.layers]
        try:
            # Parameters out of autograd: only the populations' and layer outputs'
            # gradients are wanted, not the weight-gradient products (billed nowhere).
            with preserved_norm_stats(self.model), full_fp32(), \
                    parameters_frozen(self.model):
                losses = F.cross_entropy(self.model(x, tap=keep), y, reduction="none")  # (B,)
                grads = torch.autograd.grad(losses.sum(),
                                            hs + [outs[id(m)] for _, m in self.layers])
        finally:
            for handle in handles:
                handle.remove()
        n = len(hs)
        losses = losses.detach()
        clean = losses if self.params.pert_per_example else losses.sum()
        return [h.detach() for h in hs], clean, list(grads[:n]), list(grads[n:])

    def b_gradient(self, module, delta, signal):
        """d <t, signal> / dB, t's part made by ``module``'s B: its weight correlation."""
        if isinstance(module, nn.Linear):
            return delta.T @ _pooled(signal)  # (out, in)
        return _conv_weight_grad(module, delta, signal)[0]

    def b_teaching(self, module, delta, weight, like):
        """The teaching the layer's transport makes with ``weight`` as B. (like's shape)"""
        if isinstance(module, nn.Linear):
            spatial = like[0, 0].numel() if like.ndim > 2 else 1
            pooled = (delta @ weight) / spatial  # (B, C): the mean's backward
            return pooled.view(*pooled.shape, *[1] * (like.ndim - 2)).expand_as(like)
        return torch.ops.aten.convolution_backward(
            delta, like, weight, None, list(module.stride), list(module.padding),
            [1] * module.dims, False, [0] * module.dims, 1, [True, False, False])[0]

    @torch.no_grad()
    def calibrate(self, x, y):
        """One calibration event on (x, y): observe every population read by a B, step B."""
        with torch.enable_grad():
            hs, loss, teaching, deltas = self.fa_signals(x, y)
        fits = []
        for (_, module), b, index, delta in zip(self.layers, self.feedback, self.reads, deltas):
            probe = self.estimator.observe(index, hs[index], y, loss, below(self.model, hs, index))
            residual = probe.residual(teaching[index])  # (B, *U)
            grad = self.b_gradient(module, delta, residual)
            curvature = probe.curvature(self.b_teaching(module, delta, grad, hs[index]))
            if curvature > 0:
                b.sub_(self.params.eta_A * grad.square().sum() / curvature * grad)
            fits.append(float(residual.norm() / probe.estimate().norm().clamp_min(1e-300)))
        fit = sum(fits) / len(fits) if fits else math.nan
        if fits:
            _check_fit(self.name, fit, loss, self.params.pert_sigma, self.events)
        self.events += 1
        self.calibration_examples += len(y)
        self.fit = fit

    def epoch_metrics(self):
        return {**super().epoch_metrics(), "perturbation": self.estimator.counts(),
                "calibration": {"events": self.events, "fit": self.fit}}

    def final_metrics(self, x, y):
        return {"perturbation": self.estimator.counts(),
                "calibration": {"events": self.events, "fit": self.fit,
                                "examples": self.calibration_examples}}

    def state_dict(self):
        return {**super().state_dict(), "estimator": self.estimator.state_dict(),
                "batch_generator": self.batch_generator.get_state(), "events": self.events,
                "calibration_examples": self.calibration_examples, "fit": self.fit}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.estimator.load_state_dict(state["estimator"])
        self.batch_generator.set_state(state["batch_generator"])
        self.events, self.fit = state["events"], state["fit"]
        self.calibration_examples = state["calibration_examples"]

    def work(self, layer_macs, examples):
        forward = sum(layer_macs.values())
        fb = self.feedback_macs(layer_macs)
        out = dict(super().work(layer_macs, examples))
        # Per calibration example: the fa pass (forward + transport through B), then per
        # layer the B correlation and the curvature's input-gradient product.
        out["calibration"] = self.calibration_examples * (forward + 3 * fb)
        out["perturbation"] = self.estimator.macs(layer_macs)
        return out

    def elementwise(self, examples):
        return {"perturbation": self.estimator.elementwise()}


@configclass
class SDILParams:
    # A_l's std at start, in units of dfa's D_l std. Small: dfa's scale makes e A_l ~100x
    # backprop's gradient there, and the regression must first shrink that uncorrelated
    # part (on a fixed ResNet-20, 20 events took the mean alignment to 0.02 from dfa's
    # scale, 6 events to 0.17 from 0.01 of it).
    feedback_scale: float = bounded(0.01, 0.0, lo_open=True)
    feedback_seed: int = bounded(0, 0, SEED_MAX)
    pert_sigma: float = pert_sigma_field()
    pert_every: int = bounded(10, 1)
    pert_directions: int = pert_directions_field(4)
    pert_difference: str = choice("central", DIFFERENCES)
    pert_basis: str = choice("gaussian", BASES)
    pert_per_example: bool = True  # as lhfa's
    eta_A: float = bounded(0.5, 0.0, 2.0, lo_open=True)
    a_warmup_steps: int = bounded(10, 0)
    calibration_batch: int = bounded(128, 1)
    traffic_rule: str = choice("innovation", TRAFFIC_RULES)
    traffic_ratio: float = bounded(4.0, 0.0, TRAFFIC_RATIO_MAX)  # as kp_traffic's
    traffic_seed: int = bounded(0, 0, SEED_MAX)
    traffic_calibration_examples: int = bounded(256, 1)
    predictor_lr: float = bounded(0.5, 0.0, 1.0, lo_open=True)
    predictor_every: int = bounded(10, 1)
    predictor_warmup_steps: int = bounded(100, 0)
    predictor_batch: int = bounded(128, 1)
    traffic_sign: str = choice("hebbian", TRAFFIC_SIGNS)  # as kp_traffic's
    # MT-2: what the traffic is (apical.TRAFFIC_MODELS) and what predicts it.
    traffic_model: str = choice("linear", TRAFFIC_MODELS)
    mixing: float = bounded(0.5, 0.0, 1.0)  # traffic_model=mixing: M's energy off the diagonal
    noise: float = bounded(0.0, 0.0)  # traffic_model=noisy: noise RMS / the traffic's
    predictor: str = choice("unit_affine", PREDICTORS)

    def __post_init__(self):
        validate(self)


@register
class SDIL(Rule):
    """Learned direct feedback + mixed apical compartment (``sdil``; module docstring)."""

    name = "sdil"
    Params = SDILParams
    row_metrics = ("perturbation/loss_queries", "calibration/events",
                   "apical/rms_used/mean", "apical/rms_instruction/mean",
                   "apical/rms_innovation/mean", "apical/rms_traffic/mean")

    @staticmethod
    def example_needs(params) -> dict[str, int]:
        needs = {"traffic_calibration_examples": params.traffic_calibration_examples}
        if params.a_warmup_steps:
            needs["calibration_batch"] = params.calibration_batch
        if params.predictor_warmup_steps:
            needs["predictor_batch"] = params.predictor_batch
        return needs

    def __init__(self, model, params=None, *, seed=0):
        super().__init__(model, params, seed=seed)
        check_supported(model, self.name)
        _need_resnet(model, self.name)
        p = self.params
        self.estimator = _estimator(model, p, seed, "sdil")
        self.generator = torch.Generator().manual_seed(derive_seed(seed, "sdil",
                                                                   p.feedback_seed))
        self.batch_generator = torch.Generator().manual_seed(derive_seed(seed, "sdil", "batch"))
        n = len(model.population_names)
        self.A: list[torch.Tensor] | None = None  # (K, units) per population
        self.apical = Apical(self.name, n, p, seed, "sdil-traffic")
        self.steps = self.events = self.calibration_examples = 0
        self.fit = math.nan
        self.gain_examples = 0

    # -- per-population tensors ------------------------------------------------------

    def _ensure(self, hs: list[torch.Tensor], n_classes: int) -> None:
        if self.A is not None:
            return
        std = self.params.feedback_scale / math.sqrt(n_classes)
        self.A = []
        for h in hs:
            a = torch.randn((n_classes, h[0].numel()), generator=self.generator,
                            dtype=torch.float64) * std
            self.A.append((a - a.mean(0, keepdim=True)).to(h))  # no all-ones component
        self.apical.ensure(hs)

    def instruction(self, e: torch.Tensor, hs) -> list[torch.Tensor]:
        """I_l = e A_l per population, d(sum loss)/dh units. e: (B, K) -> [(B, *U)]"""
        return [(e @ a).view_as(h) for a, h in zip(self.A, hs)]

    @torch.no_grad()
    def _clean(self, x, y):
        hs = []
        with preserved_norm_stats(self.model), full_fp32():
            logits = self.model(x, tap=lambda i, h: hs.append(h) or h)
        self._ensure(hs, logits.shape[1])
        return hs, logits

    # -- the step -----------------------------------------------------------------------

    def compute_gradients(self, x, y, step, record=False):
        if step is not None:  # a training step (a diagnostic call may probe shapes first)
            check_calibrated(self, self.gain_examples)
        segments = Segments()
        logits = self.model(x, tap=segments)  # (B, K)
        hs = [h.detach() for h in segments.outputs]
        self._ensure(hs, logits.shape[1])
        loss = F.cross_entropy(logits, y)
        loss.backward()  # the read-out only: populations are cut from it
        batch = len(y)
        instructions = self.instruction(output_error(logits.detach(), y), hs)
        used = []
        clean = self.params.traffic_rule == "none"
        for i, (ins, h) in enumerate(zip(instructions, hs)):
            # In batch-mean units, as kp_traffic's kernel works.
            mixed = self.apical.signals(i, ins / batch, h, batch)
            used.append(ins if clean else mixed.used * batch)
            if step is not None:
                sums = dict(zip(mixed.SUMS, mixed.sums.tolist()))
                if clean:
                    sums["used"] = sums["instruction"]
                self.apical.log(i, sums, batch, h.numel())
        segments.inject(used, batch)
        if step is not None:
            self.steps += 1
            if self.steps % self.params.predictor_every == 0:
                self.apical.predict(hs)
            if self.steps % self.params.pert_every == 0:
                self.calibrate(x, y)
        return StepResult(loss.detach(), logits.detach(), instructions if record else None)

    # -- calibration ---------------------------------------------------------------------

    @torch.no_grad()
    def calibrate(self, x, y):
        """One calibration event on (x, y): observe each population, step its A_l."""
        hs, logits = self._clean(x, y)
        losses = F.cross_entropy(logits, y, reduction="none")  # (B,)
        if not self.params.pert_per_example:
            losses = losses.sum()
        e = output_error(logits, y)  # (B, K)
        fits = []
        for i, (h, t) in enumerate(zip(hs, self.instruction(e, hs))):
            probe = self.estimator.observe(i, h, y, losses, below(self.model, hs, i))
            residual = probe.residual(t).flatten(1)  # (B, units)
            grad = e.T @ residual  # (K, units)
            curvature = probe.curvature((e @ grad).view_as(h))
            if curvature > 0:
                self.A[i].sub_(self.params.eta_A * grad.square().sum() / curvature * grad)
            fits.append(float(residual.norm() / probe.estimate().norm().clamp_min(1e-300)))
        fit = sum(fits) / len(fits)
        _check_fit(self.name, fit, losses, self.params.pert_sigma, self.events)
        self.events += 1
        self.calibration_examples += len(y)
        self.fit = fit

    def prepare(self, x, y):
        """A warm-up, then the traffic gains (against the calibrated I), then the predictor."""
        p = self.params
        check_example_needs(self.name, self.example_needs(p), len(x))
        self.model.train()
        for _ in range(p.a_warmup_steps):
            self.calibrate(*_draw_batch(x, y, p.calibration_batch, self.batch_generator))
        self.calibrate_gains(x[:p.traffic_calibration_examples],
                             y[:p.traffic_calibration_examples])
        for _ in range(p.predictor_warmup_steps):
            hs, _ = self._clean(*_draw_batch(x, y, p.predictor_batch, self.batch_generator))
            self.apical.predict(hs)

    @torch.no_grad()
    def calibrate_gains(self, x, y, batch_size: int = 256):
        """g_l = traffic_ratio x RMS(I_l) / RMS(C_l h_l) over the calibration examples."""
        n = len(self.model.population_names)
        ss_i, ss_ch = [0.0] * n, [0.0] * n
        for start in range(0, len(y), batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            hs, logits = self._clean(xb, yb)
            squares = self.apical.traffic.unit_squares(hs)
            for i, ins in enumerate(self.instruction(output_error(logits, yb), hs)):
                ss_i[i] += float(ins.double().square().sum())
                ss_ch[i] += squares[i]
        self.apical.traffic.calibrate(self.name, self.params.traffic_ratio, ss_i, ss_ch,
                                      next(self.model.parameters()).dtype)
        self.gain_examples = len(y)

    # -- diagnostics, state, bill ------------------------------------------------------

    def epoch_metrics(self):
        apical = self.apical.epoch_rms(self.model.population_names)
        return {"apical": apical, "perturbation": self.estimator.counts(),
                "calibration": {"events": self.events, "fit": self.fit}}

    def final_metrics(self, x, y):
        return {"perturbation": self.estimator.counts(), "gains": list(self.apical.gains),
                "calibration": {"events": self.events, "fit": self.fit,
                                "examples": self.calibration_examples}}

    def state_dict(self):
        return {"A": _cloned(self.A), **self.apical.state_dict(),
                "generator": self.generator.get_state(),
                "batch_generator": self.batch_generator.get_state(),
                "estimator": self.estimator.state_dict(), "steps": self.steps,
                "events": self.events, "calibration_examples": self.calibration_examples,
                "fit": self.fit, "gain_examples": self.gain_examples}

    def load_state_dict(self, state):
        self.A = _cloned(state["A"])
        self.apical.load_state_dict(state)
        self.generator.set_state(state["generator"])
        self.batch_generator.set_state(state["batch_generator"])
        self.estimator.load_state_dict(state["estimator"])
        for key in ("steps", "events", "calibration_examples", "fit", "gain_examples"):
            setattr(self, key, state[key])

    def work(self, layer_macs, examples):
        forward = sum(layer_macs.values())
        units = sum(a.shape[1] for a in self.A or [])
        k = self.A[0].shape[0] if self.A else 0
        out = dict(super().work(layer_macs, examples))
        out["feedback_propagation"] = k * units * examples  # e A_l per population
        # Per calibration example: the clean forward, e A_l, e^T R_l and the curvature e G.
        out["calibration"] = self.calibration_examples * (forward + 3 * k * units)
        out["perturbation"] = self.estimator.macs(layer_macs)
        # The warm-up runs in prepare, after the gains' calibration: billed once it ran.
        warmed = self.gain_examples > 0
        out["predictor_warmup"] = (self.params.predictor_warmup_steps
                                   * self.params.predictor_batch * forward) if warmed else 0
        out["traffic_calibration"] = self.gain_examples * (forward + k * units)
        # MT-2's channel map (the per-unit predictors have none: element-wise work only).
        predictor = self.apical.predictor_macs(examples)
        if predictor:
            out["predictor"] = predictor
        return out

    def elementwise(self, examples):
        units = self.apical.predictor.units
        return {"mixed_apical": 12 * units * examples,
                "predictor": self.apical.predictor_elementwise(examples),
                "perturbation": self.estimator.elementwise()}


def _cloned(tensors):
    return None if tensors is None else [None if t is None else t.clone() for t in tensors]
