"""Validated, frozen configuration dataclasses.

Every config in `lab` (trainers, rules, protocols) is a frozen dataclass of
primitives. Declaring a field with :func:`choice` or :func:`bounded` attaches
its constraint; :func:`validate` (called from ``__post_init__``) checks the
type and the constraint of every field, and :func:`from_dict` refuses unknown
keys. Each error names the key, the value and what is allowed, because a
researcher reads them in a notebook traceback, far from this code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from ruamel.yaml import YAML
from ruamel.yaml import YAMLError as _RuamelError
from ruamel.yaml.constructor import SafeConstructor
from ruamel.yaml.resolver import BaseResolver

# Fields that change what is shown, never what is computed: they are left out of a
# run's identity (resume and sweep comparisons), so toggling a progress bar
# never makes a finished run look stale or refuses a resume.
DISPLAY_ONLY = frozenset({"progress"})
# Likewise how often the state is saved: a run resumed from any checkpoint equals the
# uninterrupted one (tests/test_lifecycle.py kills runs anywhere), so a new cadence
# neither makes finished runs stale (a whole protocol retrained for it) nor refuses a
# resume; the resumed run saves at the new one.
OPERATIONAL = frozenset({"checkpoint_every"})
# The largest seed every generator a run seeds accepts (torch takes a signed 64-bit
# integer): a seed field is ``bounded(0, 0, SEED_MAX)``.
SEED_MAX = 2**63 - 1
INT64_MAX = 2**63 - 1  # the largest count a config takes (a torch / numpy int64)


def identity(config: dict) -> dict:
    """A config dict without its display-only and operational fields: what makes two runs
    the same run."""
    return {key: value for key, value in config.items()
            if key not in DISPLAY_ONLY and key not in OPERATIONAL}


class ConfigError(ValueError):
    """A configuration key or value that the config does not allow."""


def choice(default: Any, options: tuple) -> Any:
    """A field whose value must be one of ``options``."""
    return dataclasses.field(default=default, metadata={"choices": tuple(options)})


def bounded(
    default: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Any:
    """A numeric field constrained to an interval (closed unless ``*_open``)."""
    return dataclasses.field(
        default=default,
        metadata={"range": (lo, hi, lo_open, hi_open)},
    )


def _type_ok(value: Any, annotation: Any) -> bool:
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    # bool is a subclass of int: a flag where a count belongs is a mistake.
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    if origin is tuple or annotation is tuple:
        return isinstance(value, tuple)
    return isinstance(value, annotation)


# YAML 1.1 (and many tools) read these as booleans; parameter files and -p read YAML 1.2,
# where only true/false are.
_BOOL_WORDS = frozenset({"yes", "no", "on", "off", "y", "n"})


def _accepts(annotation: Any, kind: type) -> bool:
    """Whether the field's type (or one arm of its union) is ``kind``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_accepts(arg, kind) for arg in typing.get_args(annotation))
    return annotation is kind or typing.get_origin(annotation) is kind


def _type_hint(value: Any, annotation: Any) -> str:
    """How to write the value the field wants, for a string that looks like one: the
    command line and YAML files hand over text such as ``yes`` or ``(1, 5)``."""
    if not isinstance(value, str):
        return ""
    if _accepts(annotation, bool) and value.strip().lower() in _BOOL_WORDS:
        return ("; write true or false (only those are booleans in a parameter or -p value; "
                "papermill's own -p takes True or False)")
    if _accepts(annotation, tuple):
        return "; give a YAML list such as [1, 5, 20]"
    return ""


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation))


def _interval(lo, hi, lo_open, hi_open) -> str:
    # Values must be finite, so an open end is shown open: [0, inf), not [0, inf].
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def dotted_parent(key: str, keys) -> str | None:
    """The key among ``keys`` that the dotted ``key`` sets a leaf inside ("a" for "a.b"),
    or None: a dict parameter given whole and by a dotted key in one place."""
    return next((p for p in keys if key.startswith(p + ".")), None)


