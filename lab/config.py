"""Configs: frozen pydantic v2 dataclasses, refusing a bad key or value in one paragraph.

Every config in `lab` (trainers, rules, protocols) is declared with :func:`configclass`.
Pydantic checks each field on construction, strictly (a string is not a number, a bool
is not an int), with its :func:`bounded` interval or :func:`choice` options, and refuses
unknown keys; :func:`_refusal` turns its report into a :class:`ConfigError` naming the
key, the value and what is allowed, read in a notebook traceback or on the command line.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import pydantic
import yaml
from pydantic_core import PydanticCustomError
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


def identity(config: dict) -> dict:
    """A config dict without its display-only and operational fields: what makes two runs
    the same run."""
    return {key: value for key, value in config.items()
            if key not in DISPLAY_ONLY and key not in OPERATIONAL}


# Rule parameters added since runs were stored, at the value those runs ran with: a
# stored config without the key is read with it. kp_traffic and sdil added the traffic to
# the gradient (anti-Hebbian) before traffic_sign existed. Torch-free, so `lab runs` and
# the analyses read old records the way resumes and sweeps do.
# MT-2's keys: runs before them had the seed's traffic and predictor.
_BEFORE_MT2 = {"traffic_model": "linear", "mixing": 0.5, "noise": 0.0,
               "predictor": "unit_affine"}
LEGACY_RULE_PARAMS = {"kp_traffic": {"traffic_sign": "anti_hebbian", **_BEFORE_MT2},
                      "sdil": {"traffic_sign": "anti_hebbian", **_BEFORE_MT2}}


def with_legacy_params(config) -> dict:
    """A stored config (a record's or a checkpoint's) with each parameter its rule has
    gained since filled in at the value it ran with (:data:`LEGACY_RULE_PARAMS`), so a run
    made before the parameter existed equals a config asking that value, and differs from
    the new default. Keys the stored config holds are kept."""
    params = config.get("rule_params")
    legacy = LEGACY_RULE_PARAMS.get(config.get("rule")) if isinstance(config.get("rule"),
                                                                     str) else None
    if not legacy or not isinstance(params, dict):
        return dict(config)
    return {**config, "rule_params": {**legacy, **params}}


class ConfigError(ValueError):
    """A configuration key or value that the config does not allow."""


class Diverged(FloatingPointError):
    """Raised inside a training step whose own computation blew up (not only the loss):
    the lifecycle stops the run as ``diverged``, a result, as it does for a loss past its
    bound, instead of ``failed``."""


def choice(default: Any, options: tuple) -> Any:
    """A field whose value must be one of ``options``."""
    return dataclasses.field(default=default, metadata={"choices": tuple(options)})


def bounded(default: Any, lo: float | None = None, hi: float | None = None, *,
            lo_open: bool = False, hi_open: bool = False) -> Any:
    """A finite number in an interval (closed unless ``*_open``): pydantic reads ge/gt/le/lt
    from the field's metadata, an error shows ``range``."""
    limits = {"gt" if lo_open else "ge": lo, "lt" if hi_open else "le": hi}
    return dataclasses.field(default=default, metadata={
        **{key: value for key, value in limits.items() if value is not None},
        "allow_inf_nan": False, "range": (lo, hi, lo_open, hi_open)})


def configclass(cls):
    """Class decorator: ``cls`` as a frozen pydantic dataclass whose fields are checked on
    construction (and by ``dataclasses.replace``); a refused key or value, or a check of
    its ``__post_init__``, raises :class:`ConfigError`."""
    hints = typing.get_type_hints(cls)
    for name in cls.__annotations__:
        hint = hints[name]
        if typing.get_origin(hint) is typing.ClassVar:
            continue
        checks = [pydantic.BeforeValidator(functools.partial(_plain, hint))]
        if _accepts(hint, float) and not _accepts(hint, int):
            checks.append(pydantic.WrapValidator(_keep_int))
        choices = getattr(getattr(cls, name, None), "metadata", {}).get("choices")
        if choices:
            checks.append(pydantic.AfterValidator(functools.partial(_one_of, choices)))
        cls.__annotations__[name] = Annotated[(hint, *checks)]
    # Strict: YAML and -p values arrive typed, so "0.1" is no float and 1 no bool.
    made = pydantic.dataclasses.dataclass(
        frozen=True, config=pydantic.ConfigDict(extra="forbid", strict=True))(cls)
    init = made.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except pydantic.ValidationError as err:
            raise _refusal(made, err) from None

    made.__init__ = __init__
    return made


