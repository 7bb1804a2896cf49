"""Running Inductor's CPU output code without importing Inductor.

Loading an artifact through Inductor (``CompiledArtifact.load``) first imports
Inductor and Dynamo: 3.1-4.8 s of a 4.6-7 s warm start of the 135M shape on
this machine (``import_compiler`` in bench/results/startup-cpu-*.json), against
0.5-0.7 s for loading every artifact after it. What a CPU artifact runs needs
none of that: its output code is a Python module that allocates buffers with
torch's C helpers, calls extern matrix products (``torch.mm``,
``torch.addmm``) and C++ kernels that Inductor built as Python extension
modules in its cache. So when an entry is built, each CPU artifact whose code
uses nothing else is exported beside it: its output code with Inductor's
imports and kernel builds replaced by the names of the kernel libraries
(``export``). Loading one (``load``) runs that code and imports the
libraries, with no Inductor, no Dynamo and no compiler.

An artifact is exported only when the wrappers Inductor and AOTAutograd put
around its code would do nothing but turn grad mode off: an inference graph
without input mutations, aliased outputs, effect tokens, functionalised RNG,
tensor subclasses, duplicated inputs, constants or inputs to realign. Anything
else (every CUDA artifact: its kernels are Triton's) keeps Inductor's loader,
and so does an entry with any artifact left out (``covers``).
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import logging
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from kiln.compiler import activation, cpu_linear, onednn
from kiln.native import import_extension, register_c_function

__all__ = ["NotReplayable", "ReplayedArtifact", "artifacts", "covers", "export", "load"]

logger = logging.getLogger(__name__)

REPLAY_FORMAT = 1
KERNEL_LOADER = "__kiln_kernel__"  # what the exported code calls for each kernel library

# The module-level imports from Inductor that exported code drops, as (module,
# name, the name it is bound to): ``load`` binds stand-ins for ``extern_kernels``
# and ``align``, the ``async_compile`` statements are rewritten, and the hooks
# and the profiler may be imported but not used (``_check_names``).
_DROPPED_IMPORTS = frozenset({
    ("torch._inductor.async_compile", "AsyncCompile", "AsyncCompile"),
    ("torch._inductor.select_algorithm", "extern_kernels", "extern_kernels"),
    ("torch._inductor.codegen.memory_planning", "_align", "align"),
    ("torch._inductor.hooks", "run_intermediate_hooks", "run_intermediate_hooks"),
    ("torch._inductor.utils", "maybe_profile", "maybe_profile"),
})
_PLAIN_MODULES = {"torch", "math", "cmath", "random", "os", "tempfile", "ctypes"}
_DROPPED_FUNCTIONS = {"get_args", "benchmark_compiled_module"}  # Inductor's benchmark helpers
_ALIGN_BYTES = 64
# kiln's own ops that exported code calls directly, without the dispatcher: the
# op's Python implementation is what the dispatcher would call, and the trip
# through it costs about 14 us a call (120 calls a decode step of the 135M shape)
_DIRECT_OPS = {"torch.ops.kiln.cpu_linear.default": ("__kiln_cpu_linear__", cpu_linear.implementation),
               "torch.ops.kiln.onednn_linear.default": ("__kiln_onednn_linear__", onednn.implementation),
               "torch.ops.kiln.silu_mul.default": ("__kiln_silu_mul__", activation.implementation)}
# Inductor's checks of each input's and extern kernel output's sizes and strides
# (its ``size_asserts``), run on every call: about 450 calls and 0.2-0.3 ms of a
# decode step of the 135M shape. A replayed artifact's inputs come from the
# split graph it was compiled from, picked by token count, so export drops them.
_DROPPED_CHECKS = frozenset({"assert_size_stride", "assert_alignment"})


class NotReplayable(Exception):
    """An artifact whose code or wrappers need Inductor at run time."""


def align(nbytes: int) -> int:
    """Inductor's memory-planning alignment (``memory_planning._align``);
    ``export`` checks the two agree before it relies on this one."""
    return (nbytes + _ALIGN_BYTES - 1) & -_ALIGN_BYTES


class _ExternKernels:
    """Inductor's ``extern_kernels`` for the names ``export`` found to be torch's
    own functions (``extern_kernels.mm is torch.mm``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# --------------------------------------------------------------------- export


def artifacts(manifest: dict[str, Any]) -> list[str]:
    """The paths of an entry's artifacts, from its manifest."""
    paths = [p["range"] for p in manifest["pieces"].values() if "range" in p]
    paths += [p["few"]["artifact"] for p in manifest["pieces"].values() if "few" in p]
    paths += [rel for p in manifest["pieces"].values() for rel in p["exact"].values()]
    return paths + list(manifest.get("logits_heads", {}).values())


def covers(manifest: dict[str, Any]) -> bool:
    """Every artifact of the entry has its exported code: it loads without Inductor."""
    records = manifest.get("replay") or {}
    paths = artifacts(manifest)
    return bool(paths) and all(rel in records for rel in paths)


def export(entry: Path, artifact: str, inductor_dir: Path, libraries: set[str]) -> dict[str, Any]:
    """Write the replayable code of the saved artifact ``entry/artifact`` (a
    binary ``CompiledArtifact``) and return its record for the manifest; raise
    NotReplayable when it does not qualify. Runs where the artifact was built,
    with Inductor configured as it was (its kernel libraries are then found,
    not built); ``libraries`` are those the entry lists, relative to
    ``inductor_dir``, and every library the code needs must be one of them."""
    result, graph = _unpack(entry / artifact)
    _check_wrappers(result, graph)
    code, used = _rewrite(graph.source_code, inductor_dir, libraries)
    rel = str(Path("replay") / Path(artifact).with_suffix(".py").name)
    (entry / "replay").mkdir(exist_ok=True)
    (entry / rel).write_text(code)
    return {"format": REPLAY_FORMAT, "code": rel, "libraries": sorted(used)}


def _unpack(path: Path) -> tuple[Any, Any]:
    """The AOTAutograd result and the Inductor graph a binary artifact holds,
    unpacked by torch into a scratch cache directory."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    from torch.utils._appending_byte_serializer import BytesReader

    reader = BytesReader(path.read_bytes())
    reader.read_bytes()  # header
    reader.read_bytes()  # torch key
    reader.read_str()  # AOTAutograd cache key
    data = reader.read_bytes()
    with tempfile.TemporaryDirectory(prefix="kiln-replay-") as tmp:
        with temporary_cache_dir(tmp):
            torch.compiler.load_cache_artifacts(data)
        results = sorted(Path(tmp, "aotautograd").glob("*/*"))
        graphs = sorted(Path(tmp, "fxgraph").glob("*/*/*"))
        if len(results) != 1 or len(graphs) != 1:
            raise NotReplayable(f"{path.name}: {len(results)} AOTAutograd results and {len(graphs)} Inductor "
                                "graphs, where one of each was expected")
        return pickle.loads(results[0].read_bytes()), pickle.loads(graphs[0].read_bytes())


def _check_wrappers(result: Any, graph: Any) -> None:
    """Raise NotReplayable unless the wrappers around the code do nothing but
    disable grad mode."""
    meta = result.runtime_metadata
    problems = {
        "a backward graph": result.compiled_bw is not None,
        "tensor subclasses": result.maybe_subclass_meta is not None,
        "inputs to detach": bool(result.indices_of_inps_to_detach),
        "wrappers with run-time work": any(getattr(w, "needs_post_compile", True) for w in result.dispatch_wrappers),
        "mutated inputs": meta.num_mutated_inp_runtime_indices > 0 or bool(graph.mutated_input_idxs),
        "aliased outputs": meta.num_outputs_aliased > 0 or meta.num_intermediate_bases > 0,
        "effect tokens": bool(meta.tokens),
        "functionalised RNG": bool(meta.is_rng_op_functionalized) or meta.num_outputs_rng_offset > 0,
        "constants": bool(graph.constants) or bool(getattr(graph, "torchbind_constants", None)),
        "inputs to realign": bool(graph.inputs_to_check) or bool(getattr(graph, "_defers_input_alignment", False)),
        "devices other than the CPU": set(graph.device_types) - {"cpu"} != set(),
    }
    found = [what for what, present in problems.items() if present]
    if found:
        raise NotReplayable(", ".join(found))


def _rewrite(source: str, inductor_dir: Path, libraries: set[str]) -> tuple[str, set[str]]:
    """The output code without Inductor: its imports from Inductor dropped (the
    stand-ins are given at load), each kernel build replaced by a load of the
    library Inductor built for it, the benchmark helpers dropped."""
    tree = ast.parse(source)
    body: list[ast.stmt] = []
    used: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and not body:
            continue  # the docstring: Inductor's autotuning notes
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            _check_import(stmt)
            if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("torch._inductor"):
                continue
        elif _is_async_compile_setup(stmt) or _is_benchmark_helper(stmt):
            continue
        elif (library := _kernel_build(stmt)) is not None:
            name, argtypes, kernel_source = library
            rel = _library_for(argtypes, kernel_source, inductor_dir, libraries)
            used.add(rel)
            stmt = ast.parse(f"{name} = {KERNEL_LOADER}({rel!r})").body[0]
        body.append(stmt)
    module = _DirectCalls().visit(ast.Module(body=body, type_ignores=[]))
    _check_names(module)
    return ast.unparse(module) + "\n", used


class _DirectCalls(ast.NodeTransformer):
    """Calls of the ops in ``_DIRECT_OPS`` become calls of their implementation;
    the checks of ``_DROPPED_CHECKS`` become ``pass``."""

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        call = node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in _DROPPED_CHECKS:
            return ast.Pass()
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        direct = _DIRECT_OPS.get(ast.unparse(node.func))
        if direct is not None:
            node.func = ast.Name(id=direct[0], ctx=ast.Load())
        return node


def _check_import(stmt: ast.Import | ast.ImportFrom) -> None:
    if isinstance(stmt, ast.Import):
        modules = [alias.name for alias in stmt.names]
        if all(m in _PLAIN_MODULES for m in modules):
            return
        raise NotReplayable(f"imports {', '.join(modules)}")
    if stmt.module in _PLAIN_MODULES:
        return
    for alias in stmt.names:
        if (stmt.module, alias.name, alias.asname or alias.name) not in _DROPPED_IMPORTS:
            raise NotReplayable(f"imports {alias.name} from {stmt.module}"
                                + (f" as {alias.asname}" if alias.asname else ""))
    if any(alias.name == "_align" for alias in stmt.names):
        from torch._inductor.codegen.memory_planning import _align

        if any(_align(n) != align(n) for n in (0, 1, 15, 16, 63, 64, 65, 4097)):
            raise NotReplayable("Inductor's memory-planning alignment is not kiln's stand-in's")


def _is_async_compile_setup(stmt: ast.stmt) -> bool:
    """``async_compile = AsyncCompile()``, ``async_compile.wait(globals())``, ``del async_compile``."""
    text = ast.unparse(stmt)
    return text in ("async_compile = AsyncCompile()", "async_compile.wait(globals())", "del async_compile")


def _is_benchmark_helper(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.FunctionDef):
        return stmt.name in _DROPPED_FUNCTIONS
    return isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "__name__ == '__main__'"


def _kernel_build(stmt: ast.stmt) -> tuple[str, list[str], str] | None:
    """(name, argument types, C++ source) of ``name = async_compile.cpp_pybinding(types, source)``."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    call = stmt.value
    if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "async_compile.cpp_pybinding"):
        return None
    if len(call.args) != 2 or call.keywords:
        raise NotReplayable("a kernel build with arguments other than (types, source)")
    return stmt.targets[0].id, ast.literal_eval(call.args[0]), ast.literal_eval(call.args[1])


