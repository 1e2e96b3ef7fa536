"""One entry point per kernel: checks the tensors, then runs the CUDA, CPU or torch form.

``backend="auto"`` (the default) picks by device: CUDA tensors go to the
numba-cuda kernels (``gpu.py``, zero-copy through ``__cuda_array_interface__``,
launched on torch's current stream), CPU tensors to the ``numba.njit(parallel=True)``
kernels (``cpu.py``, zero-copy numpy views), anything else to the torch reference.
``backend="torch"`` always runs the reference (``reference.py``); ``backend="numba"``
insists on a numba kernel. Float32 and float64 only. Tensors that require grad
are read through ``.detach()`` (the callers are no-grad rule code). Plain
contiguous CPU tensors of one dtype take a short path to the same kernel (fewer,
cheaper checks; ``mixed_apical``'s hands the kernel data pointers, the others numpy
views); anything else goes through the full checks. Inputs that are not contiguous
are copied to contiguous memory; an in-place output (the predictor's P and b,
``aux_add``'s dst, ``mixed_apical``'s ``out``) must already be contiguous, and is
refused otherwise; so is an inference tensor written outside inference mode (as
torch refuses it), and a sparse or other non-strided tensor anywhere.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import numba
import numpy as np
import torch

from . import cpu, reference
from .results import MixedApical, MixedLocal, PredictorStats

RULES = ("raw", "matched", "innovation")
# mixed_local also takes the clean reference, whose used signal is the instruction.
LOCAL_RULES = ("none", *RULES)
BACKENDS = ("auto", "numba", "torch")
DTYPES = (torch.float32, torch.float64)


def _describe(t: torch.Tensor) -> str:
    return (f"shape {tuple(t.shape)}, stride {t.stride()}, dtype {t.dtype}, "
            f"device {t.device}")


def _tensor(name: str, t, like: torch.Tensor | None = None,
            like_name: str = "the population's") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:  # (no strides to describe)
        raise TypeError(f"{name} is a {str(t.layout).removeprefix('torch.')} tensor of shape "
                        f"{tuple(t.shape)}; numba_kernels takes dense (strided) tensors: pass "
                        f"{name}.to_dense()")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; numba_kernels takes torch.float32 or "
                        f"torch.float64 (cast with .float() or .double())")
    if like is not None and (t.dtype != like.dtype or t.device != like.device):
        raise ValueError(f"{name} ({_describe(t)}) must match {like_name} dtype "
                         f"{like.dtype} and device {like.device}")
    if t.is_neg():
        raise ValueError(f"{name} ({_describe(t)}) is a lazily negated view (negative bit "
                         f"set); pass {name}.resolve_neg()")
    return t.detach() if t.requires_grad else t  # (detach costs a little: aux_add is hot)


def _population(name: str, t, like: torch.Tensor | None = None) -> torch.Tensor:
    t = _tensor(name, t, like)
    if like is not None and t.shape != like.shape:  # (named first: it says what is expected)
        raise ValueError(f"{name} ({_describe(t)}) must have the population's shape "
                         f"{tuple(like.shape)}")
    if t.dim() < 2 or t.numel() == 0:
        raise ValueError(f"{name} ({_describe(t)}) must be a non-empty population "
                         f"(batch, *unit_shape) with at least one unit")
    return t


def _per_unit(name: str, t, like: torch.Tensor) -> torch.Tensor:
    t = _tensor(name, t, like)
    if t.shape != like.shape[1:]:
        raise ValueError(f"{name} ({_describe(t)}) must be per unit, shape "
                         f"{tuple(like.shape[1:])} (the population's shape without the batch)")
    return t


def _span(t: torch.Tensor) -> tuple[int, int]:
    # [first byte, last byte + 1) of the memory the tensor's elements occupy.
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _clashes(out: torch.Tensor, tensors) -> bool:
    """Whether contiguous ``out`` overlaps any contiguous ``tensors`` other than as the very
    same view (the fast paths' cheap check; the checked path names the argument)."""
    lo = out.data_ptr()
    hi = lo + out.numel() * out.element_size()
    for t in tensors:
        if t is None:
            continue
        p = t.data_ptr()
        if p < hi and lo < p + t.numel() * t.element_size() and not (
                p == lo and t.shape == out.shape):
            return True
    return False


def _refuse_overlap(written: str, w: torch.Tensor, others: dict, exact_ok: bool) -> None:
    """A tensor written in place must not share memory with another argument: the
    kernels read and write in their own order, so the result would depend on it
    (torch refuses the same). ``exact_ok``: the very same view is fine (an
    element-wise update reads each element before it writes it)."""
    lo, hi = _span(w)
    for name, t in others.items():
        if t is None or t.numel() == 0 or w.numel() == 0:
            continue
        t_lo, t_hi = _span(t)
        same = (t.data_ptr() == w.data_ptr() and t.shape == w.shape
                and t.stride() == w.stride())
        if t_lo < hi and lo < t_hi and not (exact_ok and same):
            raise ValueError(f"{name} ({_describe(t)}) overlaps {written} "
                             f"({_describe(w)}) in memory (their address ranges cross), and "
                             f"{written} is written in place; pass a copy ({name}.clone())")


def _untracked(name: str, t):
    """Refuse an in-place target autograd tracks: the kernels write through views that
    bypass it, so a gradient through the write would be silently wrong (torch itself
    refuses an in-place op on a leaf that requires grad)."""
    if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{name} ({_describe(t)}) requires grad and is written in place, "
                           "which autograd would not see; write it under torch.no_grad() "
                           f"(as an optimizer step does) or pass {name}.detach()")
    return t


