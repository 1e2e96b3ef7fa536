"""Rules looked up by name, so configs and notebooks select them with a string."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping

import numpy as np

from ..config import (
    SEED_MAX,
    ConfigError,
    check_in_dtype,
    check_not_below_dtype,
    field_names,
    from_dict,
    plain_number,
    validate,
)
from .common import check_model

RULES: dict[str, type] = {}


# A rule's name goes into configs, run ids and record paths: plain and lower case.
NAME = re.compile(r"[a-z][a-z0-9_]*")


def register(cls):
    """Class decorator: add a rule to the registry under ``cls.name``.

    A rule is a subclass of :class:`lab.rules.Rule` whose ``name`` is lower-case letters,
    digits and ``_`` (starting with a letter) and whose ``Params`` is a frozen dataclass
    of its hyper-parameters (``lab.config.bounded`` / ``choice`` fields, ``validate`` in
    ``__post_init__``), so that a config can hold them hashed and checked.
    """
    from .base import Rule  # base imports the registry's helpers

    if not (isinstance(cls, type) and issubclass(cls, Rule)):
        raise TypeError(f"register({cls!r}): a rule is a subclass of lab.rules.Rule")
    name = cls.name
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"rule class {cls.__name__}: name={name!r} is not allowed; give "
                         "lower-case letters, digits and _, starting with a letter (it goes "
                         "into configs, run ids and records)")
    old = RULES.get(name)
    # The same class defined again (a notebook cell run twice, a module reloaded) replaces
    # itself; another class under a taken name is refused.
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__,
                                                                  cls.__qualname__):
        raise ValueError(f"rule name {name!r} is already registered, by "
                         f"{old.__module__}.{old.__qualname__}")
    contract = ("compute_gradients(self, x, y, step, record=False), which writes .grad for "
                "one batch and returns a StepResult; see lab/rules/base.py")
    if cls.compute_gradients is Rule.compute_gradients:
        raise TypeError(f"rule {name!r}: {cls.__name__} does not define {contract}")
    try:  # called as compute_gradients(x, y, step, record=...) by every trainer
        inspect.signature(cls.compute_gradients).bind(None, "x", "y", 0, record=False)
    except TypeError as err:
        raise TypeError(f"rule {name!r}: {cls.__name__}.compute_gradients"
                        f"{inspect.signature(cls.compute_gradients)} cannot take the "
                        f"trainers' call ({err}); define {contract}") from None
    params = cls.Params
    if not (isinstance(params, type) and dataclasses.is_dataclass(params)
            and params.__dataclass_params__.frozen):
        raise TypeError(f"rule {name!r}: {cls.__name__}.Params={params!r} is not a frozen "
                        "dataclass; declare the rule's parameters as @dataclass(frozen=True) "
                        "(or leave Params out for a rule without any)")
    bare = [f.name for f in dataclasses.fields(params)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if bare:  # a config names only what it changes: every parameter needs a default
        raise TypeError(f"rule {name!r}: {cls.__name__}.Params field(s) {', '.join(bare)} "
                        "have no default; give each parameter one (e.g. scale: float = "
                        "bounded(1.0, 0.0, lo_open=True)), as a config sets only what it "
                        "changes")
    RULES[name] = cls
    return cls


def rule_class(name: str) -> type:
    try:
        return RULES[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name (a list)
        kind = "" if isinstance(name, str) else f" ({type(name).__name__}; a rule is a name)"
        raise ConfigError(
            f"unknown rule {name!r}{kind}; known rules: {', '.join(sorted(RULES))}"
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
        # The usual slip: a rule's parameter given without choosing that rule.
        owners = sorted(r for r, c in RULES.items()
                        if set(unknown) <= set(field_names(c.Params)))
        shown = " / ".join(owners[:4]) + (" / ..." if len(owners) > 4 else "")
        replace = ("changing a config's rule with dataclasses.replace? pass rule_params for "
                   "the new rule too, e.g. replace(config, rule=..., rule_params={})")
        # Every parameter of another rule, none of this one's: a config made for that rule
        # (its defaults filled in) given this rule by dataclasses.replace, not a slip of -p.
        filled = sorted(r for r, c in RULES.items() if r != name
                        and set(params) == set(field_names(c.Params)))
        if filled:
            some = " / ".join(filled[:4]) + (" / ..." if len(filled) > 4 else "")
            raise ConfigError(
                f"rule {name!r} has no parameter(s) {', '.join(map(repr, unknown))}; {takes}. "
                f"The parameters given are every parameter of rule {some} (a config made for "
                f"such a rule, its defaults filled in): {replace}")
        whose = (f"; {', '.join(map(repr, unknown))}: parameter(s) of rule {shown} (to train "
                 f"with it: -p rule {owners[0]}, or rule={owners[0]!r})" if owners else "")
        raise ConfigError(
            f"rule {name!r} has no parameter(s) {', '.join(map(repr, unknown))}; {takes}"
            f"{whose} ({replace})")
    try:
        made = from_dict(cls.Params, dict(params or {}))
        validate(made)  # again if its __post_init__ did: a custom Params may not
        return made
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
    made = rule_params(name, params)
    check_model(model, name)  # (before its parameters are read)
    weight = next(model.parameters(), None)
    if weight is not None and weight.is_floating_point():
        check_params_in_dtype(name, made, str(weight.dtype).removeprefix("torch."))
    return rule_class(name)(model, made, seed=seed)


# Scales a rule applies in the model's dtype: feedback (B, D) is drawn at feedback_scale,
# probes at mirror_sigma, perturbations at pert_sigma; the traffic gain, the predictor's,
# the mirrors' and A's steps multiply tensors of that dtype too. A value the dtype cannot
# hold is rounded to 0 or inf there: at feedback_scale 1e-300 in float32 every hidden
# layer got no teaching signal and the run still ended "complete" (only the read-out
# learned). Zero, where a rule allows it (no traffic, no decay), is not checked.
DTYPE_SCALES = ("feedback_scale", "mirror_sigma", "pert_sigma", "traffic_ratio",
                "predictor_lr", "mirror_lr", "mirror_decay", "eta_A")


def check_params_in_dtype(name: str, params, dtype: str) -> None:
    """ConfigError if one of the rule's scales (``DTYPE_SCALES``) cannot be applied in
    ``dtype``: below its smallest normal number or above its largest, and for
    ``pert_sigma`` below its epsilon too (a perturbation that small is rounded away next
    to activity of order 1: every perturbed loss equals the clean one)."""
    fields = tuple(field for field in DTYPE_SCALES if hasattr(params, field))
    try:
        check_not_below_dtype(params, fields, dtype)
        check_in_dtype(params, fields, dtype, by="model")
    except ConfigError as err:  # named as the researcher wrote it, as rule_params() does
        raise ConfigError(f"rule {name!r}: "
                          + str(err).replace(f"{type(params).__name__}.", "rule_params.")) \
            from None
    sigma, eps = getattr(params, "pert_sigma", 0), float(np.finfo(dtype).eps)
    if 0 < abs(sigma) < eps:
        raise ConfigError(f"rule {name!r}: rule_params.pert_sigma={sigma!r} is below {dtype}'s "
                          f"epsilon ({eps:.4g}): a perturbation that small is rounded away "
                          "next to activity of order 1, and every perturbed loss equals the "
                          f"clean one (the model applies it in {dtype}); give at least "
                          f"{eps:.4g}")
