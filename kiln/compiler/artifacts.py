"""Writing a compiled model into a cache entry and rebuilding it from one.

An entry holds the split graph (pickled before compiled pieces were installed),
one Inductor artifact per unique piece and bucket, and a manifest. The artifacts
need Inductor's own cache (the compiled ``.so`` files on CPU, Triton binaries on
GPU), which the caller keeps in a directory of its choosing; the manifest lists
the kernel libraries the entry needs there, with checksums. Rebuilding needs no
Dynamo trace, no Inductor compile and no C++ compiler (``toolchain``). On CPU
each artifact's code is exported too (``kiln.compiler.replay``): with every
kernel library intact, an entry then loads without importing Inductor at all.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.attention.cpu_attention import KernelBuildError, CpuAttentionKernel, build_cpu_attention
from kiln.cache.store import MANIFEST, atomic_write_bytes, atomic_write_json, checksum_tree
from kiln.compiler import cpu_linear, replay
from kiln.compiler.capture import GraphInput
from kiln.compiler.pieces import BucketedPiece
from kiln.compiler.pipeline import CompiledModel
from kiln.compiler.split import bind_eager_implementations
from kiln.compiler.toolchain import recorded_compiler, recorded_torch_key, recorded_vec_isa

__all__ = ["ENTRY_FORMAT", "inductor_settings", "load_compiled", "replay_in_place", "save_compiled", "warm_up"]

logger = logging.getLogger(__name__)

ENTRY_FORMAT = 2
GRAPH_FILE = "graph.pkl"
TORCH_KEY_FILE = "torch-key.json"  # in kiln's cache directory


def _artifact_path(sig: str, bucket: int | str) -> str:
    return f"artifacts/{sig}-{bucket}.bin"


def _save_piece(entry: Path, piece: BucketedPiece) -> dict[str, Any]:
    info: dict[str, Any] = {"token_index": list(piece.token_index), "returns_tuple": piece.returns_tuple,
                            "exact": {}}
    if piece.range is not None:
        info["range"] = _artifact_path(piece.signature, "range")
        piece.range.save(path=str(entry / info["range"]), format="binary")
    if piece.few is not None:
        low, high = piece.few_rows
        info["few"] = {"rows": [low, high], "artifact": _artifact_path(piece.signature, f"{low}-{high}")}
        piece.few.save(path=str(entry / info["few"]["artifact"]), format="binary")
    for n, fn in sorted(piece.exact.items()):
        info["exact"][str(n)] = _artifact_path(piece.signature, n)
        fn.save(path=str(entry / info["exact"][str(n)]), format="binary")
    return info


def save_compiled(
    entry: Path, compiled: CompiledModel, pristine_graph: bytes, header: dict[str, Any],
    replay_from: Path | None = None,
) -> dict[str, Any]:
    """Write ``compiled`` into the (new, private) directory ``entry``; return the
    manifest, which is written last. ``replay_from``: the Inductor cache the
    artifacts were just built in, with Inductor configured as for the build;
    each artifact that qualifies is then exported to load without Inductor
    (``kiln.compiler.replay``), its kernel libraries among ``header["kernels"]``."""
    atomic_write_bytes(entry / GRAPH_FILE, pristine_graph)
    (entry / "artifacts").mkdir(parents=True, exist_ok=True)
    pieces = {sig: _save_piece(entry, p) for sig, p in compiled.pieces.items()}
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
        "piece_signatures": compiled.piece_signatures,
        "pieces": pieces,
    }
    if replay_from is not None:
        manifest["replay"] = _export_replays(entry, manifest, replay_from, set(header.get("kernels", {})))
    manifest["files"] = checksum_tree(entry)
    atomic_write_json(entry / MANIFEST, manifest)
    return manifest


def _export_replays(entry: Path, manifest: dict[str, Any], inductor_dir: Path, libraries: set[str]) -> dict[str, Any]:
    """The replay record of each artifact that qualifies; the others keep
    Inductor's loader, and so does the whole entry then (``replay.covers``)."""
    records: dict[str, Any] = {}
    for rel in replay.artifacts(manifest):
        try:
            records[rel] = replay.export(entry, rel, inductor_dir, libraries)
        except replay.NotReplayable as e:
            logger.info("artifact %s will load through Inductor: %s", rel, e)
        except Exception:  # noqa: BLE001 - torch internals that moved: only the fast load is lost
            logger.warning("could not export artifact %s to load without Inductor; this entry's warm starts "
                           "import Inductor (seconds)", rel, exc_info=True)
    return records


