"""The mixed apical compartment shared by ``kp_traffic`` and ``sdil`` (DESIGN section 5).

Pyramidal neurons receive the top-down teaching signal in their apical
dendrites, where it mixes with other traffic, e.g. soma-coupled activity
(Guerguiev, Lillicrap & Richards 2017; Payeur et al. 2021). At every
population h (B, *U) with instruction I (d loss / dh), per unit:

- traffic model (``LinearTraffic``): T = g C h, C = exp(0.25 N(0, 1)) fixed per
  unit, g per population, calibrated once so that RMS(T) / RMS(I) =
  ``traffic_ratio`` on the first ``traffic_calibration_examples`` examples;
- predictor (``UnitAffine``): P h + b per unit, learned by normalised LMS from
  instruction-off observations (h, T) of its own unit only:
  r = T - P h - b; P += eta mean_b(centred r centred h) / (var_b(h) + 1e-12);
  b += eta mean_b(r);
- signals, in the seed's descent convention d = -I (``numba_kernels/reference.py``
  is the spec, top to bottom): R_d = d + s T (s = +1 ``hebbian``, the seed's: on an
  active unit the traffic pushes the drive up; s = -1 ``anti_hebbian``: the traffic
  is added to the gradient), N_d = R_d - s (P h + b), M_d = R_d ||N_d|| / ||R_d||
  per example; the optimizer is handed minus the one ``traffic_rule`` picks
  (``none``: the instruction, the clean reference of the MT-1 study).

The fused kernels (``numba_kernels``) compute the signals with the sums of squares
the epoch log needs. A new traffic model or predictor (MT-2) is a class with the
same narrow interface: ``ensure(i, h)``, ``__call__(i, h, factor)`` /
``update(i, h, T, eta)``, ``state()`` / ``load(state)``. Linear traffic with a per-unit
predictor runs the fused step from the per-unit coefficients (``mixed_local``, with P2
for the quadratic one); any other pair forms T and the prediction in torch and runs
the fused step on them (``mixed_traffic_local``).
"""

from __future__ import annotations

import math

import torch

import numba_kernels
from numba_kernels.reference import RULES, SIGNS

from ..config import ConfigError
from .common import derive_seed

TRAFFIC_RULES = ("none", *RULES)
TRAFFIC_SIGNS = tuple(SIGNS)
# Above 1e4 the instruction is below a thousandth of the traffic's float32 rounding-free
# part (eps 1.2e-7 x 1e4 ~ 1e-3 of I).
TRAFFIC_RATIO_MAX = 1e4
SIGNALS = ("used", "instruction", "raw", "innovation", "traffic")


def _cloned(tensors: list) -> list:
    return [None if t is None else t.clone() for t in tensors]


