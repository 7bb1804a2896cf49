"""On-disk primitives for compiled entries: atomic writes, locks, checksums.

An entry is a directory written whole under a temporary name and renamed into
place; its ``manifest.json`` is written last and lists a sha256 for every other
file, so a half-written, truncated or altered entry is recognised and never
loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock

__all__ = [
    "MANIFEST",
    "CorruptEntryError",
    "atomic_write_bytes",
    "atomic_write_json",
    "checksum_tree",
    "entry_lock",
    "file_sha256",
    "read_manifest",
    "replace_dir",
    "verify_entry",
]

MANIFEST = "manifest.json"


class CorruptEntryError(RuntimeError):
    """An entry whose files do not match its manifest."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())


def checksum_tree(root: Path, skip: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    """relative path -> sha256 for every regular file under ``root``."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            rel = path.relative_to(root).as_posix()
            if rel not in skip and not rel.endswith(".lock"):
                out[rel] = file_sha256(path)
    return out


def read_manifest(entry: Path) -> dict[str, Any] | None:
    path = entry / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def verify_entry(entry: Path, manifest: dict[str, Any], only: list[str] | None = None) -> list[str]:
    """The files (of ``only``, else all) that are missing or differ from the manifest."""
    files: dict[str, str] = manifest.get("files", {})
    bad = []
    for rel in only if only is not None else list(files):
        path = entry / rel
        if rel not in files or not path.is_file() or file_sha256(path) != files[rel]:
            bad.append(rel)
    return bad


@contextmanager
def entry_lock(root: Path, key: str, timeout: float = 3600.0) -> Iterator[None]:
    """One process at a time builds (or repairs) entry ``key``; others wait."""
    locks = root / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(str(locks / f"{key}.lock"), timeout=timeout):
        yield


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move a fully written ``tmp`` into place at ``dest``, replacing what is there."""
    if dest.exists():
        trash = dest.with_name(f".trash-{dest.name}-{os.getpid()}-{time.time_ns()}")
        os.replace(dest, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, dest)
