"""Models whose layers and populations learning rules can reach."""

from .layers import Conv, Linear, local_layers
from .resnet import ResNet

__all__ = ["Conv", "Linear", "ResNet", "local_layers"]
