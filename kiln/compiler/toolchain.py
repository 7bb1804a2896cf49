"""What a warm start would otherwise ask the C++ toolchain, answered from the entry.

Loading a CPU artifact makes Inductor ask three things that it answers by running
the C++ compiler: which vector ISA to target (test builds of small probe kernels,
``pick_vec_isa``), which compiler it is (``g++ --version``), and where each
kernel's shared library is (built again if missing). The entry records the first
two when it is built, and the list of kernel libraries it needs with their
checksums; loading replays the answers, so a warm start runs no compiler at all
and works in an image without a toolchain. The cache key pins the CPU features
the ISA choice depends on (``kiln.cache.keys.cpu_features``), so a recorded answer is only ever
replayed on a CPU that gives the same one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kiln.cache.store import atomic_write_json, file_sha256

__all__ = [
    "ToolchainWarmup",
    "recorded_torch_key",
    "checksum_kernels",
    "compiler_identity",
    "kernel_files",
    "predicted_vec_isa_record",
    "recorded_compiler",
    "recorded_vec_isa",
    "trusted_prediction",
    "vec_isa_record",
]

logger = logging.getLogger(__name__)

# ISA attributes set by Inductor's probes, which change the flags kernels build with
_ISA_PROBED_ATTRS = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_fp16": "_is_amx_fp16_supported"}


def vec_isa_record() -> dict[str, Any]:
    """Inductor's ISA choice on this machine (probing with the compiler), to
    record in an entry built here."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    record = {"name": str(isa), "arch_flags": isa.build_arch_flags() if isa else ""}
    for key, attr in _ISA_PROBED_ATTRS.items():
        record[key] = bool(getattr(isa, attr, False))
    return record


def _patched(patches: dict[tuple[Any, str], Any]) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def apply() -> Iterator[None]:
        saved = {(mod, name): getattr(mod, name) for mod, name in patches if hasattr(mod, name)}
        try:
            for (mod, name), value in patches.items():
                if (mod, name) in saved:
                    setattr(mod, name, value)
            yield
        finally:
            for (mod, name), value in saved.items():
                setattr(mod, name, value)

    return apply()


@contextlib.contextmanager
def recorded_vec_isa(record: dict[str, Any] | None) -> Iterator[None]:
    """Inside, Inductor's ``pick_vec_isa`` returns the recorded ISA, and its
    truth is the record's, without a probe build. Without a record (an entry
    built for a GPU) nothing changes."""
    if not record:
        yield
        return
    from torch._inductor import codecache, cpu_vec_isa

    isa = next((i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == record["name"]), None)
    if isa is None:
        logger.info("vector ISA %r recorded in the entry is unknown to this torch; Inductor will probe",
                    record["name"])
        yield
        return
    for key, attr in _ISA_PROBED_ATTRS.items():
        if hasattr(isa, attr):
            setattr(isa, attr, bool(record.get(key, False)))
    if "amx" in record["name"]:
        # The probe's last step, skipped with it: Linux hands the tiles out per process, on
        # request, and a kernel built for them faults in a process that did not ask.
        init_amx = getattr(torch.cpu, "_init_amx", None)
        if init_amx is not None and not init_amx():
            logger.warning("vector ISA %r recorded in the entry uses AMX, which Linux did not grant this "
                           "process", record["name"])
    picked: Callable[[], Any] = lambda: isa  # noqa: E731
    # ``bool(isa)``, which Inductor's C++ builds ask, would run the probe's test
    # builds for it (three here, 2 CPU-seconds each): the record answers it.
    patches = {(cpu_vec_isa, "pick_vec_isa"): picked, (codecache, "pick_vec_isa"): picked,
               (cpu_vec_isa, "valid_vec_isa_list"): lambda: [isa], (type(isa), "__bool__"): lambda self: True}
    try:  # the CPU GEMM templates (max_autotune) imported the function itself
        from torch._inductor.codegen import cpp_micro_gemm

        patches[(cpp_micro_gemm, "pick_vec_isa")] = picked
    except ImportError:
        pass
    with _patched(patches):
        yield


_IDENTITY_CHECKS = ("_is_clang", "_is_gcc", "_is_apple_clang", "_is_intel_compiler", "_is_msvc_cl")


