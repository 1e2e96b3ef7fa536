"""lab.device: the allocator policy every run sets (and the thread counts beside it)."""

from __future__ import annotations

import platform
import subprocess
import sys
import warnings

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A step's pattern: many few-megabyte tensors made, then all freed, again and again.
# Prints the minor page faults of the last four rounds.
_ROUNDS = """
import resource, sys, torch
from lab.device import keep_freed_memory
if sys.argv[1] == "policy":
    assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for r in range(5):
    if r == 1:
        start = faults()
    live = [torch.ones(2 << 20) for _ in range(20)]  # 20 x 8 MB, every page touched
    del live
print(faults() - start)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True,
                         text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="the policy is glibc's mallopt")
def test_kept_memory_is_reused_without_page_faults():
    """Rounds 2-5 mostly reuse round 1's pages under the policy; glibc's default trims
    them back to the OS and faults them in again (4 rounds x 160 MB = 160k pages)."""
    # The best of two for the policy: on a loaded machine (parallel test workers) a run can
    # fault more for reasons of its own (reclaim under memory pressure), never fewer.
    default, kept = _faults("default"), min(_faults("policy"), _faults("policy"))
    assert default > 40_000, default  # the pattern does fault by default
    assert kept < default / 4, (kept, default)


def test_configure_process_sets_the_thread_count_numba_included():
    import numba
    import torch

    from lab.device import configure_process

    before = torch.get_num_threads()
    try:
        assert configure_process(1) == 1
        assert torch.get_num_threads() == 1 and numba.get_num_threads() == 1
        assert configure_process(0) == 1  # 0 keeps what is in force
    finally:
        configure_process(before)


def test_more_threads_than_cores_warns_naming_both(monkeypatch):
    import torch

    import lab.sweep
    from lab.device import set_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(lab.sweep, "usable_cores", lambda: 1)
    try:
        with pytest.warns(UserWarning, match=r"threads=2 is more than the 1 core\(s\) this "
                                             r"process may use.*threads=1 \(or 0"):
            assert set_threads(2) == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            set_threads(1)  # fits: silent
    finally:
        monkeypatch.undo()  # the real core count, so restoring `before` is silent
        set_threads(before)


def test_threads_far_above_the_cores_are_refused_at_run_start(monkeypatch):
    """threads > 4 x cores stalls a run (1000 on 2 cores: no step in ten minutes), so it is
    refused, naming the value, the cores and the cap; up to the cap it only warns."""
    import torch

    import lab.sweep
    from lab.config import ConfigError
    from lab.device import MAX_THREADS_PER_CORE, set_threads

    assert MAX_THREADS_PER_CORE == 4
    before = torch.get_num_threads()
    monkeypatch.setattr(lab.sweep, "usable_cores", lambda: 2)
    try:
        with pytest.raises(ConfigError, match=r"threads=9 is more than 4 x the 2 core\(s\) "
                                              r"this process may use \(at most 8 allowed "
                                              r"here\).*use threads=2 \(or 0"):
            set_threads(9)
        assert torch.get_num_threads() == before  # refused before anything was set
        with pytest.warns(UserWarning, match=r"threads=8 is more than the 2 core"):
            assert set_threads(8) == 8  # at the cap: oversubscribed, slower, allowed
    finally:
        monkeypatch.undo()  # the real core count, so restoring `before` is silent
        set_threads(before)


def test_a_trainer_refuses_huge_threads_before_it_writes_anything(monkeypatch, tmp_path):
    """The refusal comes from build (run start), not the config: the config still
    constructs (a record from a big machine loads anywhere) and no run directory is made."""
    import lab.sweep
    from lab.config import ConfigError
    from lab.train import EPConfig, train_ep

    monkeypatch.setattr(lab.sweep, "usable_cores", lambda: 2)
    config = EPConfig(steps=1, warmup_steps=0, d_model=8, n_heads=2, seq_len=8, batch_size=2,
                      eval_every=0, progress=False, threads=1000)  # constructs: not refused here
    with pytest.raises(ConfigError, match=r"threads=1000 is more than 4 x the 2 core"):
        train_ep(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("notebook", ["01-train-conv", "02-train-ep-transformer",
                                      "03-train-cfc-aux"])
def test_lab_run_refuses_huge_threads_before_a_kernel_and_creates_nothing(
        notebook, monkeypatch, tmp_path, capsys):
    # The cap was met only inside the kernel: a `failed` run was left, and the corrected
    # command was then refused as "other parameters (threads: 9 there vs 2 now)".
    from pathlib import Path

    import lab.sweep
    from lab.cli import main as cli_main

    monkeypatch.setattr(lab.sweep, "usable_cores", lambda: 2)
    path = Path(__file__).resolve().parents[1] / "notebooks" / f"{notebook}.ipynb"
    assert cli_main(["run", str(path), "--out", str(tmp_path / "r"), "-p", "threads", "9"]) == 2
    assert "threads=9 is more than 4 x the 2 core(s)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_check_fits_refuses_only_what_exceeds_the_memory(monkeypatch):
    import lab.device
    from lab.config import ConfigError

    monkeypatch.setattr(lab.device, "memory_bytes", lambda: 3 * 2**30)
    lab.device.check_fits("X", 3 * 2**30, "it", "smaller")  # exactly the memory: fits
    with pytest.raises(ConfigError, match=r"^X: the model need at least 4 GiB, more than "
                       r"this machine's 3 GiB; give less$"):
        lab.device.check_fits("X", 4 * 2**30, "the model", "give less")
    monkeypatch.setattr(lab.device, "memory_bytes", lambda: None)  # the OS does not say
    lab.device.check_fits("X", 2**80, "it", "smaller")
