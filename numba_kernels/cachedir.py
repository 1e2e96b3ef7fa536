"""Where numba keeps the compiled kernels: a fallback for installs it cannot write.

Every CPU kernel here (and the CfC time loops in ``lab.models.cfc``) is compiled with
``cache=True``, so a run loads machine code instead of compiling it (about a minute on
2 cores). Numba caches beside the source (``__pycache__``), else in the user's cache
directory (``~/.cache/numba``); where it can write neither (a read-only install and a
read-only or missing home, as on some clusters) it refused at import, so no training
run could start. Then the kernels are cached in a per-user directory under the system's
temporary directory instead, with a warning naming it; ``NUMBA_CACHE_DIR`` chooses
another, as numba documents.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path


def ensure_cache_dir(source_file: str) -> str | None:
    """Give numba a writable cache for the functions of ``source_file`` if it has none;
    returns the directory chosen, or None when numba has a place of its own."""
    from numba.core import caching, config

    if config.CACHE_DIR:  # the user's NUMBA_CACHE_DIR
        return None

    def probe():  # pragma: no cover - never called, only located
        pass

    try:
        classes = list(caching.CacheImpl._locator_classes)
        if any(cls.from_function(probe, source_file) is not None for cls in classes):
            return None
    except Exception:  # numba's internals moved: let numba say what it says
        return None
    fallback = _private_dir(Path(tempfile.gettempdir()) / f"numba-cache-{os.getuid()}")
    config.CACHE_DIR = str(fallback)
    warnings.warn(f"numba cannot cache the compiled kernels beside {source_file} or in this "
                  f"user's cache directory (both read-only?); caching them in {fallback} "
                  "(set NUMBA_CACHE_DIR to choose another)", RuntimeWarning, stacklevel=2)
    return str(fallback)


def _private_dir(path: Path) -> Path:
    """``path``, made ours alone (0700); where another user owns it or others may write it
    (a shared /tmp: numba's cache index is a pickle, so a planted one would run code), a
    fresh private directory instead."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
        if path.is_dir() and not path.is_symlink() and st.st_uid == os.getuid() \
                and not st.st_mode & 0o022:
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="numba-cache-"))
