"""A warm start asks the C++ toolchain nothing: Inductor's vector-ISA choice is
replayed from the entry without probe builds, on any CPU.

The machine building this suite may lack AVX-512; the test makes Inductor see an
AVX-512 CPU with bf16 and VNNI (where its probe builds three test kernels) and
counts the builds, which must be none with the recorded answer in place."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch._inductor import codecache, cpu_vec_isa

from kiln.compiler.toolchain import recorded_vec_isa


def _clear_isa_caches() -> None:
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    for cls in vars(cpu_vec_isa).values():
        if isinstance(cls, type) and issubclass(cls, cpu_vec_isa.VecISA):
            for attr in vars(cls).values():
                getattr(attr, "cache_clear", lambda: None)()


@pytest.fixture()
def avx512_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """An AVX-512 + bf16 + VNNI CPU as Inductor sees it; yields the probe builds."""
    builds: list[str] = []
    saved = {i: dict(vars(i)) for i in cpu_vec_isa.supported_vec_isa_list}
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2", "avx512", "avx512_vnni"])
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda self, code: builds.append(str(self)) or True)
    _clear_isa_caches()
    yield builds
    monkeypatch.undo()
    for isa, attrs in saved.items():
        vars(isa).clear()
        vars(isa).update(attrs)
    _clear_isa_caches()


RECORD = {"name": "avx512 avx512_vnni", "avx512_bf16": True, "amx_fp16": False}


def test_recorded_isa_needs_no_probe_build_and_gives_the_probed_answer(avx512_cpu: list[str]) -> None:
    from torch._inductor import config

    with recorded_vec_isa(RECORD):
        picked = {str(cpu_vec_isa.pick_vec_isa()), str(codecache.pick_vec_isa())}
        replayed_flags = cpu_vec_isa.pick_vec_isa().build_arch_flags()
    assert avx512_cpu == []
    assert picked == {"avx512 avx512_vnni"}
    # What the replay replaces: even with ``cpp.vec_isa_ok`` set (kiln's earlier
    # shortcut), Inductor test-builds kernels for bf16 and VNNI on such a CPU.
    _clear_isa_caches()
    with config.patch({"cpp.vec_isa_ok": True}):
        probed = cpu_vec_isa.pick_vec_isa()
    assert len(avx512_cpu) >= 2
    assert str(probed) == "avx512 avx512_vnni" and probed.build_arch_flags() == replayed_flags
