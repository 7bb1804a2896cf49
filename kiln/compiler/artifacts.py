"""Writing a compiled model into a cache entry and rebuilding it from one.

An entry holds the split graph (pickled before compiled pieces were installed),
one Inductor artifact per unique piece and bucket, and a manifest. The artifacts
need Inductor's own cache (the compiled ``.so`` files on CPU, Triton binaries on
GPU), which the caller keeps in a directory of its choosing. Rebuilding needs no
Dynamo trace and no Inductor compile.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

from kiln.cache.store import MANIFEST, atomic_write_bytes, atomic_write_json, checksum_tree
from kiln.compiler.backend import CompiledModel
from kiln.compiler.capture import GraphInput
from kiln.compiler.piecewise import PiecewiseBackend
from kiln.compiler.split import bind_eager_implementations

__all__ = ["ENTRY_FORMAT", "compiler_identity", "current_vec_isa", "inductor_settings", "load_compiled", "save_compiled"]

logger = logging.getLogger(__name__)

ENTRY_FORMAT = 1
GRAPH_FILE = "graph.pkl"


def _artifact_path(sig: str, bucket: int | str) -> str:
    return f"artifacts/{sig}-{bucket}.bin"


def save_compiled(entry: Path, compiled: CompiledModel, pristine_graph: bytes, header: dict[str, Any]) -> dict[str, Any]:
    """Write ``compiled`` into the (new, private) directory ``entry``; return the
    manifest, which is written last."""
    atomic_write_bytes(entry / GRAPH_FILE, pristine_graph)
    backends: dict[str, Any] = {}
    for sig, b in compiled.backends.items():
        (entry / "artifacts").mkdir(parents=True, exist_ok=True)
        info: dict[str, Any] = {
            "token_index": list(b.token_index),
            "returns_tuple": b.returns_tuple,
            "exact": {},
        }
        if b.range is not None:
            info["range"] = _artifact_path(sig, "range")
            b.range.save(path=str(entry / info["range"]), format="binary")
        for n, fn in sorted(b.exact.items()):
            rel = _artifact_path(sig, n)
            fn.save(path=str(entry / rel), format="binary")
            info["exact"][str(n)] = rel
        backends[sig] = info
    heads: dict[str, str] = {}
    for n, fn in sorted(compiled.logits_heads.items()):
        heads[str(n)] = _artifact_path("logits-head", n)
        fn.save(path=str(entry / heads[str(n)]), format="binary")
    manifest = {
        **header,
        "logits_heads": heads,
        "format": ENTRY_FORMAT,
        "graph": GRAPH_FILE,
        "inputs": [[g.kind, g.name] for g in compiled.inputs],
        "pieces": compiled.piece_signatures,
        "backends": backends,
        "files": checksum_tree(entry),
    }
    atomic_write_json(entry / MANIFEST, manifest)
    return manifest


def load_compiled(
    entry: Path, manifest: dict[str, Any], model: nn.Module, max_num_tokens: int, inductor_dir: Path,
    eager_impls: dict[str, Any] | None = None,
) -> tuple[CompiledModel, int]:
    """Rebuild the compiled callable from ``entry``; Inductor reads (and may write)
    its cache at ``inductor_dir``. Returns the callable and the artifacts loaded."""
    import kiln.kernels  # noqa: F401  (the pickled graph calls torch.ops.kiln.attention)

    if manifest.get("format") != ENTRY_FORMAT:
        raise ValueError(f"{entry}: entry format {manifest.get('format')!r}, this kiln reads {ENTRY_FORMAT}")
    module = pickle.loads((entry / manifest["graph"]).read_bytes())
    if eager_impls:
        bind_eager_implementations(module, eager_impls)
    inputs = [GraphInput(kind, name) for kind, name in manifest["inputs"]]
    backends: dict[str, PiecewiseBackend] = {}
    loaded = 0
    with (
        temporary_cache_dir(str(inductor_dir)),
        inductor_settings(),
        _no_isa_probe(manifest.get("vec_isa")),
        _recorded_compiler(manifest.get("cxx")),
    ):
        for sig, info in manifest["backends"].items():
            i, dim = info["token_index"]
            b = PiecewiseBackend(sig, (i, dim), max_num_tokens, info["returns_tuple"])
            if "range" in info:
                b.range = _load_artifact(entry / info["range"])
                loaded += 1
            for n, rel in info["exact"].items():
                b.exact[int(n)] = _load_artifact(entry / rel)
                loaded += 1
            backends[sig] = b
        heads = {int(n): _load_artifact(entry / rel) for n, rel in manifest.get("logits_heads", {}).items()}
        loaded += len(heads)
    return CompiledModel(module, inputs, model, backends, dict(manifest["pieces"]), heads), loaded


@contextlib.contextmanager
def inductor_settings() -> Iterator[None]:
    """Inductor settings that must be the same when an entry is built and loaded.

    Precompiled C++ headers are off: they live outside any cache directory (under
    $TMPDIR), so every fresh container would run the preprocessor, and often build
    the header, at each warm start; the setting is also part of every kernel's
    cache key. Cold compiles pay for it (about 1.6x on CPU)."""
    from torch._inductor import config

    patch = {"cpp_cache_precompile_headers": False} if hasattr(config, "cpp_cache_precompile_headers") else {}
    with config.patch(patch):
        yield


def current_vec_isa() -> str | None:
    """The vector ISA Inductor's C++ code targets on this CPU."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa()) or None


