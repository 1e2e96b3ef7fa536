"""Trainers on one run lifecycle (``lab.lifecycle``): conv (ResNet + any rule), cascaded EP
for a causal transformer with a backprop twin, and CfC with an auxiliary supervision path."""

from .cfc_aux import CfCAuxConfig, train_cfc_aux
from .conv import ConvConfig, build_run, train_conv
from .ep import EPConfig, train_ep

__all__ = ["CfCAuxConfig", "ConvConfig", "EPConfig", "build_run", "train_cfc_aux", "train_conv",
           "train_ep"]
