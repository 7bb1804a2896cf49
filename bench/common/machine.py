"""The machine record every report carries, and the scrubbing of this machine's
paths out of reports.

Timings only mean something next to the hardware, versions and background load
they were taken under, so every report's ``machine`` entry comes from
:func:`machine_info`. Reports are committed, so the paths of the machine that
wrote them are replaced by placeholders (:func:`scrub_paths`).
"""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = BENCH_DIR.parent


def machine_info(device: str) -> dict[str, Any]:
    """Versions and hardware that the numbers depend on."""
    import transformers

    import kiln

    info: dict[str, Any] = {
        "device": device,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "kiln_version": kiln.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "git_commit": _git_commit(),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
    return info


def cpu_bf16_support() -> dict[str, Any]:
    """What this CPU offers bf16 arithmetic (its flags: AMX tiles, AVX-512 BF16
    dot products) and what torch makes of it (its CPU kernel capability, and
    whether oneDNN runs bf16 natively), for reports that compare bf16 with fp32."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    try:
        onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn_bf16 = None
    return {
        **{flag: flag in flags for flag in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")},
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16_supported": onednn_bf16,
    }


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages: other work on the machine skews timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git_commit() -> str | None:
    """The repository's HEAD, with ``-dirty`` if the working tree has changes; in a
    copy of the tree without ``.git`` (a GPU machine), ``KILN_GIT_COMMIT`` if set."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("KILN_GIT_COMMIT") or None


def scrub_paths(obj: Any, replacements: Sequence[tuple[str, str]]) -> Any:
    """``obj`` with every string's machine-specific prefixes replaced (longest
    first), so that committed results name no local directories."""
    if isinstance(obj, dict):
        return {k: scrub_paths(v, replacements) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub_paths(v, replacements) for v in obj]
    if isinstance(obj, str):
        for prefix, placeholder in replacements:
            obj = obj.replace(prefix, placeholder)
    return obj


def path_placeholders() -> list[tuple[str, str]]:
    """(path, placeholder) pairs for kiln's cache, the repository, the temporary
    directory (benchmarks work in fresh ones) and the home directory, longest
    path first so that the most specific one wins."""
    from kiln.config import default_cache_dir

    pairs = [
        (str(default_cache_dir()), "<kiln cache>"),
        (str(REPO_DIR), "<repo>"),
        (tempfile.gettempdir(), "<tmp>"),
        (str(Path.home()), "~"),
    ]
    return sorted(((p, r) for p, r in pairs if len(p) > 1), key=lambda pr: -len(pr[0]))