def _plain(hint: Any, value: Any) -> Any:
    """A value as the field stores it: a numpy number as the Python one (also inside a
    tuple: torch.load(weights_only=True) cannot read a checkpoint holding numpy scalars),
    a list as a tuple (YAML and JSON carry tuples as lists), a ``pathlib.Path`` as text."""
    if isinstance(value, np.generic):
        return plain_number(value, hint)
    if isinstance(value, list) and _accepts(hint, tuple) and not _accepts(hint, list):
        value = tuple(value)
    if isinstance(value, tuple):
        return tuple(_plain(Any, item) for item in value)
    if isinstance(value, os.PathLike) and _accepts(hint, str):
        text = os.fspath(value)
        return text if isinstance(text, str) else value  # a bytes path: refused as bytes
    return value


def plain_number(value: Any, annotation: Any) -> Any:
    """A numpy bool, integer or floating scalar as the Python bool, int or float the field
    takes (grids built with numpy hand them over; records stay plain JSON); any other
    value, or one the field would refuse, as it is (its error names the numpy type)."""
    if isinstance(value, np.bool_):
        plain = bool(value)
    elif isinstance(value, np.integer):
        plain = int(value)
    elif isinstance(value, np.floating):
        # float32(0.1) is 0.10000000149011612: the researcher wrote the shortest text
        # that gives the float32 back (numpy's str)
        plain = float(str(value)) if value.dtype.itemsize < 8 else float(value)
    else:
        return value
    kind = type(plain)
    takes = (annotation is Any or _accepts(annotation, kind)
             or (kind is int and _accepts(annotation, float)))
    return plain if takes else value


def _keep_int(value: Any, handler) -> Any:
    """A float field's check that keeps an int as given: the record stores ``1`` as
    written, not ``1.0`` (a run's identity is its config's JSON)."""
    checked = handler(value)
    return value if type(value) is int else checked


def _one_of(choices: tuple, value: Any) -> Any:
    if value not in choices:
        raise PydanticCustomError("choice", "not one of the field's choices")
    return value


def _accepts(annotation: Any, kind: type) -> bool:
    """Whether the field's type (or one arm of its union) is ``kind``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_accepts(arg, kind) for arg in typing.get_args(annotation))
    return annotation is kind or typing.get_origin(annotation) is kind


@configclass
class RunConfig:
    """The run fields every trainer's config shares, declared once: ``ConvConfig``,
    ``EPConfig`` and ``CfCAuxConfig`` extend it (a trainer redeclares ``checkpoint_every``
    for its own default: it counts the rows of its axis, epochs or steps)."""

    seed: int = bounded(0, 0, SEED_MAX)
    device: str = choice("auto", ("auto", "cpu", "cuda"))
    threads: int = bounded(0, 0)  # 0 = torch's default
    checkpoint_every: int = bounded(1, 0)  # rows between checkpoints; 0 = only at the end
    progress: bool = True  # display only: not part of a run's identity


_RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than",
                           "less_than_equal", "finite_number"})


def _refusal(cls, err: pydantic.ValidationError) -> Exception:
    """Pydantic's report as one paragraph: an unknown key lists the known fields; a value
    out of range shows the interval, one not among the choices lists them, one of the
    wrong type names the type (and how to write it, for text that looks like one); a
    ``__post_init__`` check's own error comes out as it is."""
    errors = err.errors(include_url=False)
    unknown = [e["loc"][0] for e in errors if e["type"] == "unexpected_keyword_argument"]
    if unknown:
        return ConfigError(_unknown(cls, unknown))
    error = errors[0]
    if error["type"] == "value_error" and not error["loc"]:  # raised by __post_init__
        return error["ctx"]["error"]
    fields = dataclasses.fields(cls)
    name = error["loc"][0]  # a keyword, or a positional argument's index
    field = fields[name] if isinstance(name, int) else next(f for f in fields if f.name == name)
    where, value = f"{cls.__name__}.{field.name}", error["input"]
    if error["type"] == "missing_argument":
        return ConfigError(f"{where} is required; give a value")
    if error["type"] == "choice":
        allowed = ", ".join(repr(c) for c in field.metadata["choices"])
        return ConfigError(f"{where}={value!r} is not allowed; choose one of: {allowed}")
    if error["type"] in _RANGE_ERRORS:
        return ConfigError(f"{where}={value!r} is out of range; allowed: "
                           f"{_interval(*field.metadata['range'])}")
    hint = typing.get_type_hints(cls)[field.name]
    # numpy's types say so: np.bool_ reads "bool" on its own, as if a bool were refused
    kind = ("numpy." if isinstance(value, np.generic) else "") + type(value).__name__
    return ConfigError(f"{where} must be {getattr(hint, '__name__', hint)}, got {value!r} "
                       f"({kind}){_type_hint(value, hint)}")


