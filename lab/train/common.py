"""What the trainers share beyond the run package: the floating-point types a model may use."""

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64}
