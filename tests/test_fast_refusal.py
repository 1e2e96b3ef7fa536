"""A bad parameter value is refused before torch, numba or a trainer is imported: the configs
live in ``lab.train.configs``, and the command line builds the config before it loads the
trainer. Each check runs in a fresh interpreter, since this one has torch imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numba", "numba_kernels", "lab.rules", "lab.models", "lab.train.conv",
         "lab.train.ep", "lab.train.cfc_aux", "lab.lifecycle")


def fresh(code: str, cwd: Path = ROOT) -> dict:
    """Run ``code`` in a new interpreter; it leaves its result in ``out``; returns it with
    ``loaded``: which of HEAVY were imported by then."""
    script = (textwrap.dedent(code) + "\nimport json, sys\nout['loaded'] = "
              f"[m for m in {HEAVY!r} if m in sys.modules]\nprint(json.dumps(out))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


REFUSED = [
    ("ConvConfig", {"lr": -1}, r"ConvConfig.lr=-1 is out of range; allowed: (0.0, inf)"),
    ("ConvConfig", {"epochs": 0}, r"ConvConfig.epochs=0 is out of range; allowed: [1, inf)"),
    ("ConvConfig", {"optimizer": "lion"}, "ConvConfig.optimizer='lion' is not allowed; "
     "choose one of: 'sgd', 'adam'"),
    ("ConvConfig", {"depth": 9}, "ConvConfig.depth=9 is not allowed; use 6n+2 "
     "(8, 14, 20, 32, 44, 56, 110)"),  # __post_init__'s own check, before the rules load
    ("ConvConfig", {"bogus": 1}, "ConvConfig has no field(s) 'bogus'"),
    ("EPConfig", {"lr": -1}, "EPConfig.lr=-1 is out of range; allowed: (0.0, inf)"),
    ("EPConfig", {"beta": 1e-9}, "EPConfig.beta=1e-09 is too small for dtype='float32'"),
    ("CfCAuxConfig", {"lr": -1}, "CfCAuxConfig.lr=-1 is out of range; allowed: (0.0, inf)"),
    ("CfCAuxConfig", {"mode": "fast"}, "CfCAuxConfig.mode='fast' is not allowed; choose one "
     "of: 'default', 'no_gate', 'pure'"),
]


@pytest.mark.parametrize("name, values, message", REFUSED,
                         ids=[f"{n}-{next(iter(v))}" for n, v, _ in REFUSED])
def test_a_bad_value_is_refused_before_torch_is_imported(name, values, message):
    out = fresh(f"""
        from lab.config import ConfigError
        from lab.train.configs import {name}
        out = {{}}
        try:
            {name}(**{values!r})
        except ConfigError as err:
            out['error'] = str(err)
    """)
    assert out.get("error", "").startswith(message), out
    assert out["loaded"] == [], out


def test_the_ep_and_cfc_configs_build_without_torch_and_conv_loads_the_rules():
    # A whole valid EP or CfC config needs no torch; a conv config resolves its rule's own
    # Params, which live in the rule's file (and that imports torch): by design.
    out = fresh("""
        from lab.train.configs import CfCAuxConfig, EPConfig
        EPConfig(beta_schedule='cosine', dtype='float64', beta=1e-3, beta_final=1e-4)
        CfCAuxConfig(source='synthetic', horizons=[1, 2], main_horizon=2)
        out = {}
    """)
    assert out["loaded"] == [], out
    out = fresh("""
        from lab.train.configs import ConvConfig
        out = {'params': dict(ConvConfig(rule='fa').rule_params)}
    """)
    assert out["params"] == {"feedback_scale": 1.0, "feedback_seed": 0}
    assert "torch" in out["loaded"] and "lab.rules" in out["loaded"]
    assert "lab.train.conv" not in out["loaded"]  # the rules, not the trainer


@pytest.mark.parametrize("argv", [
    ["train", "--out", "{tmp}/run", "-p", "lr", "-1"],
    ["run", str(ROOT / "notebooks" / "01-train-conv.ipynb"), "--out", "{tmp}/run",
     "-p", "epochs", "-3"],
    ["run", str(ROOT / "notebooks" / "02-train-ep-transformer.ipynb"), "--out", "{tmp}/run",
     "-p", "lr", "-1"],
    ["run", str(ROOT / "notebooks" / "03-train-cfc-aux.ipynb"), "--out", "{tmp}/run",
     "-p", "lr", "-1"],
], ids=["train", "run-conv", "run-ep", "run-cfc"])
def test_the_command_line_refuses_before_importing_a_trainer(tmp_path, argv):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out = fresh(f"""
        import contextlib, io
        from lab.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main({argv!r})
        out = {{'code': code, 'err': err.getvalue()}}
    """, cwd=tmp_path)
    assert out["code"] == 2, out
    assert "is out of range" in out["err"], out
    assert out["loaded"] == [], out
    assert not (tmp_path / "run").exists()


def test_a_sweeps_bad_value_is_refused_before_torch(tmp_path):
    # (every run bad: a valid conv run's config would load its rule, hence torch)
    protocol = tmp_path / "p.yaml"
    protocol.write_text(f"name: p\nnotebook: {ROOT / 'notebooks' / '01-train-conv.ipynb'}\n"
                        "out: runs\nfixed:\n  lr: -1\ngrid:\n  seed: [0, 1]\n")
    out = fresh(f"""
        import contextlib, io
        from lab.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(['sweep', {str(protocol)!r}])
        out = {{'code': code, 'err': err.getvalue()}}
    """, cwd=tmp_path)
    assert out["code"] == 2, out
    assert "ConvConfig.lr=-1 is out of range" in out["err"], out
    assert out["loaded"] == [], out


def test_the_configs_choices_are_the_models_and_numpys_dtype_facts_torchs():
    # configs.py writes these out so that it needs no torch; they must not drift apart.
    import torch

    from lab.models import cfc
    from lab.train import configs
    from lab.train.common import DTYPES

    assert configs.CFC_MODES == cfc.MODES
    assert configs.CFC_ACTIVATIONS == cfc.ACTIVATIONS
    assert set(DTYPES) == set(configs.DTYPE_NAMES)
    for name, dtype in DTYPES.items():  # EP's beta floor and the memory checks read numpy's
        assert float(np.finfo(name).eps) == torch.finfo(dtype).eps
        assert np.finfo(name).bits == torch.finfo(dtype).bits


def test_the_trainers_and_the_notebooks_name_the_same_config_classes():
    import lab.train
    from lab.notebook import config_class
    from lab.train import cfc_aux, configs, conv, ep

    for name, trainer in (("ConvConfig", conv), ("EPConfig", ep), ("CfCAuxConfig", cfc_aux)):
        cls = getattr(configs, name)
        assert getattr(trainer, name) is cls and getattr(lab.train, name) is cls
        assert trainer.EXPERIMENT.config_class is cls
    for notebook, cls in (("01-train-conv", configs.ConvConfig),
                          ("02-train-ep-transformer", configs.EPConfig),
                          ("03-train-cfc-aux", configs.CfCAuxConfig)):
        assert config_class(ROOT / "notebooks" / f"{notebook}.ipynb") is cls


def test_a_training_notebooks_imports_load_no_pandas_nor_the_protocol_machinery():
    # The per-run papermill overhead: a kernel that trains one run and draws its curves
    # (notebooks/01-train-conv.ipynb's imports) needs neither pandas nor the sweep.
    out = fresh("""
        from analysis.figures import run_curves
        from lab.notebook import config_from, record_value
        import sys
        rows = [{'epoch': e, 'train_loss': 1.0 / (e + 1), 'val_loss': None} for e in range(3)]
        figure = run_curves(rows, fields=[('train_loss', 'val_loss')])
        out = {'lines': [len(ax.lines) for ax in figure.axes],
               'unwanted': [m for m in ('pandas', 'lab.sweep', 'analysis.load',
                                        'analysis.completeness', 'analysis.summary')
                            if m in sys.modules]}
    """)
    assert out["lines"] == [1] and out["unwanted"] == [] and out["loaded"] == [], out
