"""One entry point per kernel: check a call's layout once, then run the CUDA, CPU or torch form.

``backend="auto"`` (the default) picks by device: CUDA tensors go to the
numba-cuda kernels (``gpu.py``, zero-copy through ``__cuda_array_interface__``,
launched on torch's current stream), CPU tensors to the ``numba.njit(parallel=True)``
kernels (``cpu.py``, zero-copy numpy views), anything else to the torch reference.
``backend="torch"`` always runs the reference (``reference.py``, the spec);
``backend="numba"`` insists on a numba kernel. Float32 and float64 only.

The structural checks (shapes, dtypes, devices, layout) run the first time a layout
is seen and are cached by it (shape, stride, dtype and device of every tensor), so
the hot path, one call per population per step, pays a dictionary lookup. Inputs
that are not contiguous are copied; a tensor written in place (P, b, ``dst``,
``out``) must be contiguous. Inputs that require grad are read detached.

The numba forms compute the gradient-convention signals (raw I + T); the seed's
``hebbian`` sign is the same computation with the gain and the predictor negated,
which is exact, so both forms give the reference's bits (``reference.py``).
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch

from . import cpu, reference
from .reference import LOCAL_RULES, RULES, sign_factor
from .results import MixedApical, MixedLocal, PredictorStats

BACKENDS = ("auto", "numba", "torch")
DTYPES = (torch.float32, torch.float64)
_LARGEST = {dt: torch.finfo(dt).max for dt in DTYPES}
_CHECKED: dict = {}  # layout -> the form that runs it ('cpu', 'cuda' or 'torch')


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _layout(kernel: str, backend: str, tensors: dict) -> tuple | None:
    """What the checks depend on: every tensor's shape, stride, dtype and device (None for
    anything without strides: the checks then run, and name it)."""
    try:
        return (kernel, backend, *(None if t is None else (t.shape, t.stride(), t.dtype,
                                                           t.device)
                                   for t in tensors.values()))
    except (AttributeError, RuntimeError):  # not a tensor; a sparse one
        return None


_OPTIONAL = ("out", "mean", "invstd", "gamma", "P2")


def _dense(tensors: dict) -> None:
    for name, t in tensors.items():
        if (t is not None or name not in _OPTIONAL) and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and (t.layout is not torch.strided or t.dtype not in DTYPES):
            raise TypeError(f"{name} ({_describe(t)}, layout {t.layout}) must be a dense "
                            "float32 or float64 tensor (cast with .float() or .double())")


def _check(tensors: dict, population: tuple, per_unit: tuple = (), channel: tuple = (),
           in_place: tuple = ()) -> torch.Tensor:
    """Refuse a call whose tensors do not fit together, naming the argument; returns h
    (the first population), whose dtype and device the others must have."""
    _dense(tensors)
    h = tensors[population[0]]
    if h.dim() < 2 or h.numel() == 0:
        raise ValueError(f"{population[0]} ({_describe(h)}) must be a non-empty population "
                         "(batch, *unit_shape) with at least one unit")
    shapes = {**{n: h.shape for n in population}, **{n: h.shape[1:] for n in per_unit},
              **{n: h.shape[1:2] for n in channel}}
    for name, want in shapes.items():
        t = tensors[name]
        if t is None:
            continue
        if t.dtype != h.dtype or t.device != h.device:
            raise ValueError(f"{name} ({_describe(t)}) must match the population's dtype "
                             f"{h.dtype} and device {h.device}")
        if t.shape != want:
            raise ValueError(f"{name} ({_describe(t)}) must have shape {tuple(want)} "
                             f"(population {tuple(h.shape)})")
    for name in in_place:
        if tensors[name] is not None and not tensors[name].is_contiguous():
            raise ValueError(f"{name} ({_describe(tensors[name])}) is written in place and "
                             f"must be contiguous (row-major): pass a row-major tensor")
    return h


def _untracked(name: str, t) -> None:
    """A target autograd tracks would be written behind its back: refused, as torch refuses
    an in-place write to a leaf that requires grad."""
    if t is not None and t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{name} ({_describe(t)}) requires grad and is written in place, "
                           "which autograd would not see; write it under torch.no_grad() "
                           f"(as an optimizer step does) or pass {name}.detach()")


def _number(name: str, x, dtype: torch.dtype) -> float:
    """A finite number that the dtype holds (the kernels use it in that dtype)."""
    try:
        x = float(x)
    except (TypeError, ValueError, OverflowError):
        raise TypeError(f"{name} must be a finite number, got {x!r}") from None
    if not abs(x) <= _LARGEST[dtype]:  # also NaN
        raise ValueError(f"{name}={x!r} is not a finite {dtype} number (largest "
                         f"{_LARGEST[dtype]:.6g}); the kernels work in the inputs' dtype")
    return x


_POOL = []  # holds True once numba's thread pool has been started by start_pool


def start_pool() -> None:
    """Start numba's thread pool once per process, keeping torch's thread count.

    Numba's parallel kernels run on their own OpenMP pool; starting it after torch's
    resets the count torch uses, so a caller's ``torch.set_num_threads(1)`` would be
    lost. Called at the first CPU kernel call (not at import: a process that forks
    after starting an OpenMP pool can hang its children), or by a caller that reads or
    sets numba's thread count first.
    """
    if _POOL:
        return
    import numba

    threads = torch.get_num_threads()
    numba.get_num_threads()  # starts the pool
    torch.set_num_threads(threads)
    _POOL.append(True)


def _form(backend: str, device: torch.device) -> str:
    """'cpu', 'cuda' or 'torch': which form runs for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    if device.type == "cpu":
        start_pool()
        return "cpu"
    if device.type == "cuda":
        try:
            from . import gpu  # noqa: F401  (numba-cuda: the `cuda` or `test` extra)
        except ImportError as err:
            if backend == "numba":
                raise ImportError("backend='numba' on CUDA tensors needs numba-cuda: "
                                  "pip install 'numba-cuda[cu13]'") from err
            warnings.warn("numba-cuda is not installed; numba_kernels runs the torch "
                          "reference on CUDA tensors", stacklevel=3)
            return "torch"
        return "cuda"
    if backend == "numba":
        raise ValueError(f"backend='numba' has kernels for cpu and cuda tensors, not "
                         f"{device.type}; use backend='auto' or 'torch'")
    return "torch"


