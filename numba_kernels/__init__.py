"""Fused element-wise kernels for the learning rules: the maths once, in three forms.

The mixed apical compartment of DESIGN section 5 (seed 003, the MT-1 protocol;
apical "traffic" beside the teaching signal, as in Kolen-Pollack learning with
a per-unit predictor), and the CfC trainer's gradient merge (DESIGN section 7):

- ``mixed_apical(I, h, C, gain, P, b, rule)``: traffic, raw, innovation and
  matched signals of one population in one fused pass, with the sums of
  squares for RMS logging (matched: per-example norms in the same pass, the
  rescaling in a second);
- ``predictor_update(h, T, P, b, eta)``: the per-unit normalised-LMS step of the
  traffic predictor (per-unit reductions over the batch), in place;
- ``mixed_local(I, h, o, ...)``: a population's whole backward step to the
  output of the layer that made it: the used signal and the instruction through
  the ReLU mask, the residual scale and the batch norm's backward (per-channel
  reductions, then the writes), plus the shortcut's masked instruction
  (kp_traffic's hot path: it replaces autograd's ReLU, scale and norm backward,
  so the traffic adds only element-wise arithmetic, not memory passes); with
  ``P2`` for MT-2's per-unit quadratic predictor, and as ``mixed_traffic_local(I,
  h, o, T, prediction, ...)`` for any traffic model and predictor, their T and
  prediction formed beforehand (a channel map is a matmul, left to torch);
- ``aux_add(dst, src)``: ``dst += src`` in place.

Each exists as a CUDA kernel (``gpu.py``: numba-cuda, zero-copy on torch CUDA
tensors, on torch's current stream), a CPU kernel (``cpu.py``: ``numba.njit(
parallel=True)``, zero-copy on CPU tensors) and a plain torch reference
(``reference.py``, the spec, in the seed's descent convention with the traffic's
``sign``); ``dispatch.py`` checks a call's layout once and picks the form by
device (``backend="torch"`` forces the reference). Reductions use no atomics:
fixed chunking and a fixed combine order, so results repeat bit for bit. The
CPU kernels run on ``NUMBA_NUM_THREADS`` threads (set it per run beside the
torch/OpenMP thread variables so the two pools do not oversubscribe the cores).
Tests hold the CPU forms and the CUDA forms (on the simulator,
``NUMBA_ENABLE_CUDASIM=1``) to the reference and compile every CUDA kernel to
PTX for sm_90.
"""

from .dispatch import (
                        BACKENDS,
                        LOCAL_RULES,
                        RULES,
                        aux_add,
                        mixed_apical,
                        mixed_local,
                        mixed_traffic_local,
                        predictor_update,
                        start_pool,
)
from .reference import (
                        SIGNS,
                        aux_add_reference,
                        mixed_apical_reference,
                        mixed_local_reference,
                        mixed_traffic_local_reference,
                        mixed_traffic_reference,
                        predictor_update_reference,
                        quadratic_predictor_update_reference,
)
from .results import MixedApical, MixedLocal, PredictorStats

__all__ = [
    "BACKENDS",
    "LOCAL_RULES",
    "RULES",
    "SIGNS",
    "MixedApical",
    "MixedLocal",
    "PredictorStats",
    "aux_add",
    "aux_add_reference",
    "mixed_apical",
    "mixed_apical_reference",
    "mixed_local",
    "mixed_local_reference",
    "mixed_traffic_local",
    "mixed_traffic_local_reference",
    "mixed_traffic_reference",
    "predictor_update",
    "predictor_update_reference",
    "quadratic_predictor_update_reference",
    "start_pool",
]
