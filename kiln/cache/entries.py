"""What ``kiln cache ls | verify | clear`` shows and does."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.cache.store import read_manifest, verify_entry, verify_kernels

__all__ = ["CacheClearError", "EntryInfo", "list_entries", "verify_entries", "clear_entries"]


class CacheClearError(OSError):
    """Some of the cache could not be removed (a read-only cache, say)."""


@dataclass
class EntryInfo:
    key: str
    model: str
    level: int | None
    size: int
    age_seconds: float
    complete: bool


def _entries(root: Path) -> list[Path]:
    compiled = root / "compiled"
    if not compiled.is_dir():
        return []
    return sorted(p for p in compiled.iterdir() if p.is_dir() and p.name != "locks" and not p.name.startswith("."))


def list_entries(root: Path) -> list[EntryInfo]:
    out = []
    now = time.time()
    for entry in _entries(root):
        m = read_manifest(entry) or {}
        size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        out.append(EntryInfo(
            key=entry.name,
            model=str(m.get("model", "?")),
            level=m.get("level"),
            size=size,
            age_seconds=now - float(m.get("created", entry.stat().st_mtime)),
            complete=bool(m),
        ))
    return out


def verify_entries(root: Path) -> list[tuple[str, list[str]]]:
    """(key, problems) per entry: its own files, and the kernel libraries it
    needs from the shared Inductor cache. No problems: every checksum matches."""
    out = []
    for entry in _entries(root):
        m = read_manifest(entry)
        if m is None:
            out.append((entry.name, ["no manifest (incomplete)"]))
            continue
        kernels = [f"inductor/{k}" for k in verify_kernels(root / "inductor", m.get("kernels", {}))]
        out.append((entry.name, verify_entry(entry, m) + kernels))
    return out


def _remove(path: Path, failures: list[str]) -> bool:
    try:
        shutil.rmtree(path)
    except OSError as e:
        failures.append(f"{e.filename or path}: {e.strerror or e}")
        return False
    return True


def clear_entries(root: Path) -> int:
    """Remove every compiled entry and the shared Inductor cache; the number of
    entries removed. Raises ``CacheClearError`` naming what could not be removed."""
    entries = _entries(root)
    failures: list[str] = []
    removed = sum(_remove(entry, failures) for entry in entries)
    if (root / "inductor").exists():
        _remove(root / "inductor", failures)
    if failures:
        raise CacheClearError(
            f"could not clear {root}: removed {removed} of {len(entries)} compiled entries; "
            f"{failures[0]}" + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else "")
        )
    return removed