def _checked_form(kernel: str, backend: str, tensors: dict, **roles) -> str:
    """The form for this call; the checks run when its layout is first seen."""
    key = _layout(kernel, backend, tensors)
    form = _CHECKED.get(key)
    if form is None:
        h = _check(tensors, **roles)
        form = _CHECKED[key] = _form(backend, h.device)
    return form


@contextlib.contextmanager
def _cuda_launch(device: torch.device):
    """Inside the tensors' device context, yields a numba stream wrapping torch's current one."""
    from numba import cuda

    with cuda.gpus[device.index or 0]:  # the stream belongs to this device's context
        yield cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)


def _device_array(t: torch.Tensor):
    # No sync: every launch goes on torch's current stream, after the work that made t.
    from numba import cuda

    return cuda.as_cuda_array(t, sync=False)


def _flat(t: torch.Tensor, *shape) -> torch.Tensor:
    """A contiguous, detached view (a copy only if t is not contiguous) of the given shape."""
    return t.detach().contiguous().view(*shape)


def _np(t: torch.Tensor, *shape) -> np.ndarray:
    """``_flat`` as a numpy view, in fewer steps (the CPU forms' hot path)."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.numpy().reshape(shape)


def _mark_written(*tensors: torch.Tensor) -> None:
    # Writes through numpy / CUDA array views bypass torch: bump the version counters
    # so autograd still notices an in-place change to a tensor it saved.
    torch.autograd.graph.increment_version(tensors)


def _rule(rule, allowed) -> None:
    if rule not in allowed:
        raise ValueError(f"rule={rule!r}; allowed: {', '.join(allowed)}")


def _kernel_units(gain: float, P, b, sign: str):
    """(gain, P, b) for the numba forms, which compute the gradient-convention raw I + T:
    the hebbian sign is the same with all three negated (exact)."""
    if sign_factor(sign) > 0:
        return -gain, -P, -b
    return gain, P, b


def mixed_apical(I, h, C, gain, P, b, rule: str, *, sign: str = "hebbian", out=None,  # noqa: E741
                 backend: str = "auto") -> MixedApical:
    """The mixed apical signals of one population (``reference.mixed_apical_reference``).

    I (instruction, d loss / dh) and h (activity): (B, *U); C, P, b: per unit (*U);
    gain a number. ``rule`` picks ``.used`` (raw, innovation or matched, in the gradient
    convention); ``.sums`` are the float64 sums of squares in ``MixedApical.SUMS``
    order over the whole population (matched's ``ss_used``: the sum of ||N_e||^2 over
    examples with R_e != 0, what ||M_e|| equals in real arithmetic). ``out`` (B, *U),
    contiguous, receives ``.used`` if given; it may be I or h itself. The CPU kernel
    sums squares in the input dtype within chunks of ``cpu.CHUNK`` units, then in
    float64 (float32: relative error about 1e-7 against the reference's float64 sums).
    """
    _rule(rule, RULES)
    tensors = dict(h=h, I=I, C=C, P=P, b=b, out=out)
    form = _checked_form("mixed_apical", backend, tensors, population=("h", "I", "out"),
                         per_unit=("C", "P", "b"), in_place=("out",))
    _untracked("out", out)
    g = _number("gain", gain, h.dtype)
    if form == "torch":
        res = reference.mixed_apical_reference(I.detach(), h.detach(), C, g, P, b, rule, sign)
        if out is not None:
            with torch.no_grad():
                out.copy_(res.used)
            res = res._replace(used=out)
        return res
    B, N = h.shape[0], h.numel() // h.shape[0]
    used = torch.empty_like(h, memory_format=torch.contiguous_format) if out is None else out
    code = cpu.RULE_CODES[rule]
    if form == "cpu":
        I_, h_, used_ = _np(I, B, N), _np(h, B, N), _np(used, B, N)
        C_, P_, b_ = _np(C, N), _np(P, N), _np(b, N)
        if sign_factor(sign) > 0:  # hebbian: the kernel's I + T with g, P, b negated
            g, P_, b_ = -g, -P_, -b_
        tot = torch.from_numpy(cpu.mixed_apical(I_, h_, C_, h_.dtype.type(g), P_, b_, code,
                                                used_))
    else:
        from . import gpu

        g, P, b = _kernel_units(g, P, b, sign)
        flat = [_flat(t, B, N) for t in (I, h)]
        units = [_flat(t, N) for t in (C, P, b)]
        gC = units[0] * g  # the reference's product: same rounding
        ws = {k: torch.empty(s, dtype=torch.float64, device=h.device)
              for k, s in gpu.mixed_workspace_shapes(B, N).items()}
        ws["scales"] = torch.empty(ws["scales"].shape, dtype=h.dtype, device=h.device)
        with _cuda_launch(h.device) as stream:
            arr = _device_array
            gpu.mixed_apical(*(arr(t) for t in (*flat, gC, *units[1:])), code,
                             arr(used.detach().view(B, N)),
                             *(arr(ws[k]) for k in ("part", "rows", "scales", "tot")),
                             stream=stream)
        tot = ws["tot"]
    if out is not None:
        _mark_written(out)
    return MixedApical(used, tot)


def _local_squares(chan, rows, code: int) -> tuple:
    """[used, instruction, raw, innovation, traffic] sums of squares from ``mixed_local``'s
    per-channel sums (Ch, 8) and, for matched, its per-example rows (B, 2)."""
    tot = chan[:, :4].sum(0)  # channels in order: [instruction, traffic, raw, innovation]
    if code == cpu.MATCHED:  # ||M_e|| = ||N_e|| in real arithmetic; zero where raw is zero
        r, n = rows[:, 0], rows[:, 1]  # x - x: NaN where a norm is not finite (a NaN row)
        ss_used = (n * (r > 0) + (r - r) + (n - n)).sum()
    else:
        ss_used = tot[{cpu.RAW: 2, cpu.INNOVATION: 3, cpu.NONE: 0}[code]]
    return ss_used, tot[0], tot[2], tot[3], tot[1]


def mixed_local(I, h, o, C, gain, P, b, rule: str, *, mean=None, invstd=None,  # noqa: E741
                gamma=None, scale: float = 1.0, instruction: bool = False,
                masked: bool = False, sign: str = "hebbian", out=None, P2=None,
                backend: str = "auto") -> MixedLocal:
    """One population's backward step, from h to the output o of the layer that made it
    (``reference.mixed_local_reference``).

    For h = relu(scale * norm(o) + shortcut) (or relu(scale * o + shortcut) with no
    norm, ``mean`` None), I the instruction at h and U the used signal
    (``mixed_apical``'s; rule ``none``: U = I), with L(X) the backward of X through the
    ReLU mask, ``scale`` and the batch norm (batch statistics ``mean``, ``invstd`` per
    channel, weight ``gamma``, None: 1): ``.grad`` = L(U), ``.dgamma``, ``.dbeta`` the
    norm's parameter gradients from U; with ``instruction`` also ``.instruction_grad``
    = L(I) (clean transport); with ``masked`` also ``.masked`` = I where h > 0 (the
    shortcut's). Shapes: I, h, o, out (B, Ch, *S); C, P, b (Ch, *S). ``P2`` (Ch, *S):
    MT-2's per-unit quadratic predictor P h + P2 h^2 + b (None: the seed's affine one).
    """
    _local_checks(rule, o, mean, invstd, gamma)
    o = h if mean is None else o
    tensors = dict(h=h, I=I, o=o, C=C, P=P, b=b, P2=P2, mean=mean, invstd=invstd, gamma=gamma,
                   out=out)
    form = _checked_form("mixed_local", backend, tensors, population=("h", "I", "o", "out"),
                         per_unit=("C", "P", "b", "P2"), channel=("mean", "invstd", "gamma"),
                         in_place=("out",))
    _untracked("out", out)
    g, sc = _number("gain", gain, h.dtype), _number("scale", scale, h.dtype)
    if mean is not None and gamma is None:
        gamma = torch.ones_like(mean)
    if form == "torch":
        return _written(out, reference.mixed_local_reference(
            I.detach(), h.detach(), o.detach(), C, g, P, b, rule, mean, invstd, gamma, sc,
            instruction, masked, sign, P2))
    return _local_kernel(form, I, h, o, rule, mean, invstd, gamma, sc, instruction, masked,
                         sign, out, dict(C=C, g=g, P=P, b=b, P2=P2))


def mixed_traffic_local(I, h, o, T, prediction, rule: str, *, mean=None,  # noqa: E741
                        invstd=None, gamma=None, scale: float = 1.0,
                        instruction: bool = False, masked: bool = False,
                        sign: str = "hebbian", out=None, backend: str = "auto") -> MixedLocal:
    """``mixed_local`` for any traffic model and predictor (MT-2): the traffic T and the
    predictor's prediction are given as (B, Ch, *S) tensors, in I's units
    (``reference.mixed_traffic_local_reference``): R_d = d + s T, N_d = d + s (T -
    prediction). One fused pass as ``mixed_local``'s, which also reads T and the
    prediction (twice each)."""
    _local_checks(rule, o, mean, invstd, gamma)
    o = h if mean is None else o
    tensors = dict(h=h, I=I, o=o, T=T, prediction=prediction, mean=mean, invstd=invstd,
                   gamma=gamma, out=out)
    form = _checked_form("mixed_traffic_local", backend, tensors,
                         population=("h", "I", "o", "T", "prediction", "out"),
                         channel=("mean", "invstd", "gamma"), in_place=("out",))
    _untracked("out", out)
    sc = _number("scale", scale, h.dtype)
    if mean is not None and gamma is None:
        gamma = torch.ones_like(mean)
    if form == "torch":
        return _written(out, reference.mixed_traffic_local_reference(
            I.detach(), h.detach(), o.detach(), T.detach(), prediction.detach(), rule, mean,
            invstd, gamma, sc, instruction, masked, sign))
    return _local_kernel(form, I, h, o, rule, mean, invstd, gamma, sc, instruction, masked,
                         sign, out, dict(T=T, prediction=prediction))


def _local_checks(rule, o, mean, invstd, gamma) -> None:
    """The checks of the local kernels' arguments that the layout cache does not cover."""
    _rule(rule, LOCAL_RULES)
    if o is None and mean is not None:
        raise TypeError("o is None, but mean / invstd were given: the norm's backward reads "
                        "o, the layer's output before the norm (B, Ch, *S); pass o, or leave "
                        "out mean, invstd and gamma for a layer without a norm")
    if (mean is None) != (invstd is None) or (mean is None and gamma is not None):
        raise ValueError("mean and invstd come together (the norm's batch statistics), and "
                         "gamma only with them; pass none of the three for a layer without "
                         "a norm")


def _written(out, res: MixedLocal) -> MixedLocal:
    """The reference's result with its grad copied into ``out`` when given."""
    if out is not None:
        with torch.no_grad():
            out.copy_(res.grad)
        res = res._replace(grad=out)
    return res


def _local_kernel(form, I, h, o, rule, mean, invstd, gamma, sc, instruction, masked,  # noqa: E741
                  sign, out, source: dict) -> MixedLocal:
    """The numba forms of ``mixed_local`` and ``mixed_traffic_local``; ``source`` holds the
    signals' inputs: C, g, P, b (and P2) per unit, or T and the prediction per element."""
    B, Ch = h.shape[:2]
    S = h.numel() // (B * Ch)
    grad = torch.empty((B, Ch, S), dtype=h.dtype, device=h.device) if out is None else out
    extra = [torch.empty((B, Ch, S), dtype=h.dtype, device=h.device) if wanted else None
             for wanted in (instruction, masked)]
    code = cpu.LOCAL_CODES[rule]
    given = "T" in source
    s = sign_factor(sign)
    if form == "cpu":
        pop = [_np(t, B, Ch, S) for t in (I, h, o, grad)]
        dt = pop[0].dtype
        absent = np.empty((B, Ch, 0), dtype=dt)
        stats = (None,) * 3 if mean is None else (_np(t, Ch) for t in (mean, invstd, gamma))
        if given:
            units = (None,) * 4
            kw = dict(T=_np(source["T"], B, Ch, S),
                      prediction=_np(source["prediction"], B, Ch, S), sg=-s)
        else:
            g = source["g"]
            C_, P_, b_ = (_np(source[k], Ch, S) for k in "CPb")
            P2 = None if source["P2"] is None else _np(source["P2"], Ch, S)
            if s > 0:  # hebbian: the kernel's I + T with g, P, b (and P2) negated
                g, P_, b_ = -g, -P_, -b_
                P2 = None if P2 is None else -P2
            units, kw = (C_, dt.type(g), P_, b_), dict(P2=P2)
        chan, rows = cpu.mixed_local(
            *pop, *(absent if t is None else t.numpy() for t in extra), *units, code,
            dt.type(sc), *stats, **kw)
        ss = torch.from_numpy(np.array(_local_squares(chan, rows, code))).unbind()
        chan = torch.from_numpy(chan)
    else:
        from . import gpu

        pop = [_flat(t, B, Ch, S) for t in (I, h, o)]
        stats = None if mean is None else [_flat(t, Ch) for t in (mean, invstd, gamma)]
        f64 = dict(dtype=torch.float64, device=h.device)
        chan, rows = torch.empty((Ch, cpu.L_SUMS), **f64), torch.empty((B, 2), **f64)
        part = torch.empty((B, Ch, cpu.L_SUMS), **f64)
        kac = torch.empty((Ch, 5), dtype=h.dtype, device=h.device)
        fac = torch.ones(B, dtype=h.dtype, device=h.device)
        none_unit = torch.zeros((1, 1), dtype=h.dtype, device=h.device)
        none_pop = torch.zeros((1, 1, 1), dtype=h.dtype, device=h.device)
        if given:
            gC = d = b = q = none_unit
            tx, px = (_flat(source[k], B, Ch, S) for k in ("T", "prediction"))
            gform = gpu.GIVEN
        else:
            g, P, b = _kernel_units(source["g"], source["P"], source["b"], sign)
            C, P, b = (_flat(t, Ch, S) for t in (source["C"], P, b))
            gC = C * g  # as the reference rounds C * gain
            d = gC - P
            q, gform = none_unit, gpu.UNIT
            if source["P2"] is not None:
                q, gform = _flat(-source["P2"] if s > 0 else source["P2"], Ch, S), gpu.QUAD
            tx = px = none_pop
        dummy = torch.zeros((1, 1, 1), dtype=h.dtype, device=h.device)
        if stats is None:
            stats = [torch.zeros(1, dtype=h.dtype, device=h.device)] * 3
        dt = np.dtype(str(h.dtype).removeprefix("torch.")).type
        with _cuda_launch(h.device) as stream:
            arr = _device_array
            gpu.mixed_local(*(arr(t) for t in pop), arr(grad.detach().view(B, Ch, S)),
                            *(arr(dummy if t is None else t) for t in extra),
                            instruction, masked, arr(gC), arr(d), arr(b), arr(fac), code,
                            dt(sc), *(arr(t) for t in stats), mean is not None, arr(chan),
                            arr(rows), arr(part), arr(kac), q=arr(q), tx=arr(tx), px=arr(px),
                            sg=dt(-s), form=gform, stream=stream)
        ss = _local_squares(chan, rows if code == cpu.MATCHED else None, code)
    dgamma = dbeta = None
    if mean is not None:
        dgamma, dbeta = chan[:, cpu.L_MX].to(h.dtype), chan[:, cpu.L_M].to(h.dtype)
    if out is not None:
        _mark_written(out)
    inst, msk = (None if t is None else t.view(h.shape) for t in extra)
    return MixedLocal(grad.view(h.shape) if out is None else out, inst, msk, dgamma, dbeta, *ss)


def predictor_update(h, T, P, b, eta, *, P2=None, backend: str = "auto") -> PredictorStats:
    """One normalised-LMS step of the per-unit predictor, in place on P and b.

    h, T: (B, *U) activity and the traffic it should predict (instruction-off
    observations). With r = T - (P*h + b), per unit over the batch:
    P += eta * mean_b(centred r * centred h) / (var_b(h) + 1e-12) (var biased),
    b += eta * mean_b(r), both from the residual before this update; reductions in
    float64. Returns the population's sums of squares of r (before the update) and T.
    ``P2`` (*U): MT-2's quadratic predictor P h + P2 h^2 + b, stepped over both features
    (``reference.quadratic_predictor_update_reference``), in place on P2 too.
    """
    tensors = dict(h=h, T=T, P=P, b=b, P2=P2)
    form = _checked_form("predictor_update", backend, tensors, population=("h", "T"),
                         per_unit=("P", "b", "P2"), in_place=("P", "b", "P2"))
    for name in ("P", "b", "P2"):
        _untracked(name, tensors[name])
    lr = _number("eta", eta, h.dtype)
    if lr < 0:
        # A negative step moves P and b away from the least-squares fit: the predictor
        # would amplify the traffic it is meant to remove.
        raise ValueError(f"eta={lr!r} is negative; the NLMS step size must be >= 0 (the "
                         "rules' predictor_lr is in (0, 1]; 0 leaves P and b unchanged)")
    if form == "torch":
        with torch.no_grad():
            if P2 is not None:
                return reference.quadratic_predictor_update_reference(h.detach(), T.detach(),
                                                                      P, P2, b, lr)
            return reference.predictor_update_reference(h.detach(), T.detach(), P, b, lr)
    B, N = h.shape[0], h.numel() // h.shape[0]
    if form == "cpu":
        flat = (_np(h, B, N), _np(T, B, N))
        if P2 is None:
            tot = cpu.predictor_update(*flat, _np(P, N), _np(b, N), lr)
        else:
            tot = cpu.quadratic_predictor_update(*flat, _np(P, N), _np(P2, N), _np(b, N), lr)
        tot = torch.from_numpy(tot)
    else:
        from . import gpu

        flat = [_flat(t, B, N) for t in (h, T)]
        P_, b_ = P.detach().view(N), b.detach().view(N)
        ws = {k: torch.empty(s, dtype=torch.float64, device=h.device)
              for k, s in gpu.predictor_workspace_shapes(N).items()}
        with _cuda_launch(h.device) as stream:
            arr = _device_array
            if P2 is None:
                gpu.predictor_update(*(arr(t) for t in flat), arr(P_), arr(b_), lr,
                                     arr(ws["part"]), arr(ws["tot"]), stream=stream)
            else:
                gpu.quadratic_predictor_update(*(arr(t) for t in flat), arr(P_),
                                               arr(P2.detach().view(N)), arr(b_), lr,
                                               arr(ws["part"]), arr(ws["tot"]), stream=stream)
        tot = ws["tot"]
    _mark_written(*(t for t in (P, b, P2) if t is not None))
    return PredictorStats(tot[0], tot[1])


def aux_add(dst, src, *, backend: str = "auto") -> torch.Tensor:
    """``dst += src`` in place (same shape, dtype and device; dst contiguous); returns dst.

    Not differentiable: a ``src`` that requires grad is read detached; a ``dst`` that
    requires grad is refused outside ``torch.no_grad()``.
    """
    tensors = dict(dst=dst, src=src)
    key = _layout("aux_add", backend, tensors)
    form = _CHECKED.get(key)
    if form is None:
        _dense(tensors)
        if src.shape != dst.shape or src.dtype != dst.dtype or src.device != dst.device:
            raise ValueError(f"src ({_describe(src)}) must have dst's shape, dtype and device "
                             f"({_describe(dst)}; no broadcasting)")
        if not dst.is_contiguous():
            raise ValueError(f"dst ({_describe(dst)}) is written in place and must be "
                             "contiguous (row-major): pass a row-major tensor")
        form = _CHECKED[key] = _form(backend, dst.device) if dst.numel() else "torch"
    _untracked("dst", dst)
    if form == "torch":
        with torch.no_grad():
            return reference.aux_add_reference(dst, src.detach())
    if form == "cpu":
        cpu.aux_add(_np(dst, -1), _np(src, -1))
    else:
        d, s = dst.detach().view(-1), _flat(src, -1)
        from . import gpu

        with _cuda_launch(dst.device) as stream:
            gpu.aux_add(_device_array(d), _device_array(s), stream=stream)
    _mark_written(dst)
    return dst


__all__ = ["mixed_apical", "mixed_local", "mixed_traffic_local", "predictor_update", "aux_add",
           "start_pool", "MixedApical", "MixedLocal", "PredictorStats", "RULES", "LOCAL_RULES",
           "BACKENDS"]
