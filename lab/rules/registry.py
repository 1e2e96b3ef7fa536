"""Rules looked up by name, so configs and notebooks select them with a string."""

from __future__ import annotations

import dataclasses

from ..config import ConfigError, from_dict

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


def resolve_params(name: str, params: dict | None) -> dict:
    """Validate ``params`` against the rule's Params and fill in the defaults."""
    cls = rule_class(name)
    return dataclasses.asdict(from_dict(cls.Params, params or {}))


def make_rule(name: str, model, params: dict | None = None, *, seed: int = 0):
    cls = rule_class(name)
    return cls(model, from_dict(cls.Params, params or {}), seed=seed)