class YAMLError(yaml.YAMLError):
    """Text that is not valid YAML, or a key given twice: ``problem`` says what,
    ``line`` and ``column`` (from 1; None when unknown) where.

    (A PyYAML error class while :mod:`lab.sweep` catches ``yaml.YAMLError``.)"""

    def __init__(self, problem: str, line: int | None = None, column: int | None = None):
        super().__init__(problem)
        self.problem, self.line, self.column = problem, line, column


class DuplicateKeyError(YAMLError):
    """A key given twice in one YAML mapping, or two merge keys (``<<``) in one."""


# YAML 1.2's core schema, exactly, for every parameter file, protocol and -p value: only
# true/false are booleans (not yes/no/on/off); ints are decimal (010 is ten), 0o octal
# or 0x hex; floats take 1e-3 and .5; nothing is a date (2026-11-30 stays text, as JSON
# holds it). ruamel's own 1.2 resolver would also read 1_000, 0b101 and dates, which
# would change what a grid value reads back as, hence its run id.
_SCALARS = [  # (tag, pattern, first characters)
    ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    ("float", r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
              r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)", "-+0123456789."),
    ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("merge", r"<<", "<"),
    ("value", r"=", "="),  # no constructor: a bare "=" stays an error, as with PyYAML
]


class _Resolver(BaseResolver):
    processing_version = (1, 2)  # what ruamel's scanner and number constructors ask

    def __init__(self, version=None, loader=None):  # (the version is _SCALARS')
        super().__init__(loader)


for _tag, _pattern, _first in _SCALARS:
    _Resolver.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}",
                                    re.compile(f"^(?:{_pattern})$"), list(_first))


_MERGE_TAG = "tag:yaml.org,2002:merge"
_MERGE = object()  # the merge key's place among a mapping's keys


class _Constructor(SafeConstructor):
    def construct_mapping(self, node, deep=False):
        # A key given twice names both lines (ruamel names one, and checks no mapping
        # that holds a merge key); two `<<:` in one mapping are refused alike.
        seen: dict = {}
        for key_node, _ in node.value:
            merge = key_node.tag == _MERGE_TAG
            key = _MERGE if merge else self.construct_object(key_node, deep=True)
            line, column = key_node.start_mark.line + 1, key_node.start_mark.column + 1
            try:
                first = seen.get(key)
            except TypeError:  # (ruamel would make a list key a tuple)
                raise YAMLError("found unhashable key", line, column) from None
            if first is None:
                seen[key] = line
                continue
            where = f"line {line}" if first == line else f"lines {first} and {line}"
            raise DuplicateKeyError(
                f"the merge key '<<' is given twice ({where}); merge several mappings with "
                "one: <<: [*a, *b]" if merge else
                f"key {key!r} is given twice ({where}); give each key once", line, column)
        return super().construct_mapping(node, deep=deep)



def load_yaml(text: str):
    """Parse a parameter or protocol file, or a -p value (YAML 1.2's core schema);
    a YAMLError (a DuplicateKeyError for a key given twice) says what and where."""
    loader = YAML(typ="safe", pure=True)
    loader.Resolver, loader.Constructor = _Resolver, _Constructor
    try:
        return loader.load(text)
    except _RuamelError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err)
        raise YAMLError(problem, *((mark.line + 1, mark.column + 1) if mark else ())) from None