def load_compiled(
    entry: Path, manifest: dict[str, Any], model: nn.Module, max_num_tokens: int, inductor_dir: Path,
    eager_impls: dict[str, Any] | None = None, kernels_built: bool = True,
) -> tuple[CompiledModel, int, str]:
    """Rebuild the compiled callable from ``entry``; its kernel libraries are in
    ``inductor_dir``. ``kernels_built``: every kernel library the entry needs is
    there. Then an entry whose artifacts were all exported loads them without
    Inductor (``kiln.compiler.replay``); otherwise, or when that fails,
    Inductor loads them (and rebuilds missing libraries, with the compiler).
    Returns the callable, the artifacts loaded and how ("replay", "inductor")."""
    import kiln.attention.op  # noqa: F401  (the pickled graph calls torch.ops.kiln.attention)

    if manifest.get("format") != ENTRY_FORMAT:
        raise ValueError(f"{entry}: entry format {manifest.get('format')!r}, this kiln reads {ENTRY_FORMAT}")
    module = pickle.loads((entry / manifest["graph"]).read_bytes())
    if eager_impls:
        bind_eager_implementations(module, eager_impls)
    loaded, how = None, "replay"
    if kernels_built and replay.covers(manifest):
        try:
            loaded = _load_pieces(manifest, max_num_tokens,
                                  lambda rel: replay.load(entry, manifest["replay"][rel], inductor_dir))
        except Exception as e:  # noqa: BLE001 - whatever failed, Inductor's loader still can
            logger.warning("%s: its exported code did not load (%s); Inductor loads the artifacts instead", entry, e)
    if loaded is None:
        loaded, how = _load_through_inductor(entry, manifest, max_num_tokens, inductor_dir, kernels_built), "inductor"
    pieces, heads = loaded
    count = sum(len(p.exact) + (p.range is not None) + (p.few is not None) for p in pieces.values()) + len(heads)
    kernel = _attention_kernel(inductor_dir, manifest.get("attention_kernel"))
    linear = _linear_kernel(inductor_dir, manifest.get("linear_kernel"), model)
    inputs = [GraphInput(kind, name) for kind, name in manifest["inputs"]]
    compiled = CompiledModel(module, inputs, model, pieces, dict(manifest["piece_signatures"]), heads, kernel, linear)
    return compiled, count, how


def replay_in_place(entry: Path, manifest: dict[str, Any], compiled: CompiledModel, inductor_dir: Path) -> bool:
    """Swap the runnables this process just compiled for the entry's exported
    code (``kiln.compiler.replay``): the same kernels, so the same results to
    the bit, without the wrappers Inductor and AOTAutograd put around a fresh
    artifact, its per-call size checks and the dispatcher's trip to the C
    linear kernel. A process that compiled at start-up then decodes as fast as
    one that loaded the entry: the demo model, Q4_1 packed, fp32 activations,
    one process, taking turns, 84-91 tok/s with the fresh artifacts against
    97-108 replayed (scratch runs). False, with nothing changed, for an entry
    that does not replay."""
    if not replay.covers(manifest):
        return False
    max_num_tokens = next(iter(compiled.pieces.values())).max_num_tokens if compiled.pieces else 0
    try:
        pieces, heads = _load_pieces(manifest, max_num_tokens,
                                     lambda rel: replay.load(entry, manifest["replay"][rel], inductor_dir))
    except Exception as e:  # noqa: BLE001 - the fresh artifacts still run
        logger.warning("%s: its exported code did not load (%s); the freshly compiled artifacts run", entry, e)
        return False
    for sig, piece in pieces.items():  # in place: the split graph calls these BucketedPiece objects
        target = compiled.pieces[sig]
        target.range, target.exact, target.few, target.few_rows = piece.range, piece.exact, piece.few, piece.few_rows
    compiled.logits_heads.update(heads)
    return True


_Pieces = tuple[dict[str, BucketedPiece], dict[int, Any]]


def _load_pieces(manifest: dict[str, Any], max_num_tokens: int, load: Callable[[str], Any]) -> _Pieces:
    """Every piece's runnables and the LM heads, each artifact loaded by ``load``
    from its path in the entry."""
    pieces: dict[str, BucketedPiece] = {}
    for sig, info in manifest["pieces"].items():
        i, dim = info["token_index"]
        piece = BucketedPiece(sig, (i, dim), max_num_tokens, info["returns_tuple"])
        if "range" in info:
            piece.range = load(info["range"])
        if "few" in info:
            low, high = info["few"]["rows"]
            piece.few, piece.few_rows = load(info["few"]["artifact"]), (int(low), int(high))
        for n, rel in info["exact"].items():
            piece.exact[int(n)] = load(rel)
        pieces[sig] = piece
    heads = {int(n): load(rel) for n, rel in manifest.get("logits_heads", {}).items()}
    return pieces, heads


