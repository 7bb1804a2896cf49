"""What ``kiln cache ls | verify | clear`` shows and does."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.cache.store import read_manifest, verify_entry

__all__ = ["EntryInfo", "list_entries", "verify_entries", "clear_entries"]


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
    """(key, problems) per entry; no problems means every checksum matches."""
    out = []
    for entry in _entries(root):
        m = read_manifest(entry)
        out.append((entry.name, ["no manifest (incomplete)"] if m is None else verify_entry(entry, m)))
    return out


def clear_entries(root: Path) -> int:
    """Remove every compiled entry and the shared Inductor cache; the number of entries removed."""
    entries = _entries(root)
    for entry in entries:
        shutil.rmtree(entry, ignore_errors=True)
    shutil.rmtree(root / "inductor", ignore_errors=True)
    return len(entries)
