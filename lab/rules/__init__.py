"""Learning rules behind one interface (see ``base.Rule``), selected by name."""

from . import bp  # noqa: F401  (registers the rule)
from .base import Rule, StepResult
from .registry import RULES, make_rule, register, resolve_params, rule_class

__all__ = ["RULES", "Rule", "StepResult", "make_rule", "register", "resolve_params", "rule_class"]
