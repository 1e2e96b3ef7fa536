"""Every ConvConfig field refuses a wrong type and an out-of-range value, by name."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing

import numpy as np
import pytest

from lab.config import ConfigError, DuplicateKeyError, YAMLError, as_dict, from_dict, load_yaml
from lab.train import ConvConfig

HINTS = typing.get_type_hints(ConvConfig)
FIELDS = dataclasses.fields(ConvConfig)
WRONG_TYPE = {int: "3", float: "0.1", str: 3, bool: 1, dict: [1]}


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_wrong_type_names_the_field(f):
    bad = WRONG_TYPE[HINTS[f.name]]
    with pytest.raises(ConfigError, match=rf"ConvConfig\.{f.name} must be"):
        ConvConfig(**{f.name: bad})


def _out_of_range(f):
    if "choices" in f.metadata:
        return "not-a-choice"
    lo, hi, lo_open, hi_open = f.metadata["range"]
    if lo is not None:
        return lo if lo_open else lo - 1
    return hi if hi_open else hi + 1


CONSTRAINED = [f for f in FIELDS if f.metadata]


@pytest.mark.parametrize("f", CONSTRAINED, ids=lambda f: f.name)
def test_out_of_range_names_field_and_allowed(f):
    bad = _out_of_range(f)
    if isinstance(f.default, float) and not isinstance(bad, str):
        bad = float(bad)
    with pytest.raises(ConfigError, match=rf"ConvConfig\.{f.name}=.*(choose one of|allowed)"):
        ConvConfig(**{f.name: bad})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_numbers_are_refused(value):
    with pytest.raises(ConfigError, match="ConvConfig.lr=.*out of range"):
        ConvConfig(lr=value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(depth=21), r"depth=21 is not allowed; use 6n\+2"),
    (dict(rule="magic"), r"rule='magic' is unknown; known rules: .*bp"),
    (dict(rule_params={"nope": 1}), r"ConvConfig.rule_params: rule 'bp' has no "
     r"parameter\(s\) 'nope'; it takes no parameters"),
    (dict(eval_split="test"), r"evaluated exactly once"),
    (dict(val_fraction=0.0), r"needs a validation split"),
    # crop_flip on 1-D signals failed at the first batch, the run already started
    (dict(augment="crop_flip"), r"^ConvConfig.augment='crop_flip' crops and flips images, and "
     r"dataset 'mnist1d' holds 1-D signals; use 'shift' \(circular shifts\), 'auto' \(the "
     r"dataset's own\) or 'none'$"),
])
def test_cross_field_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ConvConfig(**kwargs)


def test_test_split_allowed_only_without_periodic_evaluation():
    assert ConvConfig(eval_split="test", eval_every=0).eval_split == "test"


def test_unknown_key_lists_known_fields():
    with pytest.raises(ConfigError, match=r"no field\(s\) 'learning_rate'.*known fields: .*lr"):
        from_dict(ConvConfig, {"learning_rate": 0.1})


def test_asdict_round_trips():
    config = ConvConfig(lr=0.05, seed=3)
    assert from_dict(ConvConfig, dataclasses.asdict(config)) == config


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ConvConfig().lr = 1.0


def test_numpy_numbers_are_stored_as_python_numbers():
    # Grids built with numpy hand over numpy scalars: accepted where an int or float
    # belongs, stored as Python numbers so records and run hashes stay plain JSON.
    given = ConvConfig(n_train=np.int64(256), lr=np.float32(0.25), seed=np.uint8(3),
                       rule="kp_traffic",
                       rule_params={"predictor_every": np.int64(5),
                                    "traffic_ratio": np.float64(2.5)})
    plain = ConvConfig(n_train=256, lr=0.25, seed=3, rule="kp_traffic",
                       rule_params={"predictor_every": 5, "traffic_ratio": 2.5})
    assert given == plain and hash(given) == hash(plain)
    for value in (given.n_train, given.seed, given.rule_params["predictor_every"]):
        assert type(value) is int
    for value in (given.lr, given.rule_params["traffic_ratio"]):
        assert type(value) is float
    assert json.dumps(as_dict(given)) == json.dumps(as_dict(plain))
    # float32(0.1) is 0.10000000149011612 exactly; the researcher wrote 0.1 (np.linspace
    # in float32 hands such values over), so 0.1 is stored, as the record shows it
    narrow = ConvConfig(lr=np.float32(0.1), momentum=np.float16(0.9), weight_decay=np.float32(
        5e-4), rule="kp_traffic", rule_params={"traffic_ratio": np.float32(0.3)})
    assert (narrow.lr, narrow.momentum, narrow.weight_decay) == (0.1, 0.9, 5e-4)
    assert narrow.rule_params["traffic_ratio"] == 0.3
    assert narrow == ConvConfig(lr=0.1, momentum=0.9, weight_decay=5e-4, rule="kp_traffic",
                                rule_params={"traffic_ratio": 0.3})
    assert ConvConfig(lr=np.float64(0.1) + 1e-17).lr == float(np.float64(0.1) + 1e-17)


@pytest.mark.parametrize("value, kind", [
    (np.bool_(True), "numpy.bool"), (True, "bool"), (np.float64(2.5), "numpy.float64")])
def test_numpy_bools_and_fractions_are_still_refused_for_ints(value, kind):
    # (numpy's types named as numpy's: np.bool_ read "(bool)", as if a bool were refused)
    with pytest.raises(ConfigError, match=rf"ConvConfig\.epochs must be int, got .*\({kind}\)"):
        ConvConfig(epochs=value)


def test_numpy_bools_paths_and_numbers_in_tuples_are_stored_as_python_values():
    from pathlib import Path

    from lab.train import CfCAuxConfig, EPConfig

    config = ConvConfig(progress=np.bool_(False), data_dir=Path("/tmp/somewhere"))
    assert config.progress is False and config.data_dir == "/tmp/somewhere"
    assert type(config.data_dir) is str
    assert EPConfig(text_path=Path("/tmp/t.txt")).text_path == "/tmp/t.txt"
    # numpy ints inside a tuple: stored, they made the run's checkpoint unreadable with
    # torch.load(weights_only=True), so the run could never resume
    cfc = CfCAuxConfig(horizons=(np.int64(1), np.int64(5), np.int64(20)))
    assert cfc.horizons == (1, 5, 20) and all(type(h) is int for h in cfc.horizons)
    assert cfc == CfCAuxConfig(horizons=(1, 5, 20))
    with pytest.raises(ConfigError, match=r"CfCAuxConfig.csv_path must be str, got b'x.csv' "
                                          r"\(bytes\)"):
        CfCAuxConfig(csv_path=b"x.csv")


@pytest.mark.parametrize("name", ["ConvConfig", "EPConfig", "CfCAuxConfig"])
def test_a_trainer_config_built_directly_names_an_unknown_key(name):
    # Python's own "__init__() got an unexpected keyword argument" listed nothing.
    import lab.train

    cls = getattr(lab.train, name)
    with pytest.raises(ConfigError, match=rf"^{name} has no field\(s\) 'bogus'; known fields: "
                                          r".*\bseed\b"):
        cls(bogus=1, seed=3)
    assert cls(seed=3).seed == 3 and dataclasses.replace(cls(), seed=4).seed == 4


# ---------------------------------------------------------------------------
# a wrong type given as text says how to write the right one


@dataclasses.dataclass(frozen=True)
class _Typed:
    flag: bool = False
    maybe: bool | None = None
    steps: tuple = (1, 5)
    name: str = "x"

    def __post_init__(self):
        from lab.config import validate

        validate(self)


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "Yes", "OFF", "y", "N"])
def test_a_yes_no_word_for_a_bool_says_write_true_or_false(word):
    for field in ("flag", "maybe"):
        with pytest.raises(ConfigError, match=rf"^_Typed\.{field} must be .*, got '{word}' "
                           r"\(str\); write true or false \(only those are booleans"):
            _Typed(**{field: word})


def test_a_bool_given_other_text_or_a_number_gets_no_yes_no_hint():
    for bad in ("maybe", "1", 1):
        with pytest.raises(ConfigError) as err:
            _Typed(flag=bad)
        assert "write true or false" not in str(err.value)
        assert str(err.value).startswith(f"_Typed.flag must be bool, got {bad!r}")


def test_a_tuple_given_as_text_says_give_a_yaml_list():
    with pytest.raises(ConfigError, match=r"^_Typed\.steps must be tuple, got '\(1,5\)' "
                       r"\(str\); give a YAML list such as \[1, 5, 20\]$"):
        _Typed(steps="(1,5)")
    with pytest.raises(ConfigError) as err:  # not text: no hint about writing it
        _Typed(steps=3)
    assert str(err.value) == "_Typed.steps must be tuple, got 3 (int)"
    with pytest.raises(ConfigError) as err:  # a str field given a number: no hint either
        _Typed(name=3)
    assert str(err.value) == "_Typed.name must be str, got 3 (int)"


def test_the_real_configs_give_the_hints():
    from lab.train import CfCAuxConfig

    with pytest.raises(ConfigError, match=r"ConvConfig\.nesterov must be bool, got 'yes' "
                       r"\(str\); write true or false"):
        ConvConfig(nesterov="yes")
    with pytest.raises(ConfigError, match=r"CfCAuxConfig\.horizons must be tuple, got "
                       r"'\(1,5\)' \(str\); give a YAML list such as \[1, 5, 20\]"):
        CfCAuxConfig(horizons="(1,5)")



@pytest.mark.parametrize("cls, name, by, extra", [
    ("EPConfig", "beta", "nudged phase", {}),
    ("EPConfig", "beta_final", "nudged phase",
     {"beta_schedule": "cosine", "beta": float(np.finfo(np.float32).max)})])
def test_a_model_factor_beyond_the_dtype_is_refused(cls, name, by, extra):
    # beta=1e300 overflowed the nudged phase: the run started and diverged at its first step.
    import lab.train

    config_cls = getattr(lab.train, cls)
    largest = float(np.finfo(np.float32).max)
    assert getattr(config_cls(**{name: largest}, **extra), name) == largest  # the limit
    with pytest.raises(ConfigError, match=rf"^{cls}\.{name}=1e\+300 overflows float32, the "
                       rf"dtype the {by} applies it in \(largest 3\.40282e\+38\)"):
        config_cls(**{**extra, name: 1e300})
    wide = {**extra, "beta": 1e300} if "beta" in extra else extra  # (beta_final <= beta)
    assert getattr(config_cls(**{**wide, name: 1e300}, dtype="float64"), name) == 1e300


@pytest.mark.parametrize("rule, default", [("nodepert", 1), ("lhfa", 4), ("sdil", 4)])
def test_pert_directions_has_a_ceiling(rule, default):
    # 10**12 directions passed validation, and the run hung drawing them.
    from lab.rules.perturbation import PERT_DIRECTIONS_MAX

    assert ConvConfig(rule=rule).rule_params["pert_directions"] == default
    assert ConvConfig(rule=rule, rule_params={"pert_directions": PERT_DIRECTIONS_MAX}) \
        .rule_params["pert_directions"] == PERT_DIRECTIONS_MAX
    with pytest.raises(ConfigError, match=re.escape(
            f"rule_params.pert_directions={10**12} is out of range; allowed: [1, "
            f"{PERT_DIRECTIONS_MAX}]")):
        ConvConfig(rule=rule, rule_params={"pert_directions": 10**12})


# ---------------------------------------------------------------------------
# YAML: parameter files, protocols and -p values read YAML 1.2's core schema


@pytest.mark.parametrize("text, value", [
    # ruamel's own 1.2 resolver reads these four as numbers or a date; the core schema not
    ("1_000", "1_000"), ("0b101", "0b101"), ("2026-11-30", "2026-11-30"), ("12:30", "12:30"),
    ("-0x1F", "-0x1F"), ("-0o17", "-0o17"), ("0x1F", 31), ("0o17", 15), ("010", 10),
    ("+5", 5), (".5", 0.5), ("-.5e-1", -0.05), (".5e1", 5.0), ("1.", 1.0), ("1e3", 1000.0),
    ("-.inf", -math.inf), ("+.INF", math.inf), ("-inf", "-inf"), ("yes", "yes"), ("Off", "Off"),
    ("TRUE", True), ("False", False), ("tRUE", "tRUE"), ("~", None), ("NULL", None),
    ("nULL", "nULL"), ("'1'", "1"),
])
def test_yaml_scalars_follow_the_core_schema(text, value):
    got = load_yaml(f"a: {text}")["a"]
    assert type(got) is type(value) and got == value
    assert load_yaml(f"[{text}]") == [value] and load_yaml(f"{{{text}: x}}") == {value: "x"}


def test_yaml_nan_and_a_bare_equals_sign():
    assert math.isnan(load_yaml("a: .NaN")["a"])
    with pytest.raises(YAMLError, match=r"could not determine a constructor") as err:
        load_yaml("a: =")  # PyYAML's reading, kept: a grid value "=" keeps its run id
    assert (err.value.line, err.value.column) == (1, 4)


def test_yaml_merge_keys():
    text = ("a: &a {lr: 1, m: 2}\nb: &b {lr: 3, z: 4}\n"
            "one: {<<: *a, lr: 9}\nlist: {<<: [*a, *b], z: 0}\n")
    loaded = load_yaml(text)
    assert loaded["one"] == {"lr": 9, "m": 2}  # a key of its own wins over a merged one
    assert loaded["list"] == {"lr": 1, "m": 2, "z": 0}  # the earlier mapping wins (spec)
    # ruamel checks no mapping holding a merge key for keys given twice; this loader does
    with pytest.raises(DuplicateKeyError, match=re.escape(
            "key 'k' is given twice (lines 3 and 4); give each key once")) as err:
        load_yaml("a: &a {lr: 1}\nb: {<<: *a,\n    k: 1,\n  k: 2}")
    assert (err.value.line, err.value.column) == (4, 3)
    with pytest.raises(DuplicateKeyError, match=re.escape(
            "the merge key '<<' is given twice (line 1); merge several mappings with one")):
        load_yaml("a: {<<: {b: 1}, <<: {c: 2}}")


def test_yaml_keys_given_twice_or_unhashable():
    for text, problem, line, column in [
            ("b: 1\na: 1\na: 2", "key 'a' is given twice (lines 2 and 3)", 3, 1),
            ("{1: a, 1.0: b}", "key 1.0 is given twice (line 1)", 1, 8),
            ("{[1, 2]: x}", "found unhashable key", 1, 2)]:
        with pytest.raises(YAMLError) as err:
            load_yaml(text)
        assert err.value.problem.startswith(problem) and \
            (err.value.line, err.value.column) == (line, column), err.value.problem


def test_yaml_syntax_errors_name_the_place():
    with pytest.raises(YAMLError) as err:
        load_yaml("epochs: 2\nlr: [0.1\nseed: 1\n")
    assert (err.value.problem, err.value.line, err.value.column) == (
        "expected ',' or ']', but got ':'", 3, 5)
    assert load_yaml("") is None and load_yaml("# only a comment") is None


def test_the_run_fields_are_declared_once_in_run_config():
    from lab.config import RunConfig
    from lab.train import CfCAuxConfig, EPConfig

    run_fields = [f.name for f in dataclasses.fields(RunConfig)]
    assert run_fields == ["seed", "device", "threads", "checkpoint_every", "progress"]
    for cls, every in ((ConvConfig, 1), (EPConfig, 100), (CfCAuxConfig, 50)):
        assert issubclass(cls, RunConfig)
        assert [f.name for f in dataclasses.fields(cls)][:5] == run_fields
        assert cls().checkpoint_every == every  # the trainer's own default (epochs or steps)
        with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.device='tpu' is not allowed; "
                                              r"choose one of: 'auto', 'cpu', 'cuda'$"):
            cls(device="tpu")


def test_an_int_given_for_a_float_is_stored_as_the_int():
    # A record stores what was written: lr=1 as 1, not 1.0 (a run's identity is its JSON).
    config = ConvConfig(lr=1, weight_decay=0)
    assert type(config.lr) is int and type(config.weight_decay) is int
    assert json.dumps(as_dict(config)).count('"lr": 1,') == 1
    assert type(ConvConfig(lr=0.5).lr) is float
    with pytest.raises(ConfigError, match=r"^ConvConfig\.lr=0 is out of range; allowed: "
                                          r"\(0\.0, inf\)$"):
        ConvConfig(lr=0)