def _library_for(argtypes: list[str], kernel_source: str, inductor_dir: Path, libraries: set[str]) -> str:
    """The kernel library Inductor built for this source (asked of Inductor,
    which finds it in its cache), relative to ``inductor_dir``."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    kernel = CppPythonBindingsCodeCache.load_pybinding(argtypes, kernel_source)
    module = getattr(kernel, "__self__", None)
    path = Path(getattr(module, "__file__", "") or "")
    root = inductor_dir.resolve()
    if not path.resolve().is_relative_to(root):
        raise NotReplayable(f"a kernel library outside the Inductor cache: {path}")
    rel = str(path.resolve().relative_to(root))
    if rel not in libraries:
        raise NotReplayable(f"kernel library {rel} is not among the entry's")
    return rel


def _check_names(module: ast.Module) -> None:
    """What is left may use no Inductor name but the stand-ins, and of
    ``extern_kernels`` only torch's own functions."""
    from torch._inductor.select_algorithm import extern_kernels

    for node in ast.walk(module):
        if isinstance(node, ast.Name) and node.id in ("async_compile", "AsyncCompile", "run_intermediate_hooks",
                                                      "maybe_profile"):
            raise NotReplayable(f"the code uses {node.id}")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "extern_kernels":
            if getattr(extern_kernels, node.attr, None) is not getattr(torch, node.attr, object()):
                raise NotReplayable(f"extern kernel {node.attr} is not torch.{node.attr}")


