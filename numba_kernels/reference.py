"""The mixed apical compartment in plain torch: the spec the CPU and CUDA kernels are held to.

DESIGN section 5 (seed 003, the MT-1 protocol), written the natural torch way,
top to bottom. At a population h (B, *U) with the instruction I (the gradient,
d loss / dh, this package's convention), the seed mixes in the *descent*
convention: d = -I, and the soma-coupled traffic T = (g*C)*h is added to d, so
on an active unit it pushes the drive up (Hebbian, ``sign="hebbian"``, the
seed's and the default); ``"anti_hebbian"`` adds it to the gradient instead:

    s      = +1 (hebbian) or -1 (anti_hebbian)
    R_d    = d + s*T                             raw
    N_d    = R_d - s*(P*h + b)                   innovation (the predictor removes T)
    M_d    = R_d * ||N_d|| / ||R_d||             matched, per example
    used   = -(R_d | N_d | M_d)                  handed to the optimizer as a gradient

The predictor (P, b per unit) always predicts T itself; the sign only says
which way T enters. Operation order follows the kernels where rounding could
tell them apart: ``g*C`` is formed once in the input dtype, and the
innovation as ``d + s*((g*C - P)*h - b)``, equal to the line above in real
arithmetic and the instruction bit for bit under an exact predictor
(P == g*C, b == 0). The kernels compute the gradient-convention form with
(s*g, s*P, s*b) negated by the sign; negation is exact, so both give the same
bits. Sums of squares are accumulated in float64; the predictor update's
reductions run in float64 and are rounded to the parameters' dtype once.

MT-2 (issue 37) adds two forms of the same signals: the per-unit quadratic
predictor P*h + P2*h^2 + b (``P2``: the correction ((g*C - P) - P2*h)*h - b), and
the general one, ``mixed_traffic_reference``, where any traffic model's T and any
predictor's prediction are given as tensors (N_d = d + s*(T - prediction)).
"""

from __future__ import annotations

import torch

from .results import MixedApical, MixedLocal, PredictorStats

RULES = ("raw", "matched", "innovation")
# mixed_local also takes the clean reference, whose used signal is the instruction.
LOCAL_RULES = ("none", *RULES)
# +1: the traffic is added to the descent direction (the seed's); -1: to the gradient.
SIGNS = {"hebbian": 1, "anti_hebbian": -1}


def _ss(x: torch.Tensor) -> torch.Tensor:
    return x.square().sum(dtype=torch.float64)


def sign_factor(sign: str) -> int:
    """+1 for ``hebbian``, -1 for ``anti_hebbian``; ValueError naming the choices else."""
    try:
        return SIGNS[sign]
    except (KeyError, TypeError):
        raise ValueError(f"sign={sign!r}; allowed: {', '.join(SIGNS)}") from None


def mixed_apical_reference(I, h, C, gain, P, b, rule: str,  # noqa: E741
                           sign: str = "hebbian", P2=None) -> MixedApical:
    """Traffic, raw, innovation and matched for one population (module docstring).

    I, h: (B, *U); C, P, b: (*U); gain a number. ``.used`` is in the gradient
    convention (what the optimizer subtracts); the sums of squares are of the
    gradient-convention signals (the same numbers as the descent ones). ``P2`` (*U),
    MT-2's per-unit quadratic predictor P h + P2 h^2 + b: the correction is then
    ((g*C - P) - P2*h)*h - b, still exactly zero under an exact predictor."""
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}; allowed: {', '.join(RULES)}")
    s = sign_factor(sign)
    d = -I  # the descent instruction
    gC = C * gain  # (*U)
    T = gC * h  # (B, *U) the traffic
    R = d + s * T
    if P2 is None:
        N = d + s * ((gC - P) * h - b)  # = R - s (P h + b)
    else:
        N = d + s * (((gC - P) - P2 * h) * h - b)  # = R - s (P h + P2 h^2 + b)
    return _chosen(I, T, R, N, rule)


def _chosen(I, T, R, N, rule: str) -> MixedApical:  # noqa: E741
    """The rule's signal from raw R_d and innovation N_d, handed over as a gradient."""
    if rule == "raw":
        chosen = R
    elif rule == "innovation":
        chosen = N
    else:
        dims = tuple(range(1, I.dim()))
        ss_r = R.square().sum(dim=dims, dtype=torch.float64)  # (B,)
        ss_n = N.square().sum(dim=dims, dtype=torch.float64)
        # An all-zero raw row has no direction: its matched signal is zero. A row whose
        # norms overflow (or hold a NaN) has none: NaN (x - x is NaN for x = inf or NaN).
        scale = (torch.where(ss_r > 0, (ss_n / ss_r.clamp_min(1e-300)).sqrt(), 0.0)
                 + (ss_r - ss_r) + (ss_n - ss_n))
        chosen = R * scale.to(I.dtype).view(-1, *([1] * (I.dim() - 1)))
    used = -chosen
    return MixedApical(used, torch.stack([_ss(I), _ss(T), _ss(R), _ss(N), _ss(used)]))


def predictor_update_reference(h, T, P, b, eta: float) -> PredictorStats:
    """Normalised-LMS step on P and b in place; statistics of the residual before it."""
    h64, T64 = h.double(), T.double()
    r = T64 - (P.double() * h64 + b.double())  # (B, *U)
    hc = h64 - h64.mean(0)
    rc = r - r.mean(0)
    var = hc.square().mean(0)  # biased: mean of centred squares
    P.copy_(P.double() + eta * (rc * hc).mean(0) / (var + 1e-12))
    b.copy_(b.double() + eta * r.mean(0))  # the same residual as P's step
    return PredictorStats(_ss(r), _ss(T64))  # squares in float64, as the kernels square them