def _unknown(cls, keys) -> str:
    known = field_names(cls)
    return (f"{cls.__name__} has no field(s) {', '.join(map(repr, sorted(keys)))}; "
            f"known fields: {', '.join(known) or '(none: it takes no parameters)'}")


# YAML 1.1 (and many tools) read these as booleans; parameter files and -p read YAML 1.2,
# where only true/false are.
_BOOL_WORDS = frozenset({"yes", "no", "on", "off", "y", "n"})


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


def validate(config: Any) -> None:
    """Check a dataclass instance as :func:`configclass` does, for a plain dataclass that
    calls this from ``__post_init__`` (a rule's ``Params`` written with ``@dataclass``): a
    configclass twin checks it, its values are stored as the twin holds them. A
    configclass was checked on construction: nothing to do."""
    if pydantic.dataclasses.is_pydantic_dataclass(type(config)):
        return
    fields = dataclasses.fields(config)
    checked = _twin(type(config))(**{f.name: getattr(config, f.name) for f in fields})
    for f in fields:
        object.__setattr__(config, f.name, getattr(checked, f.name))


@functools.cache
def _twin(cls):
    hints, fields = typing.get_type_hints(cls), dataclasses.fields(cls)
    return configclass(type(cls.__name__, (), {
        "__module__": cls.__module__, "__annotations__": {f.name: hints[f.name] for f in fields},
        **{f.name: dataclasses.field(default=f.default, default_factory=f.default_factory,
                                     metadata=f.metadata) for f in fields}}))


def check_in_dtype(config: Any, names: tuple[str, ...], dtype: str,
                   by: str = "optimizer") -> None:
    """Raise ConfigError if a factor the optimizer (or ``by``: the model) applies in
    ``dtype`` (a rule's feedback scale, EP's beta) is too large for that dtype."""
    largest = float(np.finfo(dtype).max)
    for name in names:
        value = getattr(config, name)
        if abs(value) > largest:
            raise ConfigError(
                f"{type(config).__name__}.{name}={value!r} overflows {dtype}, the dtype the "
                f"{by} applies it in (largest {largest:.6g}); give a value up to that")


def check_not_below_dtype(config: Any, names: tuple[str, ...], dtype: str,
                          by: str = "model") -> None:
    """Raise ConfigError if a positive scale the model (or ``by``) applies in ``dtype`` is
    below its smallest normal number: rounded towards 0 there, it scales another signal."""
    tiny = float(np.finfo(dtype).tiny)
    for name in names:
        value = getattr(config, name)
        if 0 < abs(value) < tiny:
            raise ConfigError(
                f"{type(config).__name__}.{name}={value!r} is below the smallest normal "
                f"{dtype} ({tiny:.4g}), the dtype the {by} applies it in; give at least that")


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


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


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


def from_dict(cls, values: dict | None = None, **overrides):
    """Build ``cls`` from a mapping, refusing keys it does not declare (by name, also for
    a plain dataclass, which would raise a bare TypeError)."""
    merged = {**(values or {}), **overrides}
    unknown = set(merged) - set(field_names(cls))
    if unknown:
        raise ConfigError(_unknown(cls, unknown))
    return cls(**merged)


def describe(cls) -> dict[str, dict]:
    """Field -> {default, type, choices or range}: what a notebook or CLI can show."""
    hints = typing.get_type_hints(cls)
    return {f.name: {"default": f.default, "type": getattr(hints[f.name], "__name__",
                                                           str(hints[f.name])),
                     **{k: v for k, v in f.metadata.items() if k in ("choices", "range")}}
            for f in dataclasses.fields(cls)}
