"""Learning rules behind one interface (see ``base.Rule``), selected by name.

Importing this package registers every rule: bp, fa, kp, usf, brsf, frsf,
wm, rrm, dfa, nodepert, kp_traffic, lhfa, sdil.
"""

from . import bp, dfa, feedback, learned, mirror, nodepert, traffic  # noqa: F401  (registration)
from .base import Rule, StepResult
from .registry import RULES, make_rule, register, resolve_params, rule_class

__all__ = ["RULES", "Rule", "StepResult", "make_rule", "register", "resolve_params", "rule_class"]
