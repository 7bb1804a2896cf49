"""On-disk primitives for compiled entries: atomic writes, locks, checksums.

An entry is a directory built under its lock; its ``manifest.json`` is written
last and lists a sha256 for every other file (and for the kernel libraries it
needs from the shared Inductor cache), so a half-written, truncated or altered
entry is recognised and never loaded. Single files are written atomically
(temporary file, then rename).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock

__all__ = [
    "MANIFEST",
    "atomic_write_bytes",
    "atomic_write_json",
    "checksum_tree",
    "entry_lock",
    "file_sha256",
    "private_copy",
    "read_manifest",
    "verify_entry",
    "verify_kernels",
    "writable",
]

MANIFEST = "manifest.json"


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


def _differing(root: Path, checksums: dict[str, str]) -> list[str]:
    return [rel for rel, digest in checksums.items()
            if not (root / rel).is_file() or file_sha256(root / rel) != digest]


def verify_entry(entry: Path, manifest: dict[str, Any]) -> list[str]:
    """The entry's files that are missing or differ from its manifest."""
    return _differing(entry, manifest.get("files", {}))


def verify_kernels(inductor_dir: Path, kernels: dict[str, str]) -> list[str]:
    """The kernel libraries (relative to ``inductor_dir``, with their sha256)
    that are missing from the Inductor cache or differ there."""
    return _differing(inductor_dir, kernels)


@contextmanager
def entry_lock(root: Path, key: str, timeout: float = 3600.0) -> Iterator[None]:
    """One process at a time builds (or repairs) entry ``key``; others wait."""
    locks = root / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(str(locks / f"{key}.lock"), timeout=timeout):
        yield


def writable(path: Path) -> bool:
    """Whether kiln may create files under ``path`` (created if missing)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def private_copy(source: Path | None, prefix: str) -> Path:
    """A writable temporary copy of ``source`` (empty when None), removed at exit:
    loading an artifact writes into the Inductor cache it reads."""
    dest = Path(tempfile.mkdtemp(prefix=prefix))
    if source is not None and source.is_dir():
        shutil.copytree(source, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.lock", "locks"))
    atexit.register(shutil.rmtree, dest, True)
    return dest