def read_yaml_mapping(path, what: str, error: type[Exception], expected: str) -> dict:
    """The mapping in the YAML file ``path``; every failure is one ``error`` naming it.

    ``what`` names the file for the researcher ("protocol", "parameter file"),
    ``expected`` says what the file should hold. An empty file is an empty mapping.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise error(f"{what} {path} is a directory; expected {expected}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"{what} {path} cannot be read as text ({err}); expected {expected}") from None
    try:
        loaded = load_yaml(text)
    except YAMLError as err:
        where = f" at line {err.line}, column {err.column}" if err.line else ""
        raise error(f"{what} {path} is not valid YAML{where} ({err.problem}); "
                    f"expected {expected}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise error(f"{what} {path} holds a {type(loaded).__name__}, not a mapping; "
                    f"expected {expected}")
    odd = [key for key in loaded if not isinstance(key, str)]
    if odd:
        raise error(f"{what} {path} has key(s) that are not names: "
                    f"{', '.join(repr(k) for k in odd)}; expected {expected}")
    return loaded


def check_field(owner: str, name: str, value: Any, annotation: Any, metadata) -> None:
    """Raise ConfigError if ``value`` breaks the field's type or constraint."""
    if not _type_ok(value, annotation):
        kind = type(value)
        # numpy's types say so: np.bool_ reads "bool" on its own, as if a bool were refused
        label = (f"numpy.{kind.__name__}" if kind.__module__.split(".")[0] == "numpy"
                 else kind.__name__)
        raise ConfigError(
            f"{owner}.{name} must be {_type_name(annotation)}, got {value!r} "
            f"({label}){_type_hint(value, annotation)}"
        )
    if "choices" in metadata and value not in metadata["choices"]:
        allowed = ", ".join(repr(c) for c in metadata["choices"])
        raise ConfigError(f"{owner}.{name}={value!r} is not allowed; choose one of: {allowed}")
    if "range" in metadata and isinstance(value, (int, float)):
        lo, hi, lo_open, hi_open = metadata["range"]
        # an int beyond a float's range (a 400-digit literal) is not finite as a float:
        # compared as it is, never converted (math.isfinite would overflow on it)
        huge = (not isinstance(value, float) and annotation is not int
                and abs(value) > sys.float_info.max)
        # a count beyond int64 is no size torch or numpy can hold (width=2**70 passed)
        wide = annotation is int and hi is None and abs(value) > INT64_MAX
        bad = huge or wide or (isinstance(value, float) and not math.isfinite(value))
        bad |= lo is not None and (value < lo or (lo_open and value == lo))
        bad |= hi is not None and (value > hi or (hi_open and value == hi))
        if bad:
            shown = repr(value)
            if len(shown) > 40:  # a 400-digit int: its size is what matters
                shown = f"{shown[:6]}...{shown[-3:]} ({len(shown)} digits)"
            beyond = (" (beyond any float: |value| <= 1.8e308)" if huge else
                      f" (beyond a 64-bit integer: |value| <= {INT64_MAX})" if wide else "")
            if wide:
                hi = INT64_MAX
            raise ConfigError(
                f"{owner}.{name}={shown} is out of range{beyond}; allowed: "
                f"{_interval(lo, hi, lo_open, hi_open)}"
            )


def check_in_dtype(config: Any, names: tuple[str, ...], dtype: str,
                   by: str = "optimizer") -> None:
    """Raise ConfigError if a factor the optimizer (or ``by``: the model) applies in
    ``dtype`` (a learning rate, a weight decay, a rule's feedback scale) is too large for
    that dtype: torch would stop the run at its first step with "value cannot be
    converted to type float without overflow", or the model would hold inf."""
    largest = float(np.finfo(dtype).max)
    for name in names:
        value = getattr(config, name)
        if abs(value) > largest:
            raise ConfigError(
                f"{type(config).__name__}.{name}={value!r} overflows {dtype}, the dtype the "
                f"{by} applies it in (largest {largest:.6g}); give a value up to that")


def check_not_below_dtype(config: Any, names: tuple[str, ...], dtype: str,
                          by: str = "model") -> None:
    """Raise ConfigError if a positive scale the model (or ``by``: the optimizer) applies
    in ``dtype`` (a Huber delta, a learning rate) is below its smallest normal number: it
    would be rounded towards 0 there, and the loss it shapes, or the step it scales,
    silently becomes another one (at lr=1e-45 in float32 no weight moved)."""
    tiny = float(np.finfo(dtype).tiny)
    for name in names:
        value = getattr(config, name)
        if 0 < abs(value) < tiny:
            raise ConfigError(
                f"{type(config).__name__}.{name}={value!r} is below the smallest normal "
                f"{dtype} ({tiny:.4g}), the dtype the {by} applies it in; give at least that")


def plain_number(value: Any, annotation: Any) -> Any:
    """A numpy integer, floating or bool scalar as the Python int, float or bool the field
    takes.

    Grids built with numpy (``np.arange``, ``np.linspace``) hand over numpy scalars; a
    config stores Python numbers so records and run hashes stay plain JSON. A numpy
    scalar the field does not take as a Python value (a numpy bool where an int belongs)
    is returned as it is, for ``check_field`` to judge.
    """
    plain = _python_scalar(value)
    if plain is value:
        return value
    return plain if _type_ok(plain, annotation) else value