def _load_through_inductor(entry: Path, manifest: dict[str, Any], max_num_tokens: int, inductor_dir: Path,
                           kernels_built: bool) -> _Pieces:
    """Inductor loads the artifacts from its cache at ``inductor_dir`` (and
    rebuilds the kernel libraries missing there unless ``kernels_built``)."""
    import torch._inductor.compile_fx  # noqa: F401  (seconds: ``warm_up`` may have done it already)
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    toolchain = manifest.get("toolchain") or {}
    with (
        temporary_cache_dir(str(inductor_dir)),
        inductor_settings(),
        recorded_vec_isa(toolchain.get("vec_isa")),
        recorded_compiler(toolchain.get("cxx"), kernels_built=kernels_built),
    ):
        return _load_pieces(manifest, max_num_tokens, lambda rel: _load_artifact(entry / rel))


def warm_up(cache_dir: Path | None = None) -> None:
    """The one-time work of loading a first artifact, done ahead: importing
    Inductor's compile path and knowing the hash of torch's sources (Inductor's
    own cache key, recorded under kiln's ``cache_dir``, default
    ``kiln.config.default_cache_dir()``: ``toolchain.recorded_torch_key``). Only
    an entry that Inductor must load needs it (not one whose artifacts replay,
    ``kiln.compiler.replay``); there it is most of a warm start
    (``import_compiler``, 3.8-4.3 s against 0.57-0.71 s of ``load_artifacts`` for
    the 135M shape, bench/results/startup-cpu-20261201-172725.json), and a
    background load does it off the engine's thread."""
    import torch._inductor.compile_fx  # noqa: F401

    from kiln.config import default_cache_dir

    recorded_torch_key((cache_dir or default_cache_dir()) / TORCH_KEY_FILE)


@contextlib.contextmanager
def inductor_settings() -> Iterator[None]:
    """Inductor settings that must be the same when an entry is built and loaded.

    Precompiled C++ headers are on (the setting is part of every kernel's cache
    key): a cold compile builds Inductor's C++ prelude once (about 8 s of g++
    here) and each kernel's C++ build then takes a half to a third as long; with
    the parallel jobs a cold compile of the 135M shape takes 33.6 s instead of
    96.6 s (bench/results/startup-cpu-20261201-091546.json). The header lives
    outside any cache directory (under $TMPDIR), and a warm start, whose kernels
    are all built, skips it (``toolchain.recorded_compiler``)."""
    from torch._inductor import config

    patch = {"cpp_cache_precompile_headers": True} if hasattr(config, "cpp_cache_precompile_headers") else {}
    with config.patch(patch):
        yield


def _load_artifact(path: Path) -> Any:
    return torch._inductor.CompiledArtifact.load(path=str(path), format="binary")


def _attention_kernel(inductor_dir: Path, name: str | None) -> CpuAttentionKernel | None:
    """The entry's CPU attention kernels, loaded; built again when they are
    missing (a repair, which needs the C compiler, like Inductor's rebuilds).
    None for an entry without one, or when it cannot be built: the torch path
    then serves, slower, and a warning says so."""
    if name is None:
        return None
    if not (inductor_dir / name).is_file():
        try:
            name = build_cpu_attention(inductor_dir)  # named after today's source: an edited kernel, a new name
        except (KernelBuildError, OSError) as e:
            logger.warning("CPU attention runs on the torch path: %s", e)
            return None
    return CpuAttentionKernel(inductor_dir / name)


def _linear_kernel(inductor_dir: Path, name: str | None, model: nn.Module) -> cpu_linear.CpuLinearKernel | None:
    """The entry's small-batch linear kernel, loaded as the op's implementation;
    built again when it is missing (a repair). Unlike the attention kernel it
    is not optional: the entry's few-token pieces call it, so an entry that
    lists it cannot run without it."""
    if name is None:
        return None
    if not (inductor_dir / name).is_file():
        # raises KernelBuildError, naming the compiler's message
        rebuilt = cpu_linear.build(inductor_dir, cpu_linear.model_kinds(model))
        if rebuilt != name:
            raise KernelBuildError(f"the entry's linear kernel {name} is missing, and today's source builds "
                                   f"{rebuilt}, a different one")
    return cpu_linear.load(inductor_dir / name)
