"""Trainers: the conv (ResNet) trainer; EP and CfC trainers join here."""

from .conv import ConvConfig, build_run, train_conv

__all__ = ["ConvConfig", "build_run", "train_conv"]
