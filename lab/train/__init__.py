"""Trainers on one run lifecycle (``lab.lifecycle``): conv (ResNet + any rule), CfC with an
auxiliary path, and cascaded EP for a transformer (``lab.train.ep``)."""

from .cfc_aux import CfCAuxConfig, train_cfc_aux
from .conv import ConvConfig, build_run, train_conv

__all__ = ["CfCAuxConfig", "ConvConfig", "build_run", "train_cfc_aux", "train_conv"]