def _python_scalar(value: Any) -> Any:
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        # float32(0.1) is 0.10000000149011612 as a float: the number the researcher wrote
        # is the shortest text that gives the float32 back (numpy's str), so that is kept
        return float(str(value)) if value.dtype.itemsize < 8 else float(value)
    return value


def _plain_items(value: tuple) -> tuple:
    """A tuple's numpy scalars (nested tuples' too) as Python numbers: a config holding
    them stores them, and a checkpoint that pickles numpy scalars cannot be read back
    with ``torch.load(weights_only=True)`` (the run could never resume)."""
    items = tuple(_plain_items(v) if isinstance(v, tuple) else _python_scalar(v)
                  for v in value)
    return value if all(a is b for a, b in zip(items, value)) else items


def validate(config: Any) -> None:
    """Check every field of a dataclass instance; call from ``__post_init__``.

    A numpy number where an int, float or bool belongs is stored as the Python number
    (``plain_number``; so are the numpy numbers inside a tuple), a list where a tuple
    belongs as the tuple (a record or a YAML file holds it as a list), and a
    ``pathlib.Path`` where text belongs as its text, also in frozen dataclasses.
    """
    owner = type(config).__name__
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        plain = plain_number(value, hints[f.name])
        if isinstance(plain, list) and _accepts(hints[f.name], tuple) \
                and not _accepts(hints[f.name], list):
            plain = tuple(plain)  # YAML and JSON records carry a tuple as a list
        if isinstance(plain, tuple):
            plain = _plain_items(plain)
        if isinstance(plain, os.PathLike) and _accepts(hints[f.name], str) \
                and not _accepts(hints[f.name], os.PathLike):
            plain = os.fspath(plain)  # a data path given as a pathlib.Path, stored as text
            if not isinstance(plain, str):  # a bytes path: refused as what it is
                plain = value
        if plain is not value:
            object.__setattr__(config, f.name, plain)
        check_field(owner, f.name, plain, hints[f.name], f.metadata)


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


class FrozenParams(dict):
    """A dict that cannot change after it is made, hashable: the mapping fields of frozen
    configs (``ConvConfig.rule_params``), so the config is frozen all the way down and can
    be a dict key. JSON, pickle and ``copy`` see a plain dict; ``as_dict`` turns a config
    into plain dicts for records and checkpoints (``torch.load(weights_only=True)``)."""

    def _refuse(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is read-only (a frozen config's parameters); "
                        "build a new config, e.g. dataclasses.replace(config, rule_params=...)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    def __hash__(self):
        return hash(tuple(sorted((k, _hashable(v)) for k, v in self.items())))

    def __reduce__(self):
        return type(self), (dict(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self  # immutable, like a tuple of scalars


def as_dict(config) -> dict:
    """``dataclasses.asdict(config)`` with every mapping a plain dict: what a record and a
    checkpoint store."""
    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return plain(dataclasses.asdict(config))


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def _refuse_unknown(cls, keys) -> None:
    known = field_names(cls)
    unknown = sorted(set(keys) - set(known))
    if unknown:
        raise ConfigError(
            f"{cls.__name__} has no field(s) {', '.join(map(repr, unknown))}; "
            f"known fields: {', '.join(known) or '(none: it takes no parameters)'}"
        )


def from_dict(cls, values: dict | None = None, **overrides):
    """Build ``cls`` from a mapping, refusing keys it does not declare."""
    merged = {**(values or {}), **overrides}
    _refuse_unknown(cls, merged)
    return cls(**merged)


def known_keywords(cls):
    """Class decorator (above ``@dataclass``): ``Cls(bogus=1)`` is the ConfigError
    :func:`from_dict` gives, listing the known fields, not Python's bare TypeError."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        _refuse_unknown(cls, kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def describe(cls) -> dict[str, dict]:
    """Field -> {default, type, choices/range}: what a notebook or CLI can show."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        entry = {"default": f.default, "type": _type_name(hints[f.name])}
        entry.update({k: v for k, v in f.metadata.items()})
        out[f.name] = entry
    return out
