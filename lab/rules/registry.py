"""Rules looked up by name, so configs and notebooks select them with a string."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..config import SEED_MAX, ConfigError, field_names, from_dict, plain_number

RULES: dict[str, type] = {}


def register(cls):
    if not cls.name or cls.name in RULES:
        raise ValueError(f"rule name {cls.name!r} is empty or already registered")
    RULES[cls.name] = cls
    return cls


def rule_class(name: str) -> type:
    try:
        return RULES[name]
    except KeyError:
        raise ConfigError(
            f"unknown rule {name!r}; known rules: {', '.join(sorted(RULES))}"
        ) from None


def rule_params(name: str, params=None):
    """The rule's Params from a mapping (or a Params instance of that rule), validated.

    An unknown key names the rule and the keys it takes: switching a config's rule
    with ``dataclasses.replace`` must pass the new rule's ``rule_params`` too.
    """
    cls = rule_class(name)
    if isinstance(params, cls.Params):
        return params
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"rule {name!r}: params must be a mapping of parameter names to "
                          f"values or a {cls.Params.__name__}, got {params!r} "
                          f"({type(params).__name__})")
    known = field_names(cls.Params)
    unknown = sorted(set(params or {}) - set(known))
    if unknown:
        takes = (f"it takes {', '.join(known)}" if known else "it takes no parameters")
        raise ConfigError(
            f"rule {name!r} has no parameter(s) {', '.join(map(repr, unknown))}; {takes} "
            "(changing a config's rule with dataclasses.replace? pass rule_params for the new "
            "rule too, e.g. replace(config, rule=..., rule_params={}))")
    try:
        return from_dict(cls.Params, dict(params or {}))
    except ConfigError as err:
        # Named as the researcher wrote it (rule_params.x of rule r), not by the class
        # that holds the fields (TrafficParams.x).
        text = str(err).replace(f"{cls.Params.__name__}.", "rule_params.")
        raise ConfigError(f"rule {name!r}: {text}") from None


def resolve_params(name: str, params) -> dict:
    """Validate ``params`` against the rule's Params and fill in the defaults."""
    return dataclasses.asdict(rule_params(name, params))


def make_rule(name: str, model, params=None, *, seed: int = 0):
    """Rule ``name`` for ``model``; ``params`` a mapping or the rule's Params; ``seed`` the
    run seed its random draws derive from (a numpy integer is taken as the int)."""
    seed = plain_number(seed, int)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"make_rule seed={seed!r} is not allowed; give an integer in "
                          f"[0, {SEED_MAX}] (the run seed)")
    return rule_class(name)(model, rule_params(name, params), seed=seed)
