"""A warm start asks the C++ toolchain nothing: Inductor's vector-ISA choice is
replayed from the entry without probe builds, on any CPU.

The machine building this suite may lack AVX-512; the test makes Inductor see an
AVX-512 CPU with bf16 and VNNI (where its probe builds three test kernels) and
counts the builds, which must be none with the recorded answer in place. The
hash of torch's sources Inductor checks on every load is replayed too, while
torch's files are unchanged."""

from __future__ import annotations

import json
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


def test_a_recorded_amx_isa_asks_linux_for_the_tiles_as_the_probe_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's AMX check ends with torch.cpu._init_amx (arch_prctl), and
    Inductor's AMX kernels fault in a process that never asked: the replayed
    record asks in its place; a record without AMX does not."""
    asked: list[bool] = []
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(True) or True)
    with recorded_vec_isa(RECORD):
        pass
    assert asked == []
    with recorded_vec_isa({**RECORD, "name": "avx512 avx512_vnni amx_tile"}):
        assert str(cpu_vec_isa.pick_vec_isa()) == "avx512 avx512_vnni amx_tile"
    assert asked == [True]


def test_torch_key_is_recorded_then_replayed_while_torch_is_unchanged(tmp_path, monkeypatch) -> None:
    from torch._inductor import codecache

    from kiln.compiler import toolchain

    memo = tmp_path / "torch-key.json"
    try:
        codecache.torch_key.clear()
        toolchain.recorded_torch_key(memo)  # computed, then recorded
        real = codecache.torch_key()
        saved = json.loads(memo.read_text())
        assert saved["key"] == real.hex() and saved["digest"] == toolchain._torch_tree_digest()

        # a recorded key is what Inductor gets while torch's files are as they were
        memo.write_text(json.dumps({**saved, "key": "ab" * 32}))
        codecache.torch_key.clear()
        toolchain.recorded_torch_key(memo)
        assert codecache.torch_key() == bytes.fromhex("ab" * 32)

        # a file of torch changed (another digest): the key is computed again and recorded
        monkeypatch.setattr(toolchain, "_torch_tree_digest", lambda: "changed")
        codecache.torch_key.clear()
        toolchain.recorded_torch_key(memo)
        assert codecache.torch_key() == real
        assert json.loads(memo.read_text()) == {**saved, "digest": "changed"}
    finally:
        codecache.torch_key.clear()  # the next user computes the real key


def test_a_torch_key_already_known_in_the_process_is_kept(tmp_path, monkeypatch) -> None:
    """torch 2.11's ``torch_key.set`` asserts that no key was computed yet (2.13
    raises RuntimeError): a second Runtime.load in one process failed there on the
    GPU machine. Both must leave the process's key as it is."""
    from torch._inductor import codecache

    from kiln.compiler import toolchain

    memo = tmp_path / "torch-key.json"
    memo.write_text(json.dumps({"digest": "same", "key": "ab" * 32}))
    monkeypatch.setattr(toolchain, "_torch_tree_digest", lambda: "same")
    for error in (AssertionError, RuntimeError):
        calls = []

        def known_key() -> bytes:
            return b"known"

        def refuse(value: bytes, error=error) -> None:
            calls.append(value)
            raise error()

        known_key.set = refuse
        monkeypatch.setattr(codecache, "torch_key", known_key)
        toolchain.recorded_torch_key(memo)
        assert calls == [bytes.fromhex("ab" * 32)]
        assert codecache.torch_key() == b"known"


AMX_RECORD = {"name": "avx512 avx512_vnni amx_tile", "avx512_bf16": True, "amx_fp16": False}


@pytest.mark.parametrize("predicted, kernel_isa, vnni, amx, trusted", [
    ({"name": "avx512 avx512_vnni", "avx512_bf16": True}, "avx512-bf16", True, (False, False), True),
    ({"name": "avx512 avx512_vnni", "avx512_bf16": True}, "avx512", True, (False, False), False),  # no bf16 built
    ({"name": "avx512 avx512_vnni", "avx512_bf16": False}, "avx512", False, (False, False), False),  # no VNNI
    ({"name": "avx512", "avx512_bf16": False}, "avx2", False, (False, False), False),  # stopped at AVX2
    ({"name": "avx2", "avx512_bf16": False}, "avx2", False, (False, False), True),
    (AMX_RECORD, "avx512-bf16", True, (True, False), True),  # the compiler targeted the tiles
    (AMX_RECORD, "avx512-bf16", True, (False, False), False),  # it did not: probed
    ({**AMX_RECORD, "amx_fp16": True}, "avx512-bf16", True, (True, False), False),  # AMX-FP16 not built: probed
    ({**AMX_RECORD, "amx_fp16": True}, "avx512-bf16", True, (True, True), True),  # and built
    (AMX_RECORD, "avx512", True, (True, False), False),  # the tiles, but no AVX512-BF16 built
    ({"name": "avx2", "avx512_bf16": False}, None, False, (False, False), False),  # no kernel to vouch for it
    (None, "avx512-bf16", True, (True, True), False),
])
def test_a_prediction_is_trusted_only_where_kilns_kernel_built_its_extensions(
        predicted, kernel_isa, vnni: bool, amx: tuple[bool, bool], trusted: bool) -> None:
    from kiln.compiler.toolchain import trusted_prediction

    assert trusted_prediction(predicted, kernel_isa, vnni, *amx) is trusted
