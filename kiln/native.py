"""Building kiln's own C kernels (decode attention, small-batch linears) with the
machine's C compiler, into Inductor's cache beside Inductor's kernels.

A kernel library is a compiled artifact like Inductor's: built when a CPU entry
is compiled (``-march=native``: the entry's cache key pins the CPU's features),
named after its source and flags (an edited kernel gets a new name, never an
old library), listed and checksummed in the entry's manifest, and copied into
bundles, so a warm start loads it with ``ctypes`` and runs no compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["FLAGS", "SUBDIR", "KernelBuildError", "NativeSource", "c_function", "import_extension", "python_headers",
           "register_c_function"]

# a call to an undeclared function is an error, not an undefined symbol found at load time
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-Werror=implicit-function-declaration")
SUBDIR = "kiln-native"  # under the Inductor cache the libraries are kept in


class KernelBuildError(RuntimeError):
    """The C compiler could not build a kernel (its message included)."""


@dataclass(frozen=True)
class NativeSource:
    """One C source file and the prefix of the library built from it."""

    path: Path
    prefix: str  # "cpu-attention": libraries are kiln-native/cpu-attention-<digest>.so

    def library_name(self, extra_flags: tuple[str, ...] = ()) -> str:
        """The library's path relative to the Inductor cache."""
        flags = " ".join(FLAGS + extra_flags).encode()
        digest = hashlib.sha256(self.path.read_bytes() + flags).hexdigest()[:16]
        return f"{SUBDIR}/{self.prefix}-{digest}.so"

    def build(self, inductor_dir: Path, extra_flags: tuple[str, ...] = (),
              include_dirs: tuple[str, ...] = ()) -> str:
        """Build the library into ``inductor_dir`` unless it is there; returns
        its name relative to it. Written to a temporary file and renamed, so a
        concurrent reader never sees half a library. ``extra_flags`` follow
        ``FLAGS`` (``-mno-avx512f``: the code a CPU without AVX-512 runs);
        ``include_dirs`` (``-I``) are where headers are found, not part of the
        name: a bundle's library keeps its name on a machine whose headers
        lie elsewhere."""
        name = self.library_name(extra_flags)
        target = inductor_dir / name
        if target.is_file():
            return name
        target.parent.mkdir(parents=True, exist_ok=True)
        cc = _compiler(self.path.name)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{self.prefix}-", suffix=".so")
        os.close(fd)
        try:
            includes = [f"-I{d}" for d in include_dirs]
            done = subprocess.run([cc, *FLAGS, *extra_flags, *includes, "-x", "c", str(self.path), "-x", "none",
                                   "-o", tmp, "-lm"], capture_output=True, text=True)
            if done.returncode != 0:
                raise KernelBuildError(f"{cc} failed to build {self.path.name} (exit {done.returncode}): "
                                       f"{done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return name


def python_headers() -> str | None:
    """The directory holding this Python's ``Python.h``, or None where the
    headers are not installed."""
    include = sysconfig.get_paths().get("include")
    return include if include and (Path(include) / "Python.h").is_file() else None


def import_extension(path: Path, name: str) -> ModuleType:
    """Import the library at ``path`` as the Python extension module ``name``
    (its ``PyInit_<name>``), once per process, with the address of torch's
    tensor-data helper in the environment, where Inductor's CPU kernels and
    kiln's look for it."""
    path = path.resolve()
    module = _EXTENSIONS.get(path)
    if module is None:
        import torch

        os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(
            torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr
        )
        spec = importlib.util.spec_from_file_location(f"kiln_native_{path.stem}.{name}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path}: not a loadable extension library")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _EXTENSIONS[path] = module
    return module


_EXTENSIONS: dict[Path, ModuleType] = {}


def register_c_function(fn: Any, symbol: Any) -> None:
    """Record that ``fn``, a function of an extension module, calls the C
    function ``symbol`` (a ctypes function of the same library) with the same
    arguments, each tensor as its data address and None as NULL. A CPU call
    graph (``kiln.graphs.cpu``) then makes its calls from C."""
    _C_FUNCTIONS[id(fn)] = (fn, ctypes.cast(symbol, ctypes.c_void_p).value)


def c_function(fn: Any) -> int | None:
    """The address of the C function ``fn`` calls with integer arguments alone
    (addresses, sizes, flags): a ctypes function whose declared arguments are
    all integers or pointers, or an extension function registered with
    ``register_c_function``. None for anything else."""
    if isinstance(fn, ctypes._CFuncPtr):
        if fn.argtypes is None or any(t in _FLOATS for t in fn.argtypes):
            return None
        return ctypes.cast(fn, ctypes.c_void_p).value
    entry = _C_FUNCTIONS.get(id(fn))
    return entry[1] if entry is not None and entry[0] is fn else None


_C_FUNCTIONS: dict[int, tuple[Any, int | None]] = {}  # id(fn) -> (fn, its C function's address)
_FLOATS = (ctypes.c_float, ctypes.c_double, ctypes.c_longdouble)


def _compiler(what: str) -> str:
    """The C compiler: $CC, else the usual names, else the C++ compiler
    Inductor uses ($CXX, g++), told by ``-x c`` that the source is C."""
    for candidate in (os.environ.get("CC"), "gcc", "cc", "clang", os.environ.get("CXX"), "g++", "c++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise KernelBuildError(f"no C compiler found (tried $CC, gcc, cc, clang, $CXX, g++, c++) to build {what}")
