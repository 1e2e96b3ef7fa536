"""Weight mirrors: feedback tensors learned from noise probes.

Akrout, Wilson, Humphreys, Lillicrap & Tweed 2019, "Deep learning without
weight transport" (NeurIPS). Every ``mirror_every`` steps each layer is driven
by probes x ~ N(0, s^2) at its input, independently of the task, and its
feedback tensor learns from the layer's response y = W x:

- ``wm``  weight mirror: B += eta * corr(y, x) / s^2 - decay * B. Since
  E[corr(Wx, x)] = s^2 W, B settles at (eta / decay) W, aligned with W.
  The probes' sample covariance is noisy, so B fluctuates about that point:
  its error floor is E||B - (eta/decay) W||^2 ~ eta^2 / (1 - (1 - decay)^2)
  x r x ||W||^2, i.e. 1 - cos(B, W) ~ decay r / (2 (2 - decay)), where
  r = (fan_in + 1) / samples and samples = probes x output positions per
  event. At the defaults (eta = decay = 0.1, 32 probes) the 1-D ResNet-20
  read-out (fan_in 64, one position) has r = 2.03 and settles near
  cos(B, W) = 0.95; convolutions, averaged over many positions, settle higher.
- ``rrm`` regression mirror: B += eta_l * corr(y - B x, x) / s^2, an LMS
  regression of the probe response, which converges to W itself. It costs one
  extra prediction pass (B x) per probe. Plain LMS multiplies E||B - W||^2 by
  1 - 2 eta + eta^2 (1 + r) per event and diverges once eta > 2 / (1 + r)
  (eta > 0.66 at the read-out above); the step is therefore capped per layer
  at the LMS optimum, eta_l = min(eta, 1 / (1 + r)), which converges for every
  allowed ``mirror_lr`` and leaves smaller rates exactly as given.

corr(y, x) is the layer's own weight-gradient product, averaged over probes
and output positions. Both mirrors update B directly with their own rate:
the mirror circuit runs on its own schedule, not the task optimizer's.
Optional ``mirror_warmup_steps`` mirror events run before the first task step.
"""

from __future__ import annotations

import torch

from ..config import SEED_MAX, bounded, configclass
from ..models.layers import Linear
from .feedback import FeedbackAlignment
from .registry import register

_conv_backward = torch.ops.aten.convolution_backward


@configclass
class MirrorParams:
    feedback_scale: float = bounded(1.0, 0.0, lo_open=True)
    feedback_seed: int = bounded(0, 0, SEED_MAX)
    mirror_every: int = bounded(16, 1)  # task steps between mirror events
    mirror_batch_size: int = bounded(32, 1)  # probes per event
    mirror_lr: float = bounded(0.1, 0.0, 1.0, lo_open=True)  # eta (rrm: capped per layer)
    mirror_decay: float = bounded(0.1, 0.0, 1.0, hi_open=True)  # wm only
    mirror_sigma: float = bounded(1.0, 0.0, lo_open=True)  # probe std s
    mirror_warmup_steps: int = bounded(0, 0)  # mirror events before training


def _layer_map(module, x, w):
    """The layer's linear map (no bias) applied to probes x."""
    if x.ndim == 2:
        return x @ w.t()
    conv = torch.nn.functional.conv1d if x.ndim == 3 else torch.nn.functional.conv2d
    return conv(x, w, None, module.stride, module.padding)


def _weight_product(module, x, y, weight_shape):
    """sum over examples and output positions of y (x) input patch: W's gradient form."""
    dims = x.ndim - 2
    return _conv_backward(y, x, torch.empty(weight_shape, dtype=x.dtype, device=x.device),
                          None, list(module.stride), list(module.padding), [1] * dims,
                          False, [0] * dims, 1, [False, True, False])[1]


def _sample_counts(module, x, y, weight_shape):
    """Per kernel offset, how many real (not padding) input samples a conv's output
    positions see, (1, 1, *kernel): what one example's ``_weight_product`` of ones gives,
    counted here index by index (no product: a convolution of ones each event was work
    no bill named). Per dimension, offset k sees input index o * stride - padding + k
    for each output position o; the counts of a kernel tap multiply across dimensions."""
    counts = torch.ones((1, 1), dtype=x.dtype, device=x.device)
    for d, kernel in enumerate(weight_shape[2:]):
        length, positions = x.shape[2 + d], y.shape[2 + d]
        stride, padding = module.stride[d], module.padding[d]
        seen = [sum(0 <= o * stride - padding + k < length for o in range(positions))
                for k in range(kernel)]
        axis = torch.tensor(seen, dtype=x.dtype, device=x.device)
        counts = counts.unsqueeze(-1) * axis  # (1, 1, k_0, ..., k_d)
    return counts