def compiler_identity() -> dict[str, Any] | None:
    """What Inductor learns about the C++ compiler by running it (``--version``):
    recorded when an entry is built so that loading it needs no compiler."""
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
def recorded_compiler(identity: dict[str, Any] | None, *, kernels_built: bool = True) -> Iterator[None]:
    """Inside, Inductor's questions about the compiler are answered from the
    entry. With ``kernels_built`` (every kernel library the entry needs is in
    the cache), the precompiled C++ header that loading a kernel would first
    build is skipped too: it only serves a build, and none will run."""
    if not identity:
        yield
        return
    from torch._inductor import codecache, cpp_builder

    patches: dict[tuple[Any, str], Any] = {
        (cpp_builder, "cpp_compiler_search"): lambda search: identity["compiler"],
        (cpp_builder, "get_compiler_version_info"): lambda compiler: identity["version"],
        (codecache, "get_compiler_version_info"): lambda compiler: identity["version"],
    }
    if kernels_built:
        patches[(codecache, "_precompile_header")] = lambda *args, **kwargs: ""
    for name in _IDENTITY_CHECKS:
        if name in identity:
            patches[(cpp_builder, name)] = lambda compiler, _v=identity[name]: _v
    with _patched(patches):
        yield


@contextlib.contextmanager
def kernel_files(inductor_dir: Path) -> Iterator[set[str]]:
    """Inside, collect (relative to ``inductor_dir``) the compiled kernel
    libraries Inductor writes or finds for the code it compiles or loads: what
    an entry needs from the shared kernel cache. Inductor names each library
    after the hash of its C++ source, written by ``codecache.write`` just before
    the library is looked up, so the sources written name the libraries."""
    from torch._inductor import codecache

    found: set[str] = set()
    write = codecache.write
    root = inductor_dir.resolve()

    def recording_write(content: Any, extension: str, *args: Any, **kwargs: Any) -> tuple[str, str]:
        key, path = write(content, extension, *args, **kwargs)
        library = Path(path).resolve().with_suffix(".so")
        if extension.endswith("cpp") and not extension.endswith("optimized.cpp") and library.is_relative_to(root):
            found.add(library.relative_to(root).as_posix())
        return key, path

    with _patched({(codecache, "write"): recording_write}):
        yield found


def checksum_kernels(inductor_dir: Path, names: set[str] | list[str]) -> dict[str, str]:
    """name -> sha256 of each kernel library that exists."""
    return {n: file_sha256(inductor_dir / n) for n in sorted(names) if (inductor_dir / n).is_file()}


class ToolchainWarmup:
    """The compiler's one-time work of a cold CPU compile, done while this
    process traces the model, so that the first compilations do not wait for it.

    - **The vector ISA, predicted** (``predicted``): what Inductor's probe
      picks when every probe build succeeds, from the CPU's flags alone. The
      probe itself (test builds of ATen's vector headers for each candidate)
      took 9 CPU-seconds here, an eighth of a cold compile's on two cores; the
      compile uses the prediction where kiln's own kernel builds vouch for it
      (``trusted_prediction``) and probes only where they do not.
    - **The precompiled C++ header** (10-15 s of g++ here), in a forked process,
      for the predicted ISA (``_build_header``). It lands under $TMPDIR, built
      under Inductor's own lock, so nothing is built twice and nothing waits
      for a build that failed: the compile does it then (a header for a
      mispredicted ISA is left unused). When one process built the probe and
      the header in turn, the header came 11 s after the first compilation had
      started waiting for it; now it is ready as the trace ends.

    Elsewhere than Linux, or for a GPU, nothing runs."""

    def __init__(self, device_type: str) -> None:
        self.pids: list[int] = []
        self.predicted: dict[str, Any] | None = None
        if device_type == "cpu" and sys.platform.startswith("linux"):
            self.predicted = _in_fork(predicted_vec_isa_record)
            pid = os.fork()
            if pid == 0:
                _run_and_exit(_build_header)
            self.pids.append(pid)

    def join(self) -> None:
        while self.pids:
            pid = self.pids.pop()
            _, status = os.waitpid(pid, 0)
            if status:
                logger.debug("a toolchain warm-up process ended with status %d", status)


def _run_and_exit(work: Callable[[], Any]) -> None:
    status = 1
    try:
        work()
        status = 0
    except BaseException:  # noqa: BLE001  (the compile builds what is missing itself)
        traceback.print_exc()
    finally:
        os._exit(status)


