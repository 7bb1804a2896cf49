"""Whether a compiled entry can serve this runtime, decided from its files alone.

Answering needs no Dynamo or Inductor (seconds of imports): the manifest, the
checksums of the entry's files and of the kernel libraries it needs in Inductor's
cache, and its cache factors against the runtime's. ``compile="eager-first"``
asks before it starts serving, and loads the entry later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.cache.keys import diff_factors
from kiln.cache.store import read_manifest, verify_entry, verify_kernels

__all__ = ["FactorMismatchError", "manifest_if_loadable", "usable_manifest"]


class FactorMismatchError(ValueError):
    """A compiled entry (a bundle's) made for another torch, kiln, device or config."""

    def __init__(self, where: Path, diffs: list[tuple[str, Any, Any]]) -> None:
        lines = "\n".join(f"  {k}: built with {a!r}, this runtime has {b!r}" for k, a, b in diffs)
        super().__init__(
            f"{where} was compiled for a different setup; differing factors:\n{lines}\n"
            "Rebuild it with `kiln compile`, or load with on_mismatch='recompile' to compile into the user cache."
        )
        self.diffs = diffs


def usable_manifest(entry: Path, factors: dict[str, Any], strict: bool) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") for a complete, intact entry made for ``factors``, else
    (None, why not: "" for a missing entry); ``strict``: a factor mismatch
    raises FactorMismatchError."""
    manifest = read_manifest(entry)
    if manifest is None:
        return None, ""
    bad = verify_entry(entry, manifest)
    if bad:
        return None, f"compiled entry {entry} is corrupted ({', '.join(bad[:4])}); it will be rebuilt"
    diffs = diff_factors(manifest.get("factors", {}), factors)
    if diffs and strict:
        raise FactorMismatchError(entry, diffs)
    if diffs:
        names = ", ".join(k for k, _, _ in diffs[:4])
        return None, f"compiled entry {entry} was made for other factors ({names}); it will be rebuilt"
    return manifest, ""


def manifest_if_loadable(entry: Path, factors: dict[str, Any], inductor_dir: Path,
                         strict: bool = False) -> dict[str, Any] | None:
    """The manifest of ``entry`` when it is usable and every kernel library it
    needs is intact in ``inductor_dir`` (loading it then builds nothing and
    takes no lock), else None."""
    manifest, _ = usable_manifest(entry, factors, strict)
    if manifest is None or verify_kernels(inductor_dir, manifest.get("kernels", {})):
        return None
    return manifest