# ----------------------------------------------------------------------- load


class ReplayedArtifact:
    """An exported artifact: called as its ``CompiledArtifact`` is, with the
    same kernels, so its outputs are the same to the bit. ``namespace`` is the
    one its code runs in; ``kernels`` the names there of its kernel
    functions, which the code looks up on every call."""

    def __init__(self, name: str, call: Any, namespace: dict[str, Any] | None = None,
                 kernels: tuple[str, ...] = ()) -> None:
        self.name = name
        self._call = call
        self.namespace = namespace if namespace is not None else {}
        self.kernels = kernels

    ALLOCATOR = "empty_strided_cpu"  # the name the exported code allocates its buffers through

    def native_sites(self) -> list[tuple[dict[str, Any], str]]:
        """Where its code finds each kernel function (``kiln.graphs.cpu``):
        every native call it makes, besides those of kiln's own ops
        (``_DIRECT_OPS``, whose kernels name their own sites)."""
        return [(self.namespace, name) for name in self.kernels]

    def __call__(self, *args: Any) -> Any:
        if torch.is_grad_enabled():  # what AOTAutograd's inference wrapper does
            with torch.no_grad():
                return self._call(list(args))
        return self._call(list(args))

    def __repr__(self) -> str:
        return f"ReplayedArtifact({self.name})"


