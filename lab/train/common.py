"""What the trainers share beyond the run package: the floating-point types a model may use."""

import torch

from .configs import DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