def _correlation(module, x, y, weight_shape, counts=None):
    """E-normalised corr(y, x), so that E[corr(W x, x)] = s^2 W exactly.

    A conv's border positions see zero padding, so each kernel offset has its
    own count of real input samples; dividing by that count (not by the number
    of positions) removes the padding's bias toward smaller edge taps.
    ``counts``: :func:`_sample_counts`' result for these shapes, if already known.
    """
    if x.ndim == 2:
        return y.t() @ x / len(x)
    if counts is None:
        counts = _sample_counts(module, x, y, weight_shape)
    return _weight_product(module, x, y, weight_shape) / (len(x) * counts)


@register
class WeightMirror(FeedbackAlignment):
    name = "wm"
    Params = MirrorParams
    regression = False

    def __init__(self, model, params=None, *, seed=0):
        super().__init__(model, params, seed=seed)
        self.input_shapes: list[tuple] | None = None
        self.events = 0
        self._counts: dict[int, torch.Tensor] = {}  # per conv layer, _sample_counts

    def _capture_input_shapes(self, x):
        shapes, positions = {}, {}

        def capture(name, module, inp, out):
            if isinstance(module, Linear):  # (a (B, T, D) input too)
                shapes[name], positions[name] = (inp[0].shape[-1],), 1
                return
            shapes[name] = tuple(inp[0].shape[1:])
            positions[name] = out[0, 0].numel()  # output positions per probe

        hooks = [m.register_forward_hook(
            lambda mod, inp, out, n=name: capture(n, mod, inp, out)) for name, m in self.layers]
        try:
            with torch.no_grad():
                was_training = self.model.training
                self.model.eval()  # no BN statistics update
                self.model(x[:1])
                self.model.train(was_training)
        finally:
            for h in hooks:
                h.remove()
        self.input_shapes = [shapes[name] for name, _ in self.layers]
        self.rates = [self.step_size(m.weight[0].numel(), positions[name])
                      for name, m in self.layers]

    def step_size(self, fan_in: int, positions: int) -> float:
        """The mirror rate of one layer; rrm caps it (see the module docstring)."""
        if not self.regression:
            return self.params.mirror_lr
        r = (fan_in + 1) / (self.params.mirror_batch_size * positions)
        return min(self.params.mirror_lr, 1.0 / (1.0 + r))

    @torch.no_grad()
    def mirror_event(self) -> None:
        p = self.params
        for index, ((_, module), b, shape, rate) in enumerate(zip(
                self.layers, self.feedback, self.input_shapes, self.rates)):
            w = module.weight
            x = torch.randn((p.mirror_batch_size, *shape), generator=self.generator,
                            dtype=torch.float64).to(w) * p.mirror_sigma
            y = _layer_map(module, x, w)
            if self.regression:
                y = y - _layer_map(module, x, b)
            counts = None
            if x.ndim > 2:
                counts = self._counts.get(index)
                if counts is None or counts.dtype != x.dtype or counts.device != x.device:
                    counts = self._counts[index] = _sample_counts(module, x, y, w.shape)
            update = _correlation(module, x, y, w.shape, counts) / p.mirror_sigma ** 2
            if not self.regression:
                b.mul_(1.0 - p.mirror_decay)
            b.add_(update, alpha=rate)
        self.events += 1

    def compute_gradients(self, x, y, step, record=False):
        if self.input_shapes is None:
            self._capture_input_shapes(x)
        if step is not None:
            if step == 0:
                for _ in range(self.params.mirror_warmup_steps):
                    self.mirror_event()
            if step % self.params.mirror_every == 0:
                self.mirror_event()
        return super().compute_gradients(x, y, step, record)

    def state_dict(self):
        return {**super().state_dict(), "events": self.events}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.events = state["events"]

    def work(self, layer_macs, examples):
        # Per probe: the response W x and the correlation (and B x for rrm), each
        # one forward's MACs summed over the layers with a B.
        passes = 3 if self.regression else 2
        probes = self.events * self.params.mirror_batch_size
        # Once per run (fresh or resumed): one example's forward learns the layers' input
        # shapes, which the probes take.
        probe = sum(layer_macs.values()) if self.input_shapes is not None else 0
        return {**super().work(layer_macs, examples),
                "mirror": passes * self.feedback_macs(layer_macs) * probes,
                "shape_probe": probe}


@register
class RegressionMirror(WeightMirror):
    name = "rrm"
    regression = True