def load(entry: Path, record: dict[str, Any], inductor_dir: Path) -> ReplayedArtifact:
    """Run the exported code of one artifact; its kernel libraries come from
    ``inductor_dir``. Imports nothing of Inductor."""
    if record.get("format") != REPLAY_FORMAT:
        raise ValueError(f"{entry}: replay format {record.get('format')!r}, this kiln reads {REPLAY_FORMAT}")
    path = entry / record["code"]
    loaded: list[Any] = []

    def kernel(rel: str) -> Any:
        fn = _kernel(inductor_dir / rel)
        loaded.append(fn)
        return fn

    namespace: dict[str, Any] = {
        "__name__": f"kiln_replay.{path.stem}",
        "__builtins__": builtins,
        "extern_kernels": _ExternKernels(),
        "align": align,
        KERNEL_LOADER: kernel,
        **{name: fn for name, fn in _DIRECT_OPS.values()},
    }
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    kernels = tuple(name for name, value in namespace.items() if any(value is fn for fn in loaded))
    return ReplayedArtifact(path.stem, namespace["call"], namespace, kernels)


def _kernel(path: Path) -> Any:
    """The ``kernel`` function of one of Inductor's CPU kernel libraries, imported
    as Inductor imports it (the library finds torch's tensor-pointer helper
    through an environment variable)."""
    fn = import_extension(path, "kernel").kernel
    # the module's ``kernel`` parses its arguments and calls the C function
    # ``kernel`` with them in order, tensors as their data addresses
    register_c_function(fn, ctypes.CDLL(str(path)).kernel)
    return fn
