"""What identifies a data file: its absolute path, size and content hash (a dataset
read from a directory: its name, the directory and the hash of its arrays).

A run records this (``record["data"]``) and its checkpoints carry it, so a resume
on a file that changed since the run began is refused instead of silently mixing
two datasets in one trajectory (``lab.lifecycle``). The path alone cannot tell:
a file is often overwritten in place under the same name.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 1 << 20  # hash in 1 MiB reads: a large CSV never sits in memory twice


def absolute(path: str) -> str:
    """``path`` with ``~`` expanded, made absolute and normalised ("" stays "").

    Configs store this form, so the record names the file a run read whatever
    the working directory of a later reader or resume.
    """
    return str(Path(path).expanduser().resolve()) if path else ""


def file_identity(path: str | Path) -> dict:
    """{"path": absolute path, "size": bytes, "sha256": hex digest} of one file."""
    path = Path(path).expanduser().resolve()
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"path": str(path), "size": size, "sha256": digest.hexdigest()}


class FileChanged(RuntimeError):
    """A data file that changed while a run read it."""


def _stamp(path: Path) -> tuple:
    # What a write or a replacement changes; not ctime, which a chmod, a `touch -a` or a
    # hard link made meanwhile moves without touching the content.
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def read_unchanged(path: str | Path, read):
    """``(file_identity(path), read())``, the file unchanged from before the hash to after
    the read: the identity a run records is then that of the data it trained on (a file
    replaced between a separate read and hash would have recorded the new content, and a
    rerun on it found "nothing to do"). A change in between raises FileChanged."""
    path = Path(path).expanduser().resolve()
    before = _stamp(path)
    identity = file_identity(path)
    value = read()
    if _stamp(path) != before:
        raise FileChanged(f"data file {path} changed while this run read it (another process "
                          "writing it?); run again once it is written in full")
    return identity, value


def content_only(data):
    """A record's ``data`` without where a dataset was read from: a dataset read from a
    directory is its arrays (their sha256), so the same arrays found in another directory
    (a cache moved, ``$LAB_DATA_DIR`` pointed elsewhere) are the same data. A data
    file keeps its path: it is what the config names."""
    if isinstance(data, dict):
        keep = {k: v for k, v in data.items()
                if not (k == "dir" and {"dataset", "sha256"} <= set(data))}
        return {k: content_only(v) for k, v in keep.items()}
    return data


def changed_files(data, data_dir: str | None = None) -> list[str]:
    """``"<path>: <what> changed"`` for every file identity in a record's ``data`` (any
    nesting) that no longer matches the file: gone, another size, another sha256. The
    hash is taken only when the size still matches.

    ``data_dir``: the ``data_dir`` a config asks now, for a dataset read from a
    directory. ``""`` (the default directory, ``$LAB_DATA_DIR``, as found where the run
    is made) may name another directory now than the one the run read; then the
    dataset is read where the config would read it, and its content compared with the
    run's (a cache moved with the same arrays is the same data)."""
    changes = []

    def walk(node):
        if isinstance(node, dict):
            if {"dataset", "dir", "sha256"} <= set(node):
                changes.extend(_dataset_changes(node, data_dir))
                return
            if {"vega", "length", "sha256"} <= set(node):
                changes.extend(_vega_changes(node))
                return
            if {"arch", "series", "rows", "sha256"} <= set(node):
                changes.extend(_arch_changes(node))
                return
            if {"path", "size", "sha256"} <= set(node):
                path = Path(node["path"])
                if not path.is_file():
                    changes.append(f"{path}: the file is gone")
                elif path.stat().st_size != node["size"]:
                    changes.append(f"{path}: size {node['size']} then, {path.stat().st_size} now")
                elif file_identity(path)["sha256"] != node["sha256"]:
                    changes.append(f"{path}: same size, other content (sha256)")
                return
            for value in node.values():
                walk(value)

    walk(data)
    return changes


def _dataset_changes(node: dict, data_dir: str | None) -> list[str]:
    # A dataset read from a directory (lab.data.load_dataset's identity): read it again,
    # where the config reads it now.
    from lab.data import DataError, content_identity, default_data_dir  # (torch: lazily)

    where = f"{node['dataset']} in {node['dir']}"
    if data_dir == "" and absolute(str(default_data_dir())) != node["dir"]:
        here = absolute(str(default_data_dir()))
        where = (f"{node['dataset']} in {here} (data_dir '' now: $LAB_DATA_DIR, else "
                 f"~/.cache/lab; the run read {node['dir']})")
    else:
        here = node["dir"]
    try:
        now = content_identity(node["dataset"], here)
    except DataError as err:
        return [f"{where}: cannot be read now ({err})"]
    return [] if now["sha256"] == node["sha256"] else [f"{where}: other content (sha256)"]


def _vega_changes(node: dict) -> list[str]:
    # The vega series bundled in vega_datasets (lab.data.prices.vega_identity).
    from lab.data.prices import vega_identity

    return _bundled_changes(node, f"vega_datasets stocks ({node['vega']})",
                            lambda: vega_identity(node["vega"]), "length", "months")


def _arch_changes(node: dict) -> list[str]:
    # A daily series bundled in the arch package (lab.data.markets.arch_identity); a new
    # arch release may ship other data.
    from lab.data.markets import arch_identity

    return _bundled_changes(node, f"arch's {node['series']} series (arch {node['arch']} then)",
                            lambda: arch_identity(node["series"]), "rows", "days")


def _bundled_changes(node: dict, where: str, read, count: str, unit: str) -> list[str]:
    """A series that ships inside a package, read again (``read()``) and compared."""
    from lab.data import DataError

    try:
        now = read()
    except (DataError, ImportError) as err:
        return [f"{where}: cannot be read now ({err})"]
    if now[count] != node[count]:
        return [f"{where}: {node[count]} {unit} then, {now[count]} now"]
    return [] if now["sha256"] == node["sha256"] else [f"{where}: other prices (sha256)"]
