"""Numba's on-disk cache: a new process loads every CPU kernel, it compiles none.

Each training run is a new process (a papermill kernel), so a kernel that misses the
cache costs every run its compile time (20 s a rule on a slow host) and adds an entry
to the cache's index each time. The cause found once: numba keys a closure by the
pickled values of its cells, and a compiled function pickles with a per-process id.
"""

from __future__ import annotations

import os
import subprocess
import sys


def _run():
    import os

    env = dict(os.environ, NUMBA_DEBUG_CACHE="1")
    # every CPU entry point, every rule, serial and parallel sizes (float32: the fault
    # does not depend on the dtype, and each dtype is a compile)
    run = subprocess.run([sys.executable, "-m", "numba_kernels.warm"], capture_output=True,
                         text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_a_second_process_compiles_no_cpu_kernel():
    # The first process may compile (a fresh clone); the second must load everything.
    first = _run()
    assert "[cache] data loaded" in first or "[cache] data saved" in first, first[-2000:]
    assert "numba kernels compiled or loaded from the cache in" in first
    saved = [line for line in _run().splitlines() if "saved" in line]
    assert not saved, "recompiled in a second process:\n" + "\n".join(saved[:20])


def _dispatchers():
    from numba.core.registry import CPUDispatcher

    from numba_kernels import cpu

    found = {}
    for name, obj in vars(cpu).items():
        for i, d in enumerate(obj.values() if isinstance(obj, dict) else [obj]):
            for j, k in enumerate(d if isinstance(d, tuple) else (d,)):
                if isinstance(k, CPUDispatcher):
                    found[f"{name}[{i}][{j}]"] = k
    return found


def test_no_kernel_closure_holds_a_compiled_function():
    # The cause of the fault above, for every kernel the CPU module makes: closure
    # values must pickle the same in every process (ints, range, prange), which a
    # compiled function does not.
    from numba.core.dispatcher import Dispatcher

    found = _dispatchers()
    assert len(found) > 20, sorted(found)
    closures = 0
    for name, d in found.items():
        for cell in d.py_func.__closure__ or ():
            closures += 1
            assert not isinstance(cell.cell_contents, Dispatcher), (
                f"{name} holds {cell.cell_contents} in its closure: numba's cache "
                "misses it in every new process")
    assert closures >= 4  # the serial / parallel kernels are closures; the check saw them


def test_local_kernels_take_the_rule_and_outputs_as_literals():
    # The slab loops carry no rule or output branch only because the rule and the
    # output flags reach them as literals: plain values would compile one instance
    # with the branches inside every loop. Fresh (uncached) compiles of the serial
    # kernel and of a per-example function type their callees, whose signatures then
    # show what they received (the callees themselves may come from the cache).
    import numba
    import numpy as np

    from numba_kernels import cpu

    kernel = numba.njit(cpu._LOCAL[cpu.UNIT][0].py_func)  # the seed's form, serial
    a = np.ones((2, 3, 4), dtype=np.float32)
    u = np.ones((3, 4), dtype=np.float32)
    none = np.zeros((2, 3, 0), dtype=np.float32)
    q = np.zeros((3, 0), dtype=np.float32)  # no quadratic term, no given traffic
    z = np.zeros(1, dtype=np.float32)
    fac = np.ones(2, np.float32)
    one, zero = np.float32(1), np.float32(0)
    chan = np.empty((3, cpu.L_SUMS))
    kernel(a, a, a, np.empty_like(a), none, none, u, u, u, q, none, none, zero, fac, one, z, z,
           z, False, chan, zero, cpu.RAW)
    assert chan[:, 0].tolist() == [8.0] * 3  # sum of I^2 per channel: 2 examples x 4
    rules = {f"Literal[int]({code})" for code in (cpu.RAW, cpu.INNOVATION, cpu.MATCHED,
                                                  cpu.NONE)}
    part, kac = np.zeros((2, 3, cpu.L_SUMS)), np.ones((3, 5), np.float32)
    sums_args = (a, a, a, u, u, u, q, none, none, zero, fac, one, z, z, False, 0, part)
    write_args = (a, a, a, np.empty_like(a), none, none, u, u, u, q, none, none, zero, fac, one,
                  z, z, kac, False, 0, part)
    for by_rule, args, callee in ((cpu._sums_by_rule, sums_args, cpu._example_sums),
                                  (cpu._write_by_rule, write_args, cpu._example_write)):
        numba.njit(by_rule.py_func)(*args, zero, cpu.RAW, cpu.UNIT)  # a runtime rule code
        # (the signature's last entry is the form, the one before it the rule)
        assert {str(sig[-2]) for sig in callee.signatures} == rules, callee

    write = numba.njit(cpu._example_write.py_func)
    rule, form = cpu.MATCHED, cpu.UNIT  # closure constants, as the kernels' branches pass them

    @numba.njit
    def probe(a, out, inst, none, u, q, fac, z, kac, part):
        write(a, a, a, out, inst, none, u, u, u, q, none, none, np.float32(0), fac,
              np.float32(1), z, z, kac, False, 0, part, np.float32(0), rule, form)

    probe(a, np.empty_like(a), np.empty_like(a), none, u, q, fac, z, np.ones((3, 5), np.float32),
          np.zeros((2, 3, cpu.L_SUMS)))
    (sig,) = write.signatures
    assert str(sig[-2]) == f"Literal[int]({cpu.MATCHED})"
    assert str(sig[-1]) == f"Literal[int]({cpu.UNIT})"
    flags = {(str(s[-4]), str(s[-3]), str(s[-2])) for s in cpu._slab_write.signatures}
    assert {(f"Literal[int]({cpu.MATCHED})", f"Literal[bool]({i})", f"Literal[bool]({m})")
            for i in (True, False) for m in (True, False)} <= flags, flags
    assert all(s[-4].__class__.__name__ == "IntegerLiteral" for s in cpu._slab_write.signatures)


CACHE_FALLBACK = """
import os, sys, tempfile, warnings
from numba.core import config
from numba_kernels.cachedir import ensure_cache_dir

with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    here = ensure_cache_dir(os.path.abspath(sys.argv[1]))  # a writable source file
    gone = ensure_cache_dir("/nonexistent/kernels.py")     # numba has no place for it
    again = ensure_cache_dir("/nonexistent/kernels.py")    # now it has: the fallback
print(here, gone == os.path.join(tempfile.gettempdir(), f"numba-cache-{os.getuid()}"),
      config.CACHE_DIR == gone, again, len(seen), str(seen[0].message) if seen else "")
"""


def test_a_read_only_install_caches_the_kernels_elsewhere(tmp_path):
    # A read-only install with no writable home: numba refused at import ("cannot cache
    # function '_signals': no locator available"), so no training run could start.
    source = tmp_path / "k.py"
    source.write_text("x = 1\n")
    env = {**{k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"},
           "TMPDIR": str(tmp_path)}  # the fallback is made there, not in /tmp
    run = subprocess.run([sys.executable, "-c", CACHE_FALLBACK, str(source)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    here, gone, set_, again, count, message = run.stdout.split(" ", 5)
    assert (here, gone, set_, again, count) == ("None", "True", "True", "None", "1")
    assert message.startswith("numba cannot cache the compiled kernels beside "
                              "/nonexistent/kernels.py or in this user's cache directory")
    assert "(set NUMBA_CACHE_DIR to choose another)" in message
    # the user's own NUMBA_CACHE_DIR is kept as it is, without a word
    run = subprocess.run([sys.executable, "-c", CACHE_FALLBACK, str(source)],
                         capture_output=True, text=True, timeout=300,
                         env={**env, "NUMBA_CACHE_DIR": str(tmp_path / "mine")})
    assert run.stdout.split(" ")[:5] == ["None", "False", "False", "None", "0"]


def test_the_fallback_cache_is_private(tmp_path, monkeypatch):
    # A predictable /tmp/numba-cache-<uid> planted by another user (or open to others)
    # would feed numba pickles: such a directory is not used.
    from numba_kernels.cachedir import _private_dir

    mine = _private_dir(tmp_path / "c")
    assert mine == tmp_path / "c" and (mine.stat().st_mode & 0o777) == 0o700
    open_ = tmp_path / "open"
    open_.mkdir()
    open_.chmod(0o777)
    other = _private_dir(open_)
    assert other != open_ and (other.stat().st_mode & 0o777) == 0o700
    link = tmp_path / "link"
    link.symlink_to(mine, target_is_directory=True)
    linked = _private_dir(link)
    assert linked != link
    other.rmdir()
    linked.rmdir()