@contextlib.contextmanager
def _no_isa_probe(recorded: str | None) -> Iterator[None]:
    """Loading a CPU artifact asks Inductor which vector ISA to use, and Inductor
    answers by test-compiling with the C++ compiler. The entry recorded the answer
    at compile time, and its key pins the CPU's ISA: trust the CPU's flags instead,
    provided they give the same answer."""
    if recorded is None:
        yield
        return
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa, valid_vec_isa_list

    with config.patch({"cpp.vec_isa_ok": True}):
        valid_vec_isa_list.cache_clear()
        try:
            if str(pick_vec_isa()) == recorded:
                yield
                return
        finally:
            valid_vec_isa_list.cache_clear()
    logger.info("CPU vector ISA differs from the entry's (%s); Inductor will probe it", recorded)
    yield


_IDENTITY_CHECKS = ("_is_clang", "_is_gcc", "_is_apple_clang", "_is_intel_compiler", "_is_msvc_cl")


def compiler_identity() -> dict[str, Any] | None:
    """What Inductor learns about the C++ compiler by running it (``--version``):
    recorded when an entry is built so that loading it needs no compiler at all."""
    from torch._inductor import cpp_builder

    try:
        cxx = cpp_builder.get_cpp_compiler()
        identity: dict[str, Any] = {"compiler": cxx, "version": cpp_builder.get_compiler_version_info(cxx)}
        for name in _IDENTITY_CHECKS:
            fn = getattr(cpp_builder, name, None)
            if fn is not None:
                identity[name] = bool(fn(cxx))
        return identity
    except Exception:  # no compiler, or an Inductor without these helpers
        logger.debug("could not record the C++ compiler's identity", exc_info=True)
        return None


@contextlib.contextmanager
def _recorded_compiler(identity: dict[str, Any] | None) -> Iterator[None]:
    """Answer Inductor's compiler questions from the entry instead of running the
    compiler: a warm start then works in an image with no C++ toolchain."""
    if not identity:
        yield
        return
    from torch._inductor import codecache, cpp_builder

    patches: dict[tuple[Any, str], Any] = {
        (cpp_builder, "cpp_compiler_search"): lambda search: identity["compiler"],
        (cpp_builder, "get_compiler_version_info"): lambda compiler: identity["version"],
        (codecache, "get_compiler_version_info"): lambda compiler: identity["version"],
    }
    for name in _IDENTITY_CHECKS:
        if name in identity:
            patches[(cpp_builder, name)] = lambda compiler, _v=identity[name]: _v
    saved = {(mod, name): getattr(mod, name) for mod, name in patches if hasattr(mod, name)}
    try:
        for (mod, name), fn in patches.items():
            if (mod, name) in saved:
                setattr(mod, name, fn)
        yield
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def _load_artifact(path: Path) -> Any:
    return torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