def _in_place(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.is_inference() and not torch.is_inference_mode_enabled():
        # torch refuses this write too (the reference's in-place op raises); the kernels'
        # views would bypass that guard, so the backends would disagree.
        raise RuntimeError(f"{name} ({_describe(t)}) is an inference tensor (made under "
                           f"torch.inference_mode()) and is written in place outside it, "
                           f"which torch does not allow; call inside torch.inference_mode() "
                           f"or pass a normal tensor ({name}.clone() outside inference mode)")
    if not t.is_contiguous():
        raise ValueError(f"{name} ({_describe(t)}) is written in place and must be "
                         f"contiguous (row-major); {name}.contiguous() would be a copy, "
                         f"written instead of {name}: pass a row-major tensor (not a "
                         f"transposed, strided or channels_last one)")
    return t


def _scalar(name: str, x, dtype: torch.dtype | None = None) -> float:
    """A finite number (python, numpy or a one-element tensor); with ``dtype``, one
    that stays finite when rounded to it (the kernels form g*C in the input dtype)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a python float or a one-element tensor, got "
                             f"shape {tuple(x.shape)}")
        x = x.item()  # a host sync on a GPU: the gain is calibrated once, so it is cheap
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number (python float or a one-element tensor), got "
                        f"{x!r} ({type(x).__name__})")
    try:
        x = float(x)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"{name} must be finite, got an integer of {len(str(x))} digits") \
            from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if dtype is not None and abs(x) > torch.finfo(dtype).max:
        raise ValueError(f"{name}={x!r} overflows {dtype} (largest finite value "
                         f"{torch.finfo(dtype).max:.6g}); the kernels work in the inputs' "
                         f"dtype")
    return x


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        kind = type(value)
        kind = kind.__name__ if kind.__module__ == "builtins" else \
            f"{kind.__module__}.{kind.__name__}"  # numpy.bool, not a bare "bool"
        raise TypeError(f"{name} must be True or False (a Python bool), got {value!r} ({kind})")
    return value


_POOL = []  # holds True once numba's thread pool has been started by _start_pool
# NUMBA_DISABLE_JIT=1 (to step through the kernels in a debugger) runs them as Python;
# the short path's pointer intrinsic has no Python form, so the checked path serves then.
_NO_JIT = bool(numba.config.DISABLE_JIT)


def _start_pool() -> None:
    """Start numba's thread pool, keeping torch's thread count (once per process).

    Numba's parallel kernels run on their own OpenMP pool (a second libgomp);
    starting it once torch's pool runs resets the count torch reports and uses, so a
    caller who had set ``torch.set_num_threads(1)`` (jobs side by side) found torch
    on every core after the first kernel call, the two pools oversubscribing the
    cores. Started lazily, at the first CPU kernel call (not at import: a process
    that forks after starting an OpenMP pool can hang its children).
    """
    import numba

    threads = torch.get_num_threads()
    numba.get_num_threads()  # starts the pool
    torch.set_num_threads(threads)
    _POOL.append(True)


def start_pool() -> None:
    """Start numba's thread pool now, keeping torch's thread count, if no kernel call has
    yet (the kernels do it lazily): for a caller that reads or sets numba's thread count,
    which would start the pool without restoring torch's."""
    if not _POOL:
        _start_pool()


def _form(backend: str, device: torch.device) -> str:
    """'cpu', 'cuda' or 'torch': which form runs for these tensors."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    if device.type == "cpu":
        if not _POOL:
            _start_pool()
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


@contextlib.contextmanager
def _cuda_launch(device: torch.device):
    """Inside the tensors' device context, yields a numba stream wrapping torch's current one."""
    from numba import cuda

    with cuda.gpus[device.index or 0]:  # the stream belongs to this device's context
        yield cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)


def _device_array(t: torch.Tensor):
    # No sync on the tensor's stream: every launch goes on torch's current stream, so
    # stream order already places it after the work that produced the tensor.
    from numba import cuda

    return cuda.as_cuda_array(t, sync=False)


def _mark_written(*tensors: torch.Tensor) -> None:
    # Writes through numpy / CUDA array views bypass torch: bump the version counters
    # so autograd still notices an in-place change to a tensor it saved.
    torch.autograd.graph.increment_version(tensors)


_NUMPY_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
# Largest finite value, by numpy dtype (the views' paths) and by torch dtype (addresses').
_LARGEST = {**{dt: float(np.finfo(dt).max) for dt in _NUMPY_DTYPES},
            **{dt: torch.finfo(dt).max for dt in DTYPES}}


def _cpu_views(*tensors):
    """Zero-copy numpy views of plain CPU tensors (no grad), or None: the checked path.

    The callers' hot path (one call per population per step, and ``aux_add`` once per
    step) passes contiguous CPU tensors that need no detaching, and at ResNet-20 sizes
    the checks of the full path cost a visible share of the kernel's time. The checks
    here are few and mostly on the numpy views, whose attributes are cheap; anything
    unusual (grad, CUDA, not a tensor, an odd dtype, not contiguous) goes to the
    checked path, which handles it or raises the error naming the argument (a
    ``None`` too: callers pass an absent ``out`` separately).
    """
    if not _POOL:
        _start_pool()
    views = []
    try:
        for t in tensors:
            # requires_grad first: .numpy() would raise, and a raise costs more than
            # the kernel; is_cpu likewise (a CUDA tensor must not pay for an exception)
            if t.requires_grad or not t.is_cpu:
                return None
            a = t.numpy()
            if a.dtype not in _NUMPY_DTYPES or not a.flags.c_contiguous:
                return None
            views.append(a)
    except (AttributeError, TypeError, RuntimeError):  # not a tensor, conj/neg bit, ...
        return None
    return views


_ITEMSIZE = {torch.float32: 4, torch.float64: 8}  # also: the dtypes the short paths take
_F64 = torch.float64
_increment_version = torch._C._increment_version  # what _mark_written calls, minus a frame


def _mixed_cpu_fast(I, h, C, gain, P, b, code: int, out):  # noqa: E741
    """``mixed_apical`` on contiguous CPU tensors of one dtype and right shapes, else None.

    The callers' hot path: it hands the kernel data pointers (``cpu.mixed_at``) instead
    of numpy views, in one frame, reading as few tensor attributes as it can, and the
    kernel writes the sums into a tensor made here (no numpy array for its result).
    Why so lean: at ResNet-20's smallest population the kernel takes about 0.3 ms, and
    each call finds the Python objects involved out of cache (a training step, like the
    benchmark, streams megabytes between calls), where every attribute read, frame and
    object made costs several times its warm price: the first version of this path
    (numpy views, five 0-d results, helper functions) cost 60-75 us there, the next
    (addresses, a numpy gain and a numpy result) 40-50, and this one about 10 % less
    (with all of L3 flushed between calls: 210 against 240 us).
    Not asked, on purpose: an input's grad (one that requires grad is read as the
    checked path reads its ``.detach()``, the same memory) and the layout (a sparse or
    mkldnn tensor has no data pointer: the RuntimeError sends it to the checked path,
    as the AttributeError sends anything that is not a tensor).
    """
    # A bool is no gain; abs() < inf is False for NaN and inf and, unlike isfinite, never
    # overflows on a huge int (the dtype check below sends that to the checked path).
    if type(gain) not in (float, int) or not abs(gain) < math.inf or _NO_JIT:
        return None
    try:
        dt, shape = h.dtype, h.shape
        units = shape[1:]
        if (dt not in _ITEMSIZE or not abs(gain) <= _LARGEST[dt] or not units
                or I.shape != shape or C.shape != units or P.shape != units
                or b.shape != units or (out is not None and (
                    out.shape != shape or out.requires_grad or out.is_inference()))):
            return None  # the checked path says what is wrong (g*C overflowing, ...)
        addresses = []
        for t in (I, h, C, P, b) if out is None else (I, h, C, P, b, out):
            if not t.is_cpu or t.dtype is not dt or not t.is_contiguous() or t.is_neg():
                return None
            addresses.append(t.data_ptr())
    except (AttributeError, TypeError, RuntimeError):  # not a tensor, no data pointer, ...
        return None
    B = shape[0]
    N = math.prod(units)
    if B * N == 0:
        return None
    if out is None:
        used = torch.empty_like(h, memory_format=torch.contiguous_format)
        addresses.append(used.data_ptr())
    else:
        # out may be I or h itself (each element is read before it is written); any other
        # overlap goes to the checked path, which names it. Spans in bytes.
        item = _ITEMSIZE[dt]
        lo = addresses[5]
        hi = lo + B * N * item
        for k in range(5):
            p = addresses[k]
            if p < hi and lo < p + (B * N if k < 2 else N) * item and not (p == lo and k < 2):
                return None
        used = out
    if not _POOL:
        _start_pool()
    sums = torch.empty(5, dtype=_F64)
    cpu.mixed_at(*addresses, sums.data_ptr(), B, N, float(gain), code, dt is _F64,
                 B * N >= cpu.SERIAL_BELOW)
    if out is not None:
        _increment_version((out,))  # as _mark_written
    return tuple.__new__(MixedApical, (used, sums))


def mixed_apical(I, h, C, gain, P, b, rule: str, *, out=None,  # noqa: E741
                 backend: str = "auto") -> MixedApical:
    """The mixed apical signals of one population, and their sums of squares.

    I (instruction) and h (activity): (B, *U), one dtype and device; C, P, b:
    per-unit (*U); gain: python float or one-element tensor. Traffic T = (g*C)*h, raw
    R = I + T, innovation N = R - (P*h + b) (formed as I + ((g*C - P)*h - b)),
    matched M_e = R_e * ||N_e|| / ||R_e|| per example e (M_e = 0 where R_e == 0).
    ``rule`` picks ``.used``: raw R, innovation N or matched M. The sums of squares
    (``.sums``, a (5,) float64 tensor on the inputs' device in ``MixedApical.SUMS``
    order; ``.ss_used``, ``.ss_raw`` ... are 0-d views of it) are over the whole population;
    for matched, ``ss_used`` is the sum of ||N_e||^2 over examples with R_e != 0
    (what ||M_e|| equals in real arithmetic). ``out`` (B, *U), contiguous, receives
    ``.used`` if given; it may be I or h itself, but the CPU kernel's results then
    differ in the last bits from those into a separate ``out`` (the compiler takes
    the loop's scalar version for aliased memory; the sums, and so matched's
    ``.used``, add in another order): bit for bit run to run only for the same
    aliasing. Precision of the sums: the squares are formed in the input dtype; the CPU
    kernel adds them in the input dtype within chunks of up to ``cpu.CHUNK`` units of a
    row, then the chunks and rows in float64 (float32 inputs: relative error about 1e-7,
    where the reference's float64 sum has about 1e-16; float64 inputs agree to rounding).
    Range: the gain alone is checked against the dtype; a g*C that overflows, or a signal
    whose square does (in float32 any |x| above about 1.8e19), gives inf / NaN, as in the
    reference; matched's row is then NaN. A row whose squares all underflow to zero
    (every |R| below about 2.6e-23 in float32, 1.5e-162 in float64) has ||R_e|| = 0 and is
    sent as zero, as an all-zero row is (the reference does the same). Inputs that require grad
    are read detached: ``.used`` carries no graph.
    """
    if backend == "auto" and type(rule) is str and rule in cpu.RULE_CODES:
        fast = _mixed_cpu_fast(I, h, C, gain, P, b, cpu.RULE_CODES[rule], out)
        if fast is not None:
            return fast
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}; allowed: {', '.join(RULES)}")
    h = _population("h", h)
    I = _population("I", I, like=h)  # noqa: E741
    C, P, b = (_per_unit(n, t, h) for n, t in (("C", C), ("P", P), ("b", b)))
    g = _scalar("gain", gain, h.dtype)
    given = out  # returned as ``.used`` itself; written through its detached alias
    if out is not None:
        out = _in_place("out", _population("out", _untracked("out", out), like=h))
        # The very same view as I or h is fine: each element is read before it is written.
        _refuse_overlap("out", out, {"I": I, "h": h, "C": C, "P": P, "b": b}, exact_ok=True)
    form = _form(backend, h.device)
    if form == "torch":
        res = reference.mixed_apical_reference(I, h, C, g, P, b, rule)
        if out is not None:
            out.copy_(res.used)
            res = res._replace(used=given)
        return res

    B, N = h.shape[0], h.numel() // h.shape[0]
    used = torch.empty_like(h, memory_format=torch.contiguous_format) if out is None else out
    code = cpu.RULE_CODES[rule]
    if form == "cpu":
        I_, h_, C_, P_, b_ = (t.contiguous().numpy() for t in (I, h, C, P, b))
        tot = cpu.mixed_apical(I_.reshape(B, N), h_.reshape(B, N), C_.ravel(),
                               h_.dtype.type(g), P_.ravel(), b_.ravel(), code,
                               used.numpy().reshape(B, N))
        tot = torch.from_numpy(tot)
    else:
        from . import gpu

        flat = [t.contiguous().view(B, N) for t in (I, h)]
        gC = (C.contiguous() * g).view(N)  # the reference's product: same rounding
        units = [gC] + [t.contiguous().view(N) for t in (P, b)]
        shapes = gpu.mixed_workspace_shapes(B, N)
        ws = {k: torch.empty(s, dtype=torch.float64, device=h.device) for k, s in shapes.items()}
        ws["scales"] = torch.empty(shapes["scales"], dtype=h.dtype, device=h.device)
        with _cuda_launch(h.device) as stream:
            arr = _device_array
            gpu.mixed_apical(*(arr(t) for t in flat + units), code, arr(used.view(B, N)),
                             *(arr(ws[k]) for k in ("part", "rows", "scales", "tot")),
                             stream=stream)
        tot = ws["tot"]
    if out is not None:
        _mark_written(out)
        used = given
    return MixedApical(used, tot)


def _channel_stats(name: str, t, h: torch.Tensor) -> torch.Tensor:
    t = _tensor(name, t, h)
    if t.shape != h.shape[1:2]:
        raise ValueError(f"{name} ({_describe(t)}) must hold one value per channel, shape "
                         f"({h.shape[1]},) (dim 1 of the population)")
    return t


def _local_squares(chan, rows, code: int) -> tuple:
    """[used, instruction, raw, innovation, traffic] sums of squares from ``mixed_local``'s
    per-channel sums (Ch, 8) and, for matched, its per-example rows (B, 2): numpy arrays
    or tensors (on a GPU without a host sync)."""
    tot = chan[:, :4].sum(0)  # channels in order: [instruction, traffic, raw, innovation]
    if code == cpu.MATCHED:  # ||M_e|| = ||N_e|| in real arithmetic; zero where raw is zero
        r, n = rows[:, 0], rows[:, 1]  # x - x: NaN where a norm is not finite (a NaN row)
        ss_used = (n * (r > 0) + (r - r) + (n - n)).sum()
    else:
        ss_used = tot[{cpu.RAW: 2, cpu.INNOVATION: 3, cpu.NONE: 0}[code]]
    return ss_used, tot[0], tot[2], tot[3], tot[1]


def _host_squares(chan, rows, code: int) -> tuple:
    """``_local_squares`` of the CPU kernel's numpy sums, added by numpy (both CPU paths,
    so they agree bit for bit), as five 0-d float64 tensors."""
    return torch.from_numpy(np.array(_local_squares(chan, rows, code))).unbind()


def _local_cpu_fast(I, h, o, C, gain, P, b, code: int, mean, invstd, gamma, scale,  # noqa: E741
                    instruction: bool, masked: bool, out):
    """``mixed_local`` on plain contiguous CPU tensors with a norm, else None (checked path).

    kp_traffic calls this once per population per step; the checked path's tensor
    bookkeeping costs about a tenth of the kernel at ResNet-20 sizes.
    """
    if (any(t is None for t in (I, h, o, C, P, b, mean, invstd, gamma))
            or type(gain) not in (float, int)
            or type(scale) not in (float, int)
            or not (abs(gain) < math.inf and abs(scale) < math.inf)
            or type(instruction) is not bool or type(masked) is not bool):
        return None
    views = _cpu_views(I, h, o, C, P, b, mean, invstd, gamma, *(() if out is None else (out,)))
    if views is None:
        return None
    I_, h_, o_, C_, P_, b_, m_, s_, g_, out_ = views if out is not None else (*views, None)
    if out is not None and (out.is_inference()  # the checked path decides
                            or _clashes(out, (I, h, o, C, P, b, mean, invstd, gamma))):
        return None  # the checked path names the overlap
    shape, dt = h_.shape, h_.dtype
    if (not (abs(gain) <= _LARGEST[dt] and abs(scale) <= _LARGEST[dt])
            or len(shape) < 2 or h_.size == 0 or I_.shape != shape or o_.shape != shape
            or not C_.shape == P_.shape == b_.shape == shape[1:]
            or not m_.shape == s_.shape == g_.shape == shape[1:2]
            or (out_ is not None and out_.shape != shape)
            or any(a.dtype is not dt for a in (I_, o_, C_, P_, b_, m_, s_, g_))
            or (out_ is not None and out_.dtype is not dt)):
        return None
    B, Ch = shape[0], shape[1]
    S = h_.size // (B * Ch)
    grad = torch.empty_like(h) if out is None else out
    extra = [torch.empty_like(h) if wanted else None for wanted in (instruction, masked)]
    absent = np.empty((B, Ch, 0), dtype=dt)
    cube = (B, Ch, S)
    chan, rows = cpu.mixed_local(
        I_.reshape(cube), h_.reshape(cube), o_.reshape(cube), grad.numpy().reshape(cube),
        *(absent if t is None else t.numpy().reshape(cube) for t in extra),
        C_.reshape(Ch, S), dt.type(gain), P_.reshape(Ch, S), b_.reshape(Ch, S), code,
        dt.type(scale), m_, s_, g_)
    ss = _host_squares(chan, rows, code)
    norm = torch.from_numpy(chan[:, cpu.L_M:cpu.L_MX + 1].T.astype(dt))  # (2, Ch)
    if out is not None:
        _mark_written(out)
    return MixedLocal(grad, *extra, norm[1], norm[0], *ss)


def mixed_local(I, h, o, C, gain, P, b, rule: str, *, mean=None, invstd=None,  # noqa: E741
                gamma=None, scale: float = 1.0, instruction: bool = False,
                masked: bool = False, out=None, backend: str = "auto") -> MixedLocal:
    """One population's backward step, from h to the output o of the layer that made it.

    For h = relu(scale * norm(o) + shortcut) (or relu(scale * o + shortcut) with no
    norm), I the instruction at h and U the used signal (``mixed_apical``'s; rule
    ``none``: U = I, the clean reference), with L(X) the backward of X through the
    ReLU mask (h > 0), ``scale`` and the batch norm (batch statistics ``mean``,
    ``invstd`` per channel, dim 1; weight ``gamma``, None: 1; no ``mean``: no norm):
    ``.grad`` = L(U), what the layer's weights and the norm's parameters learn from
    (``.dgamma``, ``.dbeta`` per channel); with ``instruction`` also
    ``.instruction_grad`` = L(I), what is carried on to lower layers (clean
    transport); with ``masked`` also ``.masked`` = I where h > 0, what the shortcut
    carries. One pass of sums and one of writes replace autograd's ReLU, scale and
    norm backward (which would read the same tensors for I alone). With zero gain
    and predictor U = I exactly, so ``.grad`` equals ``.instruction_grad`` bit for bit.
    Sums of squares as ``mixed_apical``'s (rule ``none``: ss_used = ss_instruction).
    Shapes: I, h, o, out (B, Ch, *S); C, P, b (Ch, *S).
    """
    if backend == "auto" and type(rule) is str and rule in cpu.LOCAL_CODES:
        fast = _local_cpu_fast(I, h, o, C, gain, P, b, cpu.LOCAL_CODES[rule], mean, invstd,
                               gamma, scale, instruction, masked, out)
        if fast is not None:
            return fast
    if rule not in LOCAL_RULES:
        raise ValueError(f"rule={rule!r}; allowed: {', '.join(LOCAL_RULES)}")
    h = _population("h", h)
    I = _population("I", I, like=h)  # noqa: E741
    # Without a norm o is not read (L(X) needs only the mask and scale); given, it must
    # still be the population's shape, or a caller's mistake would pass unseen.
    if o is None and mean is not None:
        raise TypeError("o is None, but mean / invstd were given: the norm's backward reads "
                        "o, the layer's output before the norm (B, Ch, *S); pass o, or "
                        "leave out mean, invstd and gamma for a layer without a norm")
    o = _population("o", o, like=h) if (o is not None or mean is not None) else None
    o = h if mean is None else o
    C, P, b = (_per_unit(n, t, h) for n, t in (("C", C), ("P", P), ("b", b)))
    instruction, masked = _flag("instruction", instruction), _flag("masked", masked)
    if (mean is None) != (invstd is None) or (mean is None and gamma is not None):
        raise ValueError("mean and invstd come together (the norm's batch statistics), and "
                         "gamma only with them; pass none of the three for a layer without "
                         "a norm")
    if mean is not None:
        mean, invstd = _channel_stats("mean", mean, h), _channel_stats("invstd", invstd, h)
        gamma = torch.ones_like(mean) if gamma is None else _channel_stats("gamma", gamma, h)
    g, sc = _scalar("gain", gain, h.dtype), _scalar("scale", scale, h.dtype)
    given = out
    if out is not None:
        out = _in_place("out", _population("out", _untracked("out", out), like=h))
        _refuse_overlap("out", out, {"I": I, "h": h, "o": o, "C": C, "P": P, "b": b,
                                     "mean": mean, "invstd": invstd, "gamma": gamma},
                        exact_ok=True)
    form = _form(backend, h.device)
    if form == "torch":
        res = reference.mixed_local_reference(I, h, o, C, g, P, b, rule, mean, invstd, gamma,
                                              sc, instruction, masked)
        if out is not None:
            out.copy_(res.grad)
            res = res._replace(grad=given)
        return res
    B, Ch = h.shape[:2]
    S = h[0, 0].numel()
    pop = [t.contiguous().view(B, Ch, S) for t in (I, h, o)]
    grad = (torch.empty_like(pop[0]) if out is None else out).view(B, Ch, S)
    extra = [torch.empty_like(pop[0]) if wanted else None for wanted in (instruction, masked)]
    units = [t.contiguous().view(Ch, S) for t in (C, P, b)]
    stats = None if mean is None else [t.contiguous() for t in (mean, invstd, gamma)]
    code = cpu.LOCAL_CODES[rule]
    if form == "cpu":
        dt = h.numpy().dtype.type
        absent = np.empty((B, Ch, 0), dtype=h.numpy().dtype)
        chan, rows = cpu.mixed_local(
            *(t.numpy() for t in pop), grad.numpy(),
            *(absent if t is None else t.numpy() for t in extra), units[0].numpy(), dt(g),
            units[1].numpy(), units[2].numpy(), code, dt(sc),
            *((None,) * 3 if stats is None else (t.numpy() for t in stats)))
        ss = _host_squares(chan, rows, code)  # as the fast path adds them
        chan = torch.from_numpy(chan)
    else:
        from . import gpu

        f64 = dict(dtype=torch.float64, device=h.device)
        chan, rows = torch.empty((Ch, cpu.L_SUMS), **f64), torch.empty((B, 2), **f64)
        part = torch.empty((B, Ch, cpu.L_SUMS), **f64)
        kac = torch.empty((Ch, 5), dtype=h.dtype, device=h.device)
        fac = torch.ones(B, dtype=h.dtype, device=h.device)
        gC = units[0] * g  # as the reference rounds C * gain
        d = gC - units[1]
        dummy = torch.zeros((1, 1, 1), dtype=h.dtype, device=h.device)
        if stats is None:
            stats = [torch.zeros(1, dtype=h.dtype, device=h.device)] * 3
        dt = np.dtype(str(h.dtype).removeprefix("torch.")).type
        with _cuda_launch(h.device) as stream:
            arr = _device_array
            gpu.mixed_local(*(arr(t) for t in pop), arr(grad),
                            *(arr(dummy if t is None else t) for t in extra),
                            instruction, masked, arr(gC), arr(d), arr(units[2]), arr(fac), code,
                            dt(sc), *(arr(t) for t in stats), mean is not None, arr(chan),
                            arr(rows), arr(part), arr(kac), stream=stream)
        if code != cpu.MATCHED:
            rows = None
        ss = _local_squares(chan, rows, code)
    dgamma = dbeta = None
    if mean is not None:
        dgamma, dbeta = chan[:, cpu.L_MX].to(h.dtype), chan[:, cpu.L_M].to(h.dtype)
    _mark_written(grad)
    result = given if given is not None else grad.view(h.shape)
    inst, msk = (None if t is None else t.view(h.shape) for t in extra)
    return MixedLocal(result, inst, msk, dgamma, dbeta, *ss)


def predictor_update(h, T, P, b, eta, *, backend: str = "auto") -> PredictorStats:
    """One normalised-LMS step of the per-unit predictor, in place on P and b.

    h, T: (B, *U) activity and the traffic it should predict (instruction-off
    observations). With r = T - (P*h + b), per unit over the batch:
    P += eta * mean_b(centred r * centred h) / (var_b(h) + 1e-12) (var biased: the
    mean of centred squares), b += eta * mean_b(r). Both steps use the same r, the
    residual before this update; reductions run in float64. Returns the
    population's sums of squares of r (before the update) and of T.
    """
    h = _population("h", h)
    T = _population("T", T, like=h)
    P = _in_place("P", _per_unit("P", _untracked("P", P), h))
    b = _in_place("b", _per_unit("b", _untracked("b", b), h))
    _refuse_overlap("P", P, {"b": b, "h": h, "T": T}, exact_ok=False)
    _refuse_overlap("b", b, {"h": h, "T": T}, exact_ok=False)
    lr = _scalar("eta", eta, h.dtype)
    if lr < 0:
        # A negative step moves P and b away from the least-squares fit: the predictor
        # would amplify the traffic it is meant to remove (the rules use eta_P in (0, 1]).
        raise ValueError(f"eta={lr!r} is negative; the NLMS step size must be >= 0 (the "
                         "rules' predictor_lr is in (0, 1]; 0 leaves P and b unchanged)")
    form = _form(backend, h.device)
    if form == "torch":
        return reference.predictor_update_reference(h, T, P, b, lr)
    B, N = h.shape[0], h[0].numel()
    flat = [t.contiguous().view(B, N) for t in (h, T)]
    if form == "cpu":
        tot = torch.from_numpy(cpu.predictor_update(*(t.numpy() for t in flat),
                                                    P.view(N).numpy(), b.view(N).numpy(), lr))
    else:
        from . import gpu

        shapes = gpu.predictor_workspace_shapes(N)
        ws = {k: torch.empty(s, dtype=torch.float64, device=h.device) for k, s in shapes.items()}
        with _cuda_launch(h.device) as stream:
            arr = _device_array
            gpu.predictor_update(*(arr(t) for t in flat), arr(P.view(N)), arr(b.view(N)), lr,
                                 arr(ws["part"]), arr(ws["tot"]), stream=stream)
        tot = ws["tot"]
    _mark_written(P, b)
    return PredictorStats(tot[0], tot[1])


def aux_add(dst, src, *, backend: str = "auto") -> torch.Tensor:
    """``dst += src`` in place (same shape, dtype and device; dst contiguous); returns dst.

    Not differentiable: a ``src`` that requires grad is read detached (no graph reaches
    it through dst); a ``dst`` that requires grad is refused outside ``torch.no_grad()``,
    as torch refuses in-place writes to a leaf that requires grad.
    """
    if backend == "auto":
        views = _cpu_views(dst, src)
        if (views is not None and views[0].shape == views[1].shape
                and views[0].dtype == views[1].dtype and views[0].size
                and not dst.is_inference()  # the checked path decides
                and not _clashes(dst, (src,))):  # apart, or the very same view
            cpu.aux_add(views[0].ravel(), views[1].ravel())
            _mark_written(dst)
            return dst
    dst_d = _in_place("dst", _tensor("dst", _untracked("dst", dst)))
    src = _tensor("src", src, like=dst_d, like_name="dst's")
    if src.shape != dst_d.shape:
        raise ValueError(f"src ({_describe(src)}) must have dst's shape {tuple(dst_d.shape)} "
                         f"(no broadcasting)")
    _refuse_overlap("dst", dst_d, {"src": src}, exact_ok=True)
    form = _form(backend, dst_d.device)
    if form == "torch" or dst_d.numel() == 0:
        reference.aux_add_reference(dst_d, src)
        return dst
    flat = src if src.is_contiguous() else src.contiguous()
    if form == "cpu":
        cpu.aux_add(dst_d.numpy().reshape(-1), flat.numpy().reshape(-1))
    else:
        from . import gpu

        with _cuda_launch(dst_d.device) as stream:
            gpu.aux_add(_device_array(dst_d.view(-1)), _device_array(flat.view(-1)),
                        stream=stream)
    _mark_written(dst)
    return dst


__all__ = ["mixed_apical", "mixed_local", "predictor_update", "aux_add", "MixedApical",
           "MixedLocal", "PredictorStats", "RULES", "LOCAL_RULES", "BACKENDS"]