def predicted_vec_isa_record() -> dict[str, Any]:
    """``vec_isa_record()`` as it comes out when every probe build succeeds,
    without building anything. Run in a forked process only: it changes
    Inductor's probe for the rest of the process."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.VecISA.check_build = lambda self, code: True  # type: ignore[method-assign]
    return vec_isa_record()


def trusted_prediction(predicted: dict[str, Any] | None, kernel_isa: str | None, kernel_vnni: bool,
                       kernel_amx: bool = False, kernel_amx_fp16: bool = False) -> bool:
    """Whether the predicted ISA record can stand for the probe's answer: the
    C linear kernel, built by the machine's C compiler for this CPU
    (``-march=native``; gcc beside Inductor's g++ here), compiled the vector
    extensions the prediction names. A predicted AMX target is trusted where
    the compiler targeted the tiles' bf16 and int8 products (``kernel_amx``:
    ``CpuLinearKernel.amx_target``), and their fp16 ones where the prediction
    has them (``kernel_amx_fp16``); the prediction already asked Linux for
    the tiles (``torch.cpu._init_amx``), as the probe does. The probe took
    8.5 s of a cold load on an Intel Xeon with AMX (2 cores, 2026-12-07), its
    answer the prediction's."""
    if predicted is None or kernel_isa is None:
        return False
    name = predicted.get("name", "")
    if "amx" in name and (not kernel_amx or (predicted.get("amx_fp16") and not kernel_amx_fp16)):
        return False
    if "avx512" in name and not kernel_isa.startswith("avx512"):
        return False
    if "avx512_vnni" in name and not kernel_vnni:
        return False
    return not (predicted.get("avx512_bf16") and kernel_isa != "avx512-bf16")


def _in_fork(work: Callable[[], Any]) -> Any:
    """``work()``'s JSON result, computed in a forked process (None if it
    failed there)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read_end)
            data = json.dumps(work()).encode()
            while data:
                data = data[os.write(write_end, data):]
            status = 0
        except BaseException:  # noqa: BLE001  (the parent then probes)
            traceback.print_exc()
        finally:
            os._exit(status)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    return json.loads(b"".join(chunks)) if status == 0 and chunks else None


def _build_header() -> None:
    """Build one small vectorised kernel the way Inductor builds each of the
    model's, which builds the precompiled header on its way, with Inductor's ISA
    choice made as if every probe build succeeded. The kernel goes straight to
    Inductor's C++ cache, without a graph to lower: with one, the Python work of
    a whole compilation (8 s beside the trace here) came before the header's
    build. Run in a forked process only: it changes Inductor's probe for the
    rest of the process."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    cpu_vec_isa.VecISA.check_build = lambda self, code: True  # type: ignore[method-assign]
    CppPythonBindingsCodeCache.load_pybinding(["float*"], _VECTORIZED_KERNEL)


# Like the kernels Inductor writes for the model: its C++ prelude, and the vector
# types (which make Inductor build it for the picked ISA, with the header for that ISA).
_VECTORIZED_KERNEL = """
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(float* out_ptr0)
{
    auto tmp0 = at::vec::Vectorized<float>(1.0f);
    tmp0.store(out_ptr0);
}
"""


# Directories of the torch package that hold no Python sources Inductor hashes
_NOT_SOURCES = {"include", "lib", "share", "bin", "__pycache__", "test", "testing"}


def _torch_tree_digest() -> str:
    """A digest of torch's version and the size and modification time of every
    source file under the torch package (``.py``, and the ``.cpp``/``.ld``
    files ``torch_key`` adds): what changes whenever a file ``torch_key`` hashes
    changes, read with ``stat`` instead of reading them."""
    root = Path(torch.__file__).parent
    digest = hashlib.sha256(torch.__version__.encode())
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _NOT_SOURCES)
        rel = os.path.relpath(here, root)
        for name in sorted(files):
            if name.endswith((".py", ".cpp", ".ld")):
                st = os.stat(os.path.join(here, name))
                digest.update(f"{rel}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def recorded_torch_key(memo: Path) -> None:
    """Give Inductor its ``torch_key`` (a hash of torch's sources, which every
    artifact load checks) from ``memo`` when torch's files are as they were when
    it was recorded, else compute it and record it there. Sizes and
    modification times are what Python itself trusts to tell a stale ``.pyc``.
    Measured here in one process after Inductor's imports: hashing the sources
    0.21-0.48 s, the stat walk 25 ms, a replay with its file 40-100 ms (a whole
    warm start varied by more than that from run to run in the same hour).
    Nothing happens with a torch whose ``torch_key`` cannot be set."""
    from torch._inductor import codecache

    key_fn = codecache.torch_key
    if not hasattr(key_fn, "set"):
        return
    digest = _torch_tree_digest()
    try:
        saved = json.loads(memo.read_text())
    except (OSError, ValueError):
        saved = {}
    if isinstance(saved, dict) and saved.get("digest") == digest and isinstance(saved.get("key"), str):
        try:
            key_fn.set(bytes.fromhex(saved["key"]))
        except (RuntimeError, ValueError, AssertionError):
            # already known in this process (torch 2.13 raises RuntimeError, 2.11
            # asserts: seen on the GPU machine, where a second Runtime.load in one
            # process failed here), or a damaged record
            pass
        return
    key = key_fn()
    try:
        atomic_write_json(memo, {"digest": digest, "key": key.hex(), "torch": torch.__version__})
    except OSError:  # a read-only cache: the key is computed again next time
        logger.debug("could not record torch_key in %s", memo, exc_info=True)