def quadratic_predictor_update_reference(h, T, P, P2, b, eta: float) -> PredictorStats:
    """MT-2's per-unit quadratic predictor P h + P2 h^2 + b: one normalised-LMS step over
    the two centred features x = (h, h^2), in place on P, P2 and b:
    W += eta S^-1 mean_b(r x), S the features' 2 x 2 batch covariance per unit (+1e-12
    on its diagonal; a unit whose S is singular to rounding takes no step),
    b += eta mean_b(r), r = T - (P h + P2 h^2 + b) before the step. Float64 reductions,
    rounded to the parameters' dtype once; returns the sums of squares of r and T."""
    h64, T64 = h.double(), T.double()
    q = h64.square()
    r = T64 - (P.double() * h64 + P2.double() * q + b.double())
    hc, qc, rc = h64 - h64.mean(0), q - q.mean(0), r - r.mean(0)
    a, c, d = (hc * hc).mean(0) + 1e-12, (hc * qc).mean(0), (qc * qc).mean(0) + 1e-12
    u, v = (rc * hc).mean(0), (rc * qc).mean(0)
    det = a * d - c * c
    det = torch.where(det > 1e-24 * a * d, det, torch.inf)  # a degenerate unit: no step
    P.copy_(P.double() + eta * (d * u - c * v) / det)
    P2.copy_(P2.double() + eta * (a * v - c * u) / det)
    b.copy_(b.double() + eta * r.mean(0))
    return PredictorStats(_ss(r), _ss(T64))


def aux_add_reference(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst += src`` in place."""
    return dst.add_(src)


def mixed_local_reference(I, h, o, C, gain, P, b, rule: str, mean=None,  # noqa: E741
                          invstd=None, gamma=None, scale: float = 1.0, instruction: bool = False,
                          masked: bool = False, sign: str = "hebbian", P2=None) -> MixedLocal:
    """One population's backward step to the output o of the layer that made it.

    h = relu(scale * norm(o) + shortcut) (no norm: relu(scale * o + shortcut)).
    For a signal X at h, L(X) = norm backward of m = scale * X * (h > 0), with the
    batch statistics (per channel, dim 1, over the batch and the spatial dims):
    gamma*invstd * (m - mean(m) - xhat*mean(m*xhat)), xhat = (o - mean)*invstd;
    without a norm L(X) = m. ``.grad`` = L(used), ``.instruction_grad`` = L(I),
    ``.masked`` = I * (h > 0) (what the shortcut receives); ``.dgamma``, ``.dbeta``
    the used signal's norm parameter gradients. Rule ``none``: used = I. Norm sums
    in float64. ``P2``: the quadratic predictor's term, as in ``mixed_apical_reference``.
    """
    if rule not in LOCAL_RULES:
        raise ValueError(f"rule={rule!r}; allowed: {', '.join(LOCAL_RULES)}")
    mixed = mixed_apical_reference(I, h, C, gain, P, b,
                                   "innovation" if rule == "none" else rule, sign, P2)
    return _local_from(mixed, I, h, o, rule, mean, invstd, gamma, scale, instruction, masked)


def mixed_traffic_reference(I, T, prediction, rule: str,  # noqa: E741
                            sign: str = "hebbian") -> MixedApical:
    """The signals for any traffic model and predictor (MT-2): T and the prediction are
    given as (B, *U) tensors, R_d = d + s T, N_d = d + s (T - prediction), M_d as above."""
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}; allowed: {', '.join(RULES)}")
    s = sign_factor(sign)
    d = -I
    return _chosen(I, T, d + s * T, d + s * (T - prediction), rule)


def mixed_traffic_local_reference(I, h, o, T, prediction, rule: str, mean=None,  # noqa: E741
                                  invstd=None, gamma=None, scale: float = 1.0,
                                  instruction: bool = False, masked: bool = False,
                                  sign: str = "hebbian") -> MixedLocal:
    """``mixed_local_reference`` for any traffic model and predictor (T, prediction given)."""
    if rule not in LOCAL_RULES:
        raise ValueError(f"rule={rule!r}; allowed: {', '.join(LOCAL_RULES)}")
    mixed = mixed_traffic_reference(I, T, prediction,
                                    "innovation" if rule == "none" else rule, sign)
    return _local_from(mixed, I, h, o, rule, mean, invstd, gamma, scale, instruction, masked)


def _local_from(mixed, I, h, o, rule, mean, invstd, gamma, scale, instruction,  # noqa: E741
                masked) -> MixedLocal:
    used = I if rule == "none" else mixed.used
    sums = (mixed.ss_instruction if rule == "none" else mixed.ss_used, mixed.ss_instruction,
            mixed.ss_raw, mixed.ss_innovation, mixed.ss_traffic)
    on = h > 0
    zero = torch.zeros((), dtype=I.dtype)
    shape = (1, -1) + (1,) * (I.dim() - 2)
    dims = tuple(d for d in range(I.dim()) if d != 1)
    count = I.numel() // I.shape[1]

    def local(signal):
        m = torch.where(on, scale * signal, zero)
        if mean is None:
            return m, None, None
        xhat = (o.double() - mean.double().view(shape)) * invstd.double().view(shape)
        s_m = m.double().sum(dims)
        s_mx = (m.double() * xhat).sum(dims)
        k = invstd.double() * (1.0 if gamma is None else gamma.double())
        v = k.view(shape) * (m.double() - (s_m / count).view(shape)
                             - xhat * (s_mx / count).view(shape))
        return v.to(I.dtype), s_mx.to(I.dtype), s_m.to(I.dtype)

    grad, dgamma, dbeta = local(used)
    return MixedLocal(grad, local(I)[0] if instruction else None,
                      torch.where(on, I, zero) if masked else None, dgamma, dbeta, *sums)