class LinearTraffic:
    """T = g C h per population (the seed's traffic model)."""

    def __init__(self, n: int, seed: int, stream: str, traffic_seed: int):
        self.coefficients: list[torch.Tensor | None] = [None] * n  # C per unit
        self.gains = [0.0] * n
        self._seed = (seed, stream, traffic_seed)

    def ensure(self, i: int, h: torch.Tensor) -> None:
        if self.coefficients[i] is None:
            # C = exp(0.25 N(0, 1)) per unit, fixed by the run seed and traffic_seed.
            generator = torch.Generator().manual_seed(derive_seed(*self._seed, i))
            self.coefficients[i] = torch.exp(0.25 * torch.randn(
                h.shape[1:], generator=generator, dtype=torch.float64)).to(h)

    def __call__(self, i: int, h: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        # ``factor`` (the kernels' 1 / B) joins the per-unit product: no extra pass.
        return (self.coefficients[i] * (self.gains[i] * factor)) * h

    def unit_squares(self, hs) -> list[float]:
        """Per population, the sum of squares of C h (the traffic at unit gain), float64."""
        return [float((self.coefficients[i].double() * h.double()).square().sum())
                for i, h in enumerate(hs)]

    def calibrate(self, rule: str, ratio: float, ss_i: list, ss_ch: list, dtype) -> None:
        """g_l = ratio x RMS(I_l) / RMS(C_l h_l) from the sums of squares of the
        instructions and of ``unit_squares`` over the same examples."""
        self.gains = calibrated_gains(rule, ratio, ss_i, ss_ch, dtype)

    def state(self) -> dict:
        return {"gains": list(self.gains), "coefficients": _cloned(self.coefficients)}

    def load(self, state: dict) -> None:
        self.gains = list(state["gains"])
        self.coefficients = _cloned(state["coefficients"])


class SaturatingTraffic(LinearTraffic):
    """T = g C s tanh(h / s), s the population's activity RMS on the first calibration
    batch: a per-unit nonlinearity no affine predictor fits exactly."""

    def __init__(self, n: int, seed: int, stream: str, traffic_seed: int):
        super().__init__(n, seed, stream, traffic_seed)
        self.scales: list[float | None] = [None] * n

    def _shape(self, i: int, h: torch.Tensor) -> torch.Tensor:
        if self.scales[i] is None:
            self.scales[i] = float(h.double().square().mean().sqrt()) or 1.0
        s = self.scales[i]
        return s * torch.tanh(h / s)

    def __call__(self, i: int, h: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        return (self.coefficients[i] * (self.gains[i] * factor)) * self._shape(i, h)

    def unit_squares(self, hs) -> list[float]:
        return [float((self.coefficients[i].double() * self._shape(i, h.double())).square()
                      .sum()) for i, h in enumerate(hs)]

    def state(self) -> dict:
        return {**super().state(), "scales": list(self.scales)}

    def load(self, state: dict) -> None:
        super().load(state)
        self.scales = list(state["scales"])


class MixingTraffic(LinearTraffic):
    """T = g C (M h): M a fixed random map over channels at each position, the fraction
    ``mixing`` of its energy off the diagonal; C per channel (a unit's traffic depends on
    its neighbours' activity)."""

    def __init__(self, n: int, seed: int, stream: str, traffic_seed: int, mixing: float):
        super().__init__(n, seed, stream, traffic_seed)
        self.mixing = mixing
        self.maps: list[torch.Tensor | None] = [None] * n

    def ensure(self, i: int, h: torch.Tensor) -> None:
        if self.coefficients[i] is not None:
            return
        k = h.shape[1]
        if self.mixing > 0 and k < 2:
            raise ConfigError(
                f"rule_params.mixing={self.mixing} needs at least 2 channels to mix, but "
                f"population {i} has per-example shape {tuple(h.shape[1:])}; allowed on it: "
                f"mixing=0")
        generator = torch.Generator().manual_seed(derive_seed(*self._seed, i))
        c = torch.exp(0.25 * torch.randn(k, generator=generator, dtype=torch.float64))
        off = torch.randn(k, k, generator=generator, dtype=torch.float64)
        off.fill_diagonal_(0.0)
        # M = sqrt(1 - m) Id + sqrt(m) O: energy k, the fraction m of it off the diagonal.
        m = torch.eye(k, dtype=torch.float64) * math.sqrt(1 - self.mixing)
        if k > 1:
            m = m + off * (math.sqrt(self.mixing * k) / off.norm())
        self.coefficients[i] = c.to(h)
        self.maps[i] = m.to(h)

    def _mixed(self, i: int, h: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (h.dim() - 2)
        mh = torch.einsum("kc,bc...->bk...", self.maps[i].to(h), h)
        return self.coefficients[i].to(h).view(shape) * mh

    def __call__(self, i: int, h: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        return (self.gains[i] * factor) * self._mixed(i, h)

    def unit_squares(self, hs) -> list[float]:
        return [float(self._mixed(i, h.double()).square().sum()) for i, h in enumerate(hs)]

    def state(self) -> dict:
        return {**super().state(), "maps": _cloned(self.maps)}

    def load(self, state: dict) -> None:
        super().load(state)
        self.maps = _cloned(state["maps"])


class NoisyTraffic(LinearTraffic):
    """T = g C h + e, e zero-mean Gaussian drawn fresh at every call, RMS ``noise`` x the
    RMS of g C h at calibration: a share noise / sqrt(1 + noise^2) of RMS(T) that no
    predictor can remove. g is calibrated so that RMS(T) (both parts) is the ratio."""

    def __init__(self, n: int, seed: int, stream: str, traffic_seed: int, noise: float):
        super().__init__(n, seed, stream, traffic_seed)
        self.noise = noise
        self.sigmas = [0.0] * n
        self.numels = [0] * n
        self.generator = torch.Generator().manual_seed(
            derive_seed(seed, stream, traffic_seed, "noise"))

    def __call__(self, i: int, h: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        t = super().__call__(i, h, factor)
        if not self.sigmas[i]:
            return t
        e = torch.randn(h.shape, generator=self.generator, dtype=h.dtype)
        return t + (self.sigmas[i] * factor) * e.to(h.device)

    def unit_squares(self, hs) -> list[float]:
        for i, h in enumerate(hs):
            self.numels[i] += h.numel()
        return super().unit_squares(hs)

    def calibrate(self, rule: str, ratio: float, ss_i: list, ss_ch: list, dtype) -> None:
        # RMS(T)^2 = g^2 RMS(C h)^2 (1 + noise^2) = (ratio RMS(I))^2.
        spread = math.sqrt(1 + self.noise ** 2)
        super().calibrate(rule, ratio / spread, ss_i, ss_ch, dtype)
        self.sigmas = [self.noise * g * math.sqrt(sc / n) if n else 0.0
                       for g, sc, n in zip(self.gains, ss_ch, self.numels)]
        self.numels = [0] * len(self.numels)

    def state(self) -> dict:
        return {**super().state(), "sigmas": list(self.sigmas),
                "noise_generator": self.generator.get_state()}

    def load(self, state: dict) -> None:
        super().load(state)
        self.sigmas = list(state["sigmas"])
        self.generator.set_state(state["noise_generator"])


class UnitAffine:
    """P h + b per unit, learned by normalised LMS (``numba_kernels.predictor_update``).

    The bill (``Apical.predictor_macs``, ``predictor_elementwise``): per example, a
    prediction's multiply-accumulates and its element-wise operations per unit beyond the
    seed's P h + b (which ``mixed_local``'s count holds), and an update's."""

    prediction_ops = 0
    update_ops = 8  # per unit and example observed

    def __init__(self, n: int):
        self.P: list[torch.Tensor | None] = [None] * n
        self.b: list[torch.Tensor | None] = [None] * n

    def ensure(self, i: int, h: torch.Tensor) -> None:
        if self.P[i] is None:
            self.P[i] = torch.zeros(h.shape[1:], dtype=h.dtype, device=h.device)
            self.b[i] = torch.zeros(h.shape[1:], dtype=h.dtype, device=h.device)

    def __call__(self, i: int, h: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        return (self.P[i] * factor) * h + self.b[i] * factor

    def prediction_macs(self, shapes: dict) -> int:
        return 0  # per-unit products are element-wise work

    def update_macs(self, shapes: dict, examples: int, updates: int) -> int:
        return 0

    def update(self, i: int, h: torch.Tensor, T: torch.Tensor, eta: float) -> None:
        numba_kernels.predictor_update(h.contiguous(), T.contiguous(), self.P[i], self.b[i],
                                       eta)

    @property
    def units(self) -> int:
        return sum(p.numel() for p in self.P if p is not None)

    def state(self) -> dict:
        return {"P": _cloned(self.P), "b": _cloned(self.b)}

    def load(self, state: dict) -> None:
        self.P, self.b = _cloned(state["P"]), _cloned(state["b"])


class UnitQuadratic(UnitAffine):
    """P1 h + P2 h^2 + b per unit, learned from instruction-off (h, T) of its own unit by
    normalised LMS over the two centred features x = (h, h^2): W += eta S^-1 mean_b(r x),
    S the features' 2 x 2 batch covariance per unit (+1e-12 on its diagonal),
    b += eta mean_b(r) (``numba_kernels.quadratic_predictor_update_reference`` is the
    spec). Float64 reductions, rounded to the parameters' dtype once."""

    # The prediction's (P2 h) h beyond the affine form: a multiply and an add per unit.
    prediction_ops = 2
    # Per unit and example: h^2; the residual (4); centring h, h^2, r (3); the five centred
    # products (5); the batch sums of those five and of h, h^2, r (8).
    update_ops = 21

    def __init__(self, n: int):
        super().__init__(n)
        self.P2: list[torch.Tensor | None] = [None] * n

    def ensure(self, i: int, h: torch.Tensor) -> None:
        if self.P[i] is None:
            super().ensure(i, h)
            self.P2[i] = torch.zeros_like(self.P[i])

    def __call__(self, i: int, h: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        return (self.P[i] * factor + (self.P2[i] * factor) * h) * h + self.b[i] * factor

    def update(self, i: int, h: torch.Tensor, T: torch.Tensor, eta: float) -> None:
        numba_kernels.predictor_update(h.contiguous(), T.contiguous(), self.P[i], self.b[i],
                                       eta, P2=self.P2[i])

    def state(self) -> dict:
        return {**super().state(), "P2": _cloned(self.P2)}

    def load(self, state: dict) -> None:
        super().load(state)
        self.P2 = _cloned(state["P2"])


class ChannelLinear:
    """At each position W h + b, W a map over the population's channels, b per channel,
    both shared over positions; learned from instruction-off (h, T) only, by normalised
    LMS with the channels' batch covariance S (over examples and positions, +1e-4 tr(S)/k
    on its diagonal, so a channel direction with almost no variance barely moves W; the
    fixed point, mean(r x^T) = 0, is the least-squares map whatever the ridge):
    W += eta mean(r x^T) S^-1 (centred), b += eta mean(r). Float64.

    The map is a small matmul (k x k at each position), left to torch's BLAS; the
    signals' element-wise remainder runs fused (``numba_kernels.mixed_traffic_local``)."""

    prediction_ops = 1  # the bias add per unit (the map itself: multiply-accumulates)
    # Per unit and example observed: the residual's subtraction and bias; centring x and
    # r; their means.
    update_ops = 6

    def __init__(self, n: int):
        self.W: list[torch.Tensor | None] = [None] * n
        self.b: list[torch.Tensor | None] = [None] * n
        self.numels = [0] * n  # units per example at each population

    P = property(lambda self: self.W)

    def ensure(self, i: int, h: torch.Tensor) -> None:
        if self.W[i] is None:
            k = h.shape[1]
            self.W[i] = torch.zeros(k, k, dtype=h.dtype, device=h.device)
            self.b[i] = torch.zeros(k, dtype=h.dtype, device=h.device)
        self.numels[i] = h[0].numel()  # also after a resume (load keeps W)

    def prediction_macs(self, shapes: dict) -> int:
        """W h at every position: k^2 per position, k^2 S per example."""
        return sum(s[0] * math.prod(s) for s in shapes.values())

    def update_macs(self, shapes: dict, examples: int, updates: int) -> int:
        """Per example observed, three k^2 S products (the residual's x W^T, the covariance
        x^T x, the cross term x^T r); per update and population the k x k solve with k
        right-hand sides (LU k^3 / 3, then 2 k triangular solves of k^2 / 2: 4 k^3 / 3)."""
        return (examples * 3 * self.prediction_macs(shapes)
                + updates * sum(4 * s[0] ** 3 // 3 for s in shapes.values()))

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:  # (B, k, *S) -> (B prod S, k)
        return x.movedim(1, -1).reshape(-1, x.shape[1])

    def __call__(self, i: int, h: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        # (k, k) @ (B, k, S): contiguous (B, k, S) out, as the kernels read it.
        out = torch.matmul(self.W[i] * factor, h.reshape(len(h), h.shape[1], -1))
        out += (self.b[i] * factor).view(-1, 1)
        return out.view(h.shape)

    def update(self, i: int, h: torch.Tensor, T: torch.Tensor, eta: float) -> None:
        x, t = self._rows(h.double()), self._rows(T.double())
        W, b = self.W[i].double(), self.b[i].double()
        r = t - x @ W.T - b
        xc, rc = x - x.mean(0), r - r.mean(0)
        cov = xc.T @ xc / len(x)
        k = cov.shape[0]
        cov = cov + (1e-4 * float(cov.diagonal().sum()) / k + 1e-300) * torch.eye(
            k, dtype=cov.dtype, device=cov.device)
        step = torch.linalg.solve(cov, (xc.T @ rc / len(x))).T  # mean(r x^T) S^-1
        self.W[i].copy_(W + eta * step)
        self.b[i].copy_(b + eta * r.mean(0))

    @property
    def units(self) -> int:
        return sum(self.numels)

    def state(self) -> dict:
        return {"W": _cloned(self.W), "b": _cloned(self.b)}

    def load(self, state: dict) -> None:
        self.W, self.b = _cloned(state["W"]), _cloned(state["b"])


TRAFFIC_MODELS = ("linear", "saturating", "mixing", "noisy")
PREDICTORS = {"unit_affine": UnitAffine, "unit_quadratic": UnitQuadratic,
              "channel_linear": ChannelLinear}


def make_traffic(params, n: int, seed: int, stream: str):
    """The traffic model ``params.traffic_model`` names (ConfigError naming the choices)."""
    model = getattr(params, "traffic_model", "linear")
    args = (n, seed, stream, params.traffic_seed)
    if model == "linear":
        return LinearTraffic(*args)
    if model == "saturating":
        return SaturatingTraffic(*args)
    if model == "mixing":
        return MixingTraffic(*args, params.mixing)
    if model == "noisy":
        return NoisyTraffic(*args, params.noise)
    raise ConfigError(f"rule_params.traffic_model={model!r}; allowed: "
                      f"{', '.join(TRAFFIC_MODELS)}")


def make_predictor(params, n: int):
    name = getattr(params, "predictor", "unit_affine")
    if name not in PREDICTORS:
        raise ConfigError(f"rule_params.predictor={name!r}; allowed: {', '.join(PREDICTORS)}")
    return PREDICTORS[name](n)


def _delegate(part: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, list(value)))


class Apical:
    """The compartment at every population of one rule: traffic, predictor, signals, log.

    ``params`` carries ``traffic_rule``, ``traffic_sign``, ``traffic_seed`` and
    ``predictor_lr``; ``stream`` names the rule's random stream for C.
    """

    def __init__(self, rule: str, n: int, params, seed: int, stream: str):
        self.rule_name, self.params = rule, params
        self.traffic = make_traffic(params, n, seed, stream)
        self.predictor = make_predictor(params, n)
        # Which fused form computes the signals: per-unit linear traffic with a per-unit
        # predictor runs from C, g, P, b (and P2); any other pair from T and the prediction
        # formed in torch (``mixed_traffic_local``). ``signals`` (mixed_apical) fuses only
        # the seed's pair.
        linear = type(self.traffic) is LinearTraffic
        self.form = ("unit" if linear and type(self.predictor) is UnitAffine else
                     "quadratic" if linear and type(self.predictor) is UnitQuadratic else
                     "given")
        self.fused = self.form == "unit"
        self.shapes: dict = {}  # per-example shape of each population seen
        self.predictor_updates = 0
        self.predictor_examples = 0  # examples the predictor updates saw (the bill)
        self.reset_sums()

    # Shorthands for the per-population tensors and gains (tests and diagnostics use them).
    coefficients = _delegate("traffic", "coefficients")
    gains = _delegate("traffic", "gains")
    P = _delegate("predictor", "P")
    b = _delegate("predictor", "b")

    def ensure(self, hs) -> None:
        """Size the per-unit tensors to the populations the first time they are seen."""
        for i, h in (hs.items() if isinstance(hs, dict) else enumerate(hs)):
            have = self.shapes.setdefault(i, tuple(h.shape[1:]))
            if have != tuple(h.shape[1:]):
                raise ValueError(f"{self.rule_name}: population {i} has per-example shape "
                                 f"{tuple(h.shape[1:])}, but the rule's per-unit tensors have "
                                 f"{have}")
            self.traffic.ensure(i, h)
            self.predictor.ensure(i, h)

    # -- the signals ------------------------------------------------------------------

    def _units(self, i: int, batch: int) -> dict:
        # The kernels work in the gradient's own batch-mean units: traffic and predictor
        # scaled by 1 / B, as the instruction is.
        return dict(C=self.coefficients[i], gain=self.gains[i] / batch, P=self.P[i] / batch,
                    b=self.b[i] / batch, sign=self.params.traffic_sign)

    def signals(self, i: int, I: torch.Tensor, h: torch.Tensor, batch: int = 1,  # noqa: E741
                rule: str | None = None) -> numba_kernels.MixedApical:
        """``rule``'s used signal (default: the rule's own; ``none`` gives innovation's) and
        the sums of squares, for I in d(sum loss)/dh units divided by ``batch``."""
        rule = rule or self.params.traffic_rule
        if not self.fused:
            return numba_kernels.mixed_traffic_reference(
                I, self.traffic(i, h) / batch, self.predictor(i, h) / batch,
                "innovation" if rule == "none" else rule, self.params.traffic_sign)
        return numba_kernels.mixed_apical(I, h, **self._units(i, batch),
                                          rule="innovation" if rule == "none" else rule)

    def local(self, i: int, g: torch.Tensor, h: torch.Tensor, o: torch.Tensor, batch: int,
              **kw) -> numba_kernels.MixedLocal:
        """Population i's fused backward step (``numba_kernels.mixed_local``), g = I / B."""
        if self.form == "given":
            return numba_kernels.mixed_traffic_local(
                g, h, o, self.traffic(i, h, 1 / batch), self.predictor(i, h, 1 / batch),
                rule=self.params.traffic_rule, sign=self.params.traffic_sign, **kw)
        extra = {"P2": self.predictor.P2[i] / batch} if self.form == "quadratic" else {}
        return numba_kernels.mixed_local(g, h, o, **self._units(i, batch), **extra,
                                         rule=self.params.traffic_rule, **kw)

    def log(self, i: int, sums: dict, batch: int, numel: int) -> None:
        """Add one step's sums of squares (batch-mean units, so scaled by B^2) at population i."""
        for name in SIGNALS:
            self.sums[name][i] += float(sums[name]) * batch ** 2
        self.numels[i] += numel

    def reset_sums(self) -> None:
        n = len(self.gains)
        self.sums = {s: [0.0] * n for s in SIGNALS}
        self.numels = [0] * n

    def epoch_rms(self, names: list[str]) -> dict:
        """Per signal, the RMS at each population since the last call, and their mean."""
        out = apical_rms(names, self.sums, self.numels)
        self.reset_sums()
        return out

    # -- the predictor ------------------------------------------------------------------

    def predict(self, hs) -> None:
        """One NLMS step of each unit's predictor on instruction-off (h, T = g C h)."""
        items = list(hs.items() if isinstance(hs, dict) else enumerate(hs))
        for i, h in items:
            self.predictor.update(i, h, self.traffic(i, h), self.params.predictor_lr)
        self.predictor_updates += 1
        self.predictor_examples += len(items[0][1])

    def residual_ratio(self, hs) -> float:
        """RMS of T - (P h + b) over RMS(T), all populations (NaN without any traffic)."""
        ss_r = ss_t = 0.0
        for i, h in (hs.items() if isinstance(hs, dict) else enumerate(hs)):
            t = self.traffic(i, h)
            ss_r += float((t - self.predictor(i, h)).double().square().sum())
            ss_t += float(t.double().square().sum())
        return math.sqrt(ss_r / ss_t) if ss_t > 0 else math.nan

    # -- state and bill -------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {**self.traffic.state(), **self.predictor.state(),
                "predictor_updates": self.predictor_updates,
                "predictor_examples": self.predictor_examples,
                "sums": {k: list(v) for k, v in self.sums.items()}, "numels": list(self.numels)}

    def load_state_dict(self, state: dict) -> None:
        self.traffic.load(state)
        self.predictor.load(state)
        self.predictor_updates = state["predictor_updates"]
        self.predictor_examples = state["predictor_examples"]
        self.sums = {k: list(v) for k, v in state["sums"].items()}
        self.numels = list(state["numels"])

    def predictor_macs(self, examples: int) -> int:
        """The predictor's multiply-accumulates: a prediction per trained example (the
        signals need it at every step), and the updates (warm-up and training)."""
        shapes = self.shapes
        return (examples * self.predictor.prediction_macs(shapes)
                + self.predictor.update_macs(shapes, self.predictor_examples,
                                             self.predictor_updates))

    def predictor_elementwise(self, examples: int = 0) -> int:
        """The updates' element-wise operations (warm-up and training), and the
        prediction's beyond the seed's affine one per trained example."""
        p = self.predictor
        return (self.predictor_examples * p.update_ops + examples * p.prediction_ops) * p.units


def calibrated_gains(rule: str, ratio: float, ss_i: list, ss_ch: list, dtype) -> list:
    """g_l = ratio x RMS(I_l) / RMS(C_l h_l) from the sums of squares over the calibration
    examples (0 where C h is all zero); ConfigError if a gain leaves ``dtype``'s range."""
    gains = [ratio * math.sqrt(si / sc) if sc > 0 else 0.0 for si, sc in zip(ss_i, ss_ch)]
    largest = torch.finfo(dtype).max
    for i, g in enumerate(gains):
        if not g < largest:  # also NaN
            raise ConfigError(
                f"{rule}: rule_params.traffic_ratio={ratio} calibrates population {i}'s gain "
                f"to {g:.3g} (RMS(I) / RMS(C h) = {math.sqrt(ss_i[i] / ss_ch[i]):.3g}), beyond "
                f"{dtype}'s range; use a smaller traffic_ratio")
    return gains


def check_calibrated(rule, examples: int) -> None:
    """Refuse a training step before ``prepare`` calibrated the traffic gains.

    Uncalibrated, every gain is 0: the step would be clean KP while ``traffic_ratio``
    asks for traffic. ``examples``: how many examples the gains were calibrated on
    (0: never). Gains set by hand (any non-zero) are taken as they are.
    """
    ratio = rule.params.traffic_ratio
    if examples == 0 and ratio > 0 and not any(rule.apical.gains):
        raise RuntimeError(
            f"{rule.name}: the traffic gains are not calibrated (all 0, so no traffic would "
            f"mix in although rule_params.traffic_ratio={ratio}): call rule.prepare(x, y) "
            f"with training examples and their labels before the first step (lab's "
            f"trainers do; a resumed run restores the gains through load_state_dict)")


def apical_rms(names: list[str], sums: dict, numels: list[int]) -> dict:
    """Per signal, the RMS at each population over the summed steps, and their mean."""
    apical = {}
    for s in SIGNALS:
        per = {names[i]: math.sqrt(sums[s][i] / numels[i]) if numels[i] else math.nan
               for i in range(len(names))}
        apical[f"rms_{s}"] = {**per, "mean": sum(per.values()) / len(per)}
    return apical
