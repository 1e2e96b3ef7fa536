"""Trainers on one run lifecycle (``lab.lifecycle``): conv (ResNet + any rule), cascaded EP
for a causal transformer with a backprop twin, and CfC with an auxiliary supervision path.

Names load on first use (PEP 562), so a notebook that trains one of them does not pay
for importing the other two; the configs come from ``lab.train.configs``, which imports
no torch (a bad value is refused before any trainer loads).
"""

from importlib import import_module

_WHERE = {
    "CfCAuxConfig": "configs", "ConvConfig": "configs", "EPConfig": "configs",
    "train_cfc_aux": "cfc_aux", "build_run": "conv", "train_conv": "conv", "train_ep": "ep",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'lab.train' has no attribute {name!r}")
    return getattr(import_module(f".{_WHERE[name]}", __name__), name)


def __dir__():
    return __all__
