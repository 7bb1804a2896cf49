"""GGUF checkpoints: dequantization of every supported type against gguf's own
dequantizer and the original values, tiny llama / qwen2 / qwen3 files written
from transformers models the way llama.cpp's converter writes them (config and
every tensor compared), the tokenizer from the metadata, cache identity, and
errors that name the file and the key or tensor."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kiln.checkpoint import CheckpointError, open_checkpoint
from kiln.checkpoint.gguf import GGUFCheckpoint
from kiln.models import config_from_dict
from tests.conftest import build_hf_model, hf_greedy, load_eager, random_prompts

QK_K = 256


# ----------------------------------------------------------------------------- writing GGUF files
def llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``, verbatim in effect:
    applied to q_proj (n_head, n_head) and k_proj (n_head, n_head_kv), weights and biases."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def write_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: list[tuple[str, np.ndarray, Any]]) -> Path:
    """A GGUF with ``metadata`` (typed from the Python value) and ``tensors``:
    (name, array, raw ggml type or None for float arrays)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, array, raw_dtype in tensors:
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_vocab(size: int) -> tuple[list[str], list[str], list[int]]:
    """A small byte-level BPE vocabulary (GPT-2 alphabet) of exactly ``size``
    tokens: three control tokens, the 256 byte symbols, then merged pairs."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    tokens = SPECIALS + alphabet
    merges: list[str] = []
    letters = "etaoinshrdlucmfwypvbgk"
    pairs = [("\u0120", c) for c in letters] + [(a, b) for a in letters for b in letters]
    for a, b in pairs:
        if len(tokens) >= size:
            break
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    assert len(tokens) == size
    types = [3] * len(SPECIALS) + [1] * (size - len(SPECIALS))
    return tokens, merges, types


def hf_to_gguf(model: torch.nn.Module, family: str, *, tokenizer: bool = True,
               rope_freqs: torch.Tensor | None = None) -> tuple[dict[str, Any], list[tuple[str, np.ndarray, Any]]]:
    """Metadata and F32 tensors as llama.cpp's converter writes ``model``."""
    cfg = model.config
    arch = family
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    meta: dict[str, Any] = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv,
        f"{arch}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.dimension_count": head_dim,
    }
    if head_dim != cfg.hidden_size // heads:
        meta[f"{arch}.attention.key_length"] = head_dim
        meta[f"{arch}.attention.value_length"] = head_dim
    if tokenizer:
        tokens, merges, types = byte_level_vocab(cfg.vocab_size)
        meta.update({
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.chat_template": CHAT_TEMPLATE,
        })
    else:
        meta[f"{arch}.vocab_size"] = cfg.vocab_size
        if cfg.bos_token_id is not None:
            meta["tokenizer.ggml.bos_token_id"] = cfg.bos_token_id
        if cfg.eos_token_id is not None:
            meta["tokenizer.ggml.eos_token_id"] = cfg.eos_token_id

    block = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    tensors = []
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in top:
            gname = top[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{block[module]}.{suffix}"
        value = value.detach().float()
        if family == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = llama_cpp_permute(value, heads, heads)
        if family == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = llama_cpp_permute(value, heads, kv)
        tensors.append((gname, value.numpy().copy(), None))
    if rope_freqs is not None:
        tensors.append(("rope_freqs.weight", rope_freqs.numpy(), None))
    return meta, tensors


def tiny_metadata(arch: str = "llama", **extra: Any) -> dict[str, Any]:
    """Metadata of a small model with 256-wide rows (room for K-quant blocks)."""
    meta: dict[str, Any] = {
        f"{arch}.context_length": 128,
        f"{arch}.embedding_length": 256,
        f"{arch}.block_count": 1,
        f"{arch}.feed_forward_length": 512,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.vocab_size": 32,
    }
    meta.update(extra)
    return meta


def tiny_file(tmp_path: Path, name: str = "m.gguf", *, arch: str = "llama", drop: tuple[str, ...] = (),
              tensors: list[tuple[str, np.ndarray, Any]] | None = None, **extra: Any) -> Path:
    meta = {k: v for k, v in tiny_metadata(arch, **extra).items() if k not in drop}
    g = np.random.default_rng(0)
    if tensors is None:
        tensors = [
            ("token_embd.weight", g.standard_normal((32, 256), dtype=np.float32), None),
            ("blk.0.attn_q.weight", g.standard_normal((256, 256), dtype=np.float32), None),
            ("blk.0.attn_k.weight", g.standard_normal((128, 256), dtype=np.float32), None),
            ("blk.0.ffn_down.weight", g.standard_normal((256, 512), dtype=np.float32), None),
        ]
    return write_gguf(tmp_path / name, arch, meta, tensors)


# ----------------------------------------------------------------------------- K-quant encoders
# gguf-py dequantizes K-quants but cannot quantize them; these pack blocks in
# ggml's layout (the inverse of gguf.quants' dequantizers) with simple scales.
def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _affine(x: np.ndarray, qmax: int, scale_max: int) -> tuple[np.ndarray, ...]:
    """Per sub-block (last axis) scale/min codes for x = d*sc*q - dmin*mn, q in [0, qmax]."""
    lo = np.minimum(x.min(-1), 0)
    hi = np.maximum(x.max(-1), lo)
    sub_scale, sub_min = (hi - lo) / qmax, -lo
    d = _f16(sub_scale.max(-1) / scale_max)
    dmin = _f16(sub_min.max(-1) / scale_max)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(_safe_div(sub_scale, df)), 0, scale_max).astype(np.uint8)
    mn = np.clip(np.round(_safe_div(sub_min, dminf)), 0, scale_max).astype(np.uint8)
    eff_scale, eff_min = (df * sc)[..., None], (dminf * mn)[..., None]
    q = np.clip(np.round(_safe_div(x + eff_min, eff_scale)), 0, qmax).astype(np.uint8)
    return d, dmin, sc, mn, q


def _symmetric(x: np.ndarray, qlow: int, qhigh: int, scale_lo: int, scale_hi: int) -> tuple[np.ndarray, ...]:
    """Per sub-block signed scales for x = d*sc*q, q in [qlow, qhigh]."""
    idx = np.abs(x).argmax(-1)
    extreme = np.take_along_axis(x, idx[..., None], -1)[..., 0]
    sub_scale = extreme / qlow  # the extreme value maps to qlow exactly
    d = _f16(np.abs(sub_scale).max(-1) / max(-scale_lo, scale_hi))
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(_safe_div(sub_scale, df)), scale_lo, scale_hi).astype(np.int16)
    q = np.clip(np.round(_safe_div(x, (df * sc)[..., None])), qlow, qhigh).astype(np.int16)
    return d, sc, q


def _pack_bits(values: np.ndarray, groups: int, width: int) -> np.ndarray:
    """[n, groups * L] small ints -> [n, L] bytes: group j at bit offset j*width."""
    n = values.shape[0]
    v = values.reshape(n, groups, -1).astype(np.uint8)
    out = np.zeros((n, v.shape[-1]), dtype=np.uint8)
    for j in range(groups):
        out |= (v[:, j] << (j * width)).astype(np.uint8)
    return out


def _halves(q: np.ndarray, chunk: int, groups: int, width: int) -> np.ndarray:
    """Pack per ``chunk`` of values (q: [n, 256]) with ``_pack_bits``."""
    n = q.shape[0]
    c = q.reshape(n, -1, chunk)
    return np.concatenate([_pack_bits(c[:, i], groups, width) for i in range(c.shape[1])], axis=1)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: eight 6-bit scales and mins in 12 bytes."""
    b = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    b[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    b[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    b[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return b


def _as_bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1).view(np.uint8)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, QK_K // 16, 16)
    d, dmin, sc, mn, q = _affine(blocks, 3, 15)
    return np.concatenate([sc | (mn << 4), _halves(q.reshape(-1, QK_K), 128, 4, 2),
                           _as_bytes(d[:, None]), _as_bytes(dmin[:, None])], axis=1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, QK_K // 16, 16)
    d, sc, q = _symmetric(blocks, -4, 3, -32, 31)
    u = (q + 4).reshape(-1, QK_K).astype(np.uint8)
    v = (sc + 32).astype(np.uint8)  # 6-bit codes
    scales = np.zeros((v.shape[0], 12), dtype=np.uint8)
    scales[:, 0:8] = (v[:, 0:8] & 0x0F) | ((v[:, 8:16] & 0x0F) << 4)
    scales[:, 8:12] = _pack_bits(v >> 4, 4, 2)
    hmask = _pack_bits(u >> 2, 8, 1)
    return np.concatenate([hmask, _halves(u & 3, 128, 4, 2), scales, _as_bytes(d[:, None])], axis=1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 8, 32)
    d, dmin, sc, mn, q = _affine(blocks, 15, 63)
    return np.concatenate([_as_bytes(d[:, None]), _as_bytes(dmin[:, None]), _k_scale_bytes(sc, mn),
                           _halves(q.reshape(-1, QK_K), 64, 2, 4)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 8, 32)
    d, dmin, sc, mn, q = _affine(blocks, 31, 63)
    q = q.reshape(-1, QK_K)
    return np.concatenate([_as_bytes(d[:, None]), _as_bytes(dmin[:, None]), _k_scale_bytes(sc, mn),
                           _pack_bits(q >> 4, 8, 1), _halves(q & 0x0F, 64, 2, 4)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, QK_K // 16, 16)
    d, sc, q = _symmetric(blocks, -32, 31, -128, 127)
    u = (q + 32).reshape(-1, QK_K).astype(np.uint8)
    return np.concatenate([_halves(u & 0x0F, 128, 2, 4), _halves(u >> 4, 128, 4, 2),
                           sc.astype(np.int8).view(np.uint8), _as_bytes(d[:, None])], axis=1)


K_QUANTIZERS = {QT.Q2_K: quantize_q2_k, QT.Q3_K: quantize_q3_k, QT.Q4_K: quantize_q4_k,
                QT.Q5_K: quantize_q5_k, QT.Q6_K: quantize_q6_k}


def quantize(x: np.ndarray, qtype: QT) -> tuple[np.ndarray, Any]:
    """``x`` [rows, cols] stored as ``qtype``: (array for GGUFWriter.add_tensor, raw_dtype)."""
    if qtype == QT.F32:
        return x.astype(np.float32), None
    if qtype == QT.F16:
        return x.astype(np.float16), None
    if qtype in K_QUANTIZERS:
        rows = x.shape[0]
        packed = K_QUANTIZERS[qtype](x.reshape(-1, QK_K))
        assert packed.shape[1] == gguf.GGML_QUANT_SIZES[qtype][1]
        return packed.reshape(rows, -1), qtype
    return gguf.quants.quantize(x, qtype), qtype


# (type, largest relative RMS error against the original values)
TYPES = [
    (QT.F32, 0.0), (QT.F16, 1e-3), (QT.BF16, 5e-3), (QT.Q8_0, 0.01),
    (QT.Q5_0, 0.05), (QT.Q5_1, 0.05), (QT.Q4_0, 0.1), (QT.Q4_1, 0.1),
    (QT.Q6_K, 0.03), (QT.Q5_K, 0.06), (QT.Q4_K, 0.12), (QT.Q3_K, 0.25), (QT.Q2_K, 0.45),
]


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


# ----------------------------------------------------------------------------- dequantization
@pytest.mark.parametrize("qtype,tolerance", TYPES, ids=[t.name for t, _ in TYPES])
def test_each_type_dequantizes_like_gguf_and_close_to_the_original(tmp_path: Path, qtype: QT,
                                                                   tolerance: float) -> None:
    g = np.random.default_rng(1)
    down = g.standard_normal((256, 512), dtype=np.float32)  # blk.0.ffn_down: HF [hidden, ffn]
    k_hf = g.standard_normal((128, 256), dtype=np.float32)  # blk.0.attn_k in HF order
    k_stored = llama_cpp_permute(torch.from_numpy(k_hf), 4, 2).numpy()
    path = write_gguf(tmp_path / "q.gguf", "llama", tiny_metadata(), [
        ("blk.0.ffn_down.weight", *quantize(down, qtype)),
        ("blk.0.attn_k.weight", *quantize(k_stored, qtype)),
    ])

    ref = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
           for t in gguf.GGUFReader(str(path)).tensors}
    assert {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors} == {qtype}
    checkpoint = open_checkpoint(path)
    with checkpoint.reader() as reader:
        infos = {i.name: i for i in reader.tensors()}
        assert infos["model.layers.0.mlp.down_proj.weight"].shape == (256, 512)
        assert infos["model.layers.0.mlp.down_proj.weight"].dtype == qtype.name
        got_down = reader.get("model.layers.0.mlp.down_proj.weight")
        got_k = reader.get("model.layers.0.self_attn.k_proj.weight")

    assert got_down.dtype == torch.float32 and got_down.shape == (256, 512)
    assert torch.equal(got_down, ref["blk.0.ffn_down.weight"].reshape(256, 512))
    # k: gguf's values, un-permuted back to Hugging Face's row order
    unpermuted = ref["blk.0.attn_k.weight"].reshape(2, 32, 2, 256).swapaxes(1, 2).reshape(128, 256)
    assert torch.equal(got_k, unpermuted)
    assert _rel_rms(got_down, torch.from_numpy(down)) <= tolerance
    assert _rel_rms(got_k, torch.from_numpy(k_hf)) <= tolerance


# ----------------------------------------------------------------------------- architectures
VARIANTS = {
    "llama": ("llama", {}),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


def _architecture_fields(config: Any) -> dict[str, Any]:
    fields = config.key_fields()
    fields.pop("checkpoint_dtype")
    return fields


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_models_match_transformers(tmp_path: Path, variant: str) -> None:
    family, overrides = VARIANTS[variant]
    model = build_hf_model(family, **overrides)
    meta, tensors = hf_to_gguf(model, family, tokenizer=False)
    path = write_gguf(tmp_path / f"{variant}.gguf", family, meta, tensors)

    checkpoint = open_checkpoint(path)
    assert isinstance(checkpoint, GGUFCheckpoint)
    ours = config_from_dict(checkpoint.config(), checkpoint.config_source(), checkpoint.generation_config())
    theirs = config_from_dict(model.config.to_dict())
    assert _architecture_fields(ours) == _architecture_fields(theirs)
    assert ours.checkpoint_dtype == torch.float32
    assert ours.eos_token_ids == theirs.eos_token_ids and ours.bos_token_id == theirs.bos_token_id

    expected = {k: v for k, v in model.state_dict().items()
                if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    with checkpoint.reader() as reader:
        infos = reader.tensors()
        assert {i.name for i in infos} == set(expected)
        for info in infos:
            assert info.shape == tuple(expected[info.name].shape), info.name
            assert info.dtype == "F32" and info.file == path
            got = reader.get(info.name)
            assert got.dtype == torch.float32
            assert torch.equal(got, expected[info.name]), info.name


def test_weights_load_into_kilns_model(tmp_path: Path) -> None:
    """The reader feeds DecoderModel.load_weights (q/k/v and gate/up merged there)."""
    from kiln.models import build_model

    model = build_hf_model("qwen2")
    meta, tensors = hf_to_gguf(model, "qwen2", tokenizer=False)
    checkpoint = open_checkpoint(write_gguf(tmp_path / "q.gguf", "qwen2", meta, tensors))
    config = config_from_dict(checkpoint.config(), checkpoint.config_source())
    built = build_model(config, checkpoint, torch.float32, torch.device("cpu"), config.max_position_embeddings)
    params = dict(built.named_parameters())
    state = model.state_dict()
    embed = next(v for k, v in params.items() if k.endswith("embed_tokens.weight"))
    assert torch.equal(embed, state["model.embed_tokens.weight"])


@pytest.mark.parametrize("family,overrides", [("llama", {"attention_bias": True}), ("qwen3", {})],
                         ids=["llama-biases", "qwen3"])
def test_runtime_generates_like_transformers_from_a_gguf(tmp_path: Path, family: str,
                                                         overrides: dict[str, Any]) -> None:
    """Runtime.load of a .gguf: greedy tokens equal transformers' on the model the file was written from."""
    from kiln import SamplingParams

    model = build_hf_model(family, **overrides)
    meta, tensors = hf_to_gguf(model, family)
    path = write_gguf(tmp_path / f"{family}.gguf", family, meta, tensors)
    prompts = random_prompts(2, [5, 17], model.config.vocab_size, seed=1)
    expected = [hf_greedy(model, p, 6) for p in prompts]
    runtime = load_eager(str(path))
    outs = runtime.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def test_llama3_rope_factors_become_rope_scaling(tmp_path: Path) -> None:
    """llama.cpp turns Llama 3.1 RoPE scaling into a rope_freqs tensor; it comes back as rope_scaling."""
    scaling = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model = build_hf_model("llama", rope_parameters=scaling)
    dim, theta = 16, 10000.0
    # the converter's generate_extra_tensors, for these settings
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    assert 1.0 < min(f for f in factors if f != 1.0) < 8.0  # all three branches are exercised
    meta, tensors = hf_to_gguf(model, "llama", tokenizer=False, rope_freqs=torch.tensor(factors))
    checkpoint = open_checkpoint(write_gguf(tmp_path / "l3.gguf", "llama", meta, tensors))
    ours = config_from_dict(checkpoint.config(), checkpoint.config_source())
    theirs = config_from_dict(model.config.to_dict())
    assert ours.rope == theirs.rope and ours.rope.rope_type == "llama3"
    with checkpoint.reader() as reader:
        assert "rope_freqs.weight" not in {i.name for i in reader.tensors()}


def test_rope_scaling_metadata(tmp_path: Path) -> None:
    path = tiny_file(tmp_path, **{"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                  "llama.rope.scaling.original_context_length": 32})
    cfg = open_checkpoint(path).config()
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    rope = config_from_dict(cfg).rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("yarn", 4.0, 32)

    linear = tiny_file(tmp_path, "lin.gguf", **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    assert config_from_dict(open_checkpoint(linear).config()).rope.factor == 2.0
    none = tiny_file(tmp_path, "none.gguf", **{"llama.rope.scaling.type": "none"})
    assert "rope_scaling" not in open_checkpoint(none).config()


def test_config_reads_float32_metadata_as_written(tmp_path: Path) -> None:
    cfg = open_checkpoint(tiny_file(tmp_path)).config()
    assert cfg["rms_norm_eps"] == 1e-5  # stored as float32; read back as the decimal written
    assert cfg["head_dim"] == 64 and cfg["vocab_size"] == 32 and cfg["tie_word_embeddings"] is True


# ----------------------------------------------------------------------------- tokenizer, files, identity
def test_tokenizer_chat_template_and_special_ids(tmp_path: Path) -> None:
    model = build_hf_model("llama")
    meta, tensors = hf_to_gguf(model, "llama")
    meta["general.sampling.temp"] = 0.5
    path = write_gguf(tmp_path / "tok.gguf", "llama", meta, tensors)
    checkpoint = open_checkpoint(path)
    assert checkpoint.chat_template() == CHAT_TEMPLATE
    assert checkpoint.special_token_ids() == {"bos": 1, "eos": 2}
    generation = checkpoint.generation_config()
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1
    assert generation["temperature"] == 0.5
    assert checkpoint.config()["vocab_size"] == model.config.vocab_size  # from the token list

    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    readers = []
    parse = hf_gguf.load_gguf_checkpoint

    def spy(*args: Any, **kwargs: Any) -> Any:
        readers.append(gguf.GGUFReader)
        return parse(*args, **kwargs)

    original = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_gguf, "load_gguf_checkpoint", spy)
        tok = checkpoint.load_tokenizer()
    # transformers parsed the file with kiln's reader (its fast reads), and gguf's is back after
    assert readers and all(r is not original and issubclass(r, original) for r in readers)
    assert gguf.GGUFReader is original
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    text = "the rain in spain"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # merges applied
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_tokenizer_is_kept_and_loaded_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meta, tensors = hf_to_gguf(build_hf_model("llama"), "llama")
    checkpoint = open_checkpoint(write_gguf(tmp_path / "tok.gguf", "llama", meta, tensors))
    built = checkpoint.load_tokenizer(tmp_path / "cache")
    kept = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(kept) == 1 and (kept[0] / "tokenizer_config.json").is_file()
    import transformers

    real = transformers.AutoTokenizer.from_pretrained

    def no_gguf(*args, **kwargs):  # the second load must not convert the file again
        assert "gguf_file" not in kwargs, "the tokenizer was built from the GGUF file again"
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_gguf)
    loaded = open_checkpoint(checkpoint.path).load_tokenizer(tmp_path / "cache")
    text = "<|im_start|>the rain in spain<|im_end|>"
    assert loaded.encode(text) == built.encode(text) and loaded.eos_token_id == built.eos_token_id
    assert type(loaded) is type(built)  # a plain class loads by itself (_load_kept_tokenizer), the same class
    messages = [{"role": "user", "content": "hi"}]
    assert (loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == built.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    # a damaged copy is built again, with a warning
    (kept[0] / "tokenizer_config.json").write_text("{not json")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", real)
    again = open_checkpoint(checkpoint.path).load_tokenizer(tmp_path / "cache")
    assert again.encode(text) == built.encode(text)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_gguf)  # and kept again
    assert open_checkpoint(checkpoint.path).load_tokenizer(tmp_path / "cache").encode(text) == built.encode(text)


def test_files_and_no_tokenizer(tmp_path: Path) -> None:
    path = tiny_file(tmp_path)
    checkpoint = open_checkpoint(path)
    assert checkpoint.metadata_files() == []
    assert checkpoint.weight_files() == [path]
    assert checkpoint.weights_dir == tmp_path
    assert checkpoint.load_tokenizer() is None
    assert checkpoint.config_source() == f"{path} (metadata)"


def test_identity_follows_the_layout_not_the_path(tmp_path: Path) -> None:
    a = tiny_file(tmp_path, "a.gguf")
    (tmp_path / "elsewhere").mkdir()
    b = tiny_file(tmp_path / "elsewhere", "b.gguf")
    assert open_checkpoint(a).identity() == open_checkpoint(b).identity()

    g = np.random.default_rng(5)
    other_values = [(n, g.standard_normal(a.shape, dtype=np.float32), None) for n, a, _ in [
        ("token_embd.weight", np.zeros((32, 256)), None), ("blk.0.attn_q.weight", np.zeros((256, 256)), None),
        ("blk.0.attn_k.weight", np.zeros((128, 256)), None), ("blk.0.ffn_down.weight", np.zeros((256, 512)), None)]]
    same_layout = tiny_file(tmp_path, "c.gguf", tensors=other_values)
    assert open_checkpoint(same_layout).identity() == open_checkpoint(a).identity()  # values never matter

    quantized = [(n, *quantize(v, QT.Q8_0)) for n, v, _ in other_values]
    other_type = tiny_file(tmp_path, "d.gguf", tensors=quantized)
    other_meta = tiny_file(tmp_path, "e.gguf", **{"llama.rope.freq_base": 500000.0})
    idents = [open_checkpoint(p).identity() for p in (a, other_type, other_meta)]
    assert idents[0] != idents[1] and idents[0] != idents[2] and idents[1] != idents[2]
    assert idents[1]["tensor_types"] == {"Q8_0": 4}
    assert str(tmp_path) not in repr(idents)


# ----------------------------------------------------------------------------- errors
def _error(path: Path, *needles: str, action: str = "config") -> str:
    with pytest.raises(CheckpointError) as info:
        checkpoint = open_checkpoint(path)
        if action == "config":
            checkpoint.config()
        else:
            with checkpoint.reader() as reader:
                for t in reader.tensors():
                    reader.get(t.name)
    message = str(info.value)
    assert path.name in message, message
    for needle in needles:
        assert needle in message, message
    return message


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b'{"config": 1}' + bytes(64))
    _error(path, "not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _error(empty, "not a GGUF file")


def test_truncated_in_the_tensor_data(tmp_path: Path) -> None:
    path = tiny_file(tmp_path)
    data = path.read_bytes()
    last = gguf.GGUFReader(str(path)).tensors[-1].name
    path.write_bytes(data[:-1000])
    _error(path, "truncated", repr(last))


def test_truncated_in_the_metadata(tmp_path: Path) -> None:
    path = tiny_file(tmp_path)
    fields = [f for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")]
    data = path.read_bytes()
    path.write_bytes(data[:fields[3].offset + 6])  # cut inside the fourth key/value pair
    _error(path, "truncated", repr(fields[2].name))


def test_truncated_inside_the_token_list(tmp_path: Path) -> None:
    """kiln's reader walks arrays of strings itself (_get_field_parts): a cut
    inside one is named, not read past."""
    meta, tensors = hf_to_gguf(build_hf_model("llama"), "llama")
    path = write_gguf(tmp_path / "tok.gguf", "llama", meta, tensors)
    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    data = path.read_bytes()
    path.write_bytes(data[:field.offset + sum(int(p.nbytes) for p in field.parts) // 2])
    _error(path, "truncated", "past the end of the file")


def test_kilns_reader_gives_the_fields_ggufs_reader_gives(tmp_path: Path) -> None:
    """Strings, integer and float arrays, an empty array and nested arrays
    (gguf's own loop), field by field, part by part: transformers reads the
    file through kiln's reader too (load_tokenizer)."""
    from kiln.checkpoint.gguf import _open_reader

    meta, tensors = hf_to_gguf(build_hf_model("llama"), "llama")
    meta["tokenizer.ggml.scores"] = [float(i) / 7 for i in range(len(meta["tokenizer.ggml.tokens"]))]
    meta["kiln.test.empty"] = []
    meta["kiln.test.nested"] = [[1, 2], [3]]
    meta["kiln.test.unicode"] = ["Ġthé", "日本", ""]
    path = write_gguf(tmp_path / "all.gguf", "llama", meta, tensors)
    theirs, ours = gguf.GGUFReader(str(path)), _open_reader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
        assert [(p.dtype, p.shape, p.tobytes()) for p in mine.parts] == \
            [(p.dtype, p.shape, p.tobytes()) for p in field.parts], name
        assert mine.contents() == field.contents(), name
    assert ours.fields["kiln.test.unicode"].contents() == ["Ġthé", "日本", ""]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]


def test_unknown_architecture(tmp_path: Path) -> None:
    path = tiny_file(tmp_path, arch="gpt2")
    _error(path, "general.architecture", "'gpt2'", "llama, qwen2, qwen3")


def test_unsupported_quantization_type(tmp_path: Path) -> None:
    block, size = gguf.GGML_QUANT_SIZES[QT.IQ2_XXS]
    raw = np.random.default_rng(0).integers(0, 255, (256, 512 // block * size), dtype=np.uint8)
    path = tiny_file(tmp_path, tensors=[("blk.0.ffn_down.weight", raw, QT.IQ2_XXS)])
    _error(path, "'blk.0.ffn_down.weight'", "IQ2_XXS")


def test_unknown_tensor_type_id(tmp_path: Path) -> None:
    path = tiny_file(tmp_path)
    t = gguf.GGUFReader(str(path)).tensors[1]
    n_dims = len(t.shape)
    type_at = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * n_dims
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[type_at:type_at + 4], "little") == int(t.tensor_type)
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    _error(path, repr(t.name), "99")


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length", "llama.attention.head_count",
                                 "llama.attention.layer_norm_rms_epsilon", "general.architecture"])
def test_missing_required_metadata(tmp_path: Path, key: str) -> None:
    path = tiny_file(tmp_path, drop=(key,))
    if key == "general.architecture":  # GGUFWriter always writes it; remove it by renaming the key
        data = path.read_bytes().replace(b"general.architecture", b"general.architectur_")
        path.write_bytes(data)
    _error(path, repr(key), "missing")


def test_tensor_shape_disagrees_with_metadata(tmp_path: Path) -> None:
    g = np.random.default_rng(0)
    path = tiny_file(tmp_path, tensors=[("blk.0.attn_q.weight", g.standard_normal((128, 256), dtype=np.float32),
                                         None)])
    _error(path, "'blk.0.attn_q.weight'", "[128, 256]", "[256, 256]", "llama.attention.head_count")
    vocab = tiny_file(tmp_path, "v.gguf", tensors=[("token_embd.weight", np.zeros((31, 256), np.float32), None)])
    _error(vocab, "'token_embd.weight'", "llama.vocab_size")


def test_structural_errors_name_the_tensor(tmp_path: Path) -> None:
    zeros = np.zeros((256,), np.float32)
    qwen2 = tiny_file(tmp_path, "q.gguf", arch="qwen2", tensors=[("blk.0.attn_norm.weight", zeros, None)])
    _error(qwen2, "'blk.0.attn_q.bias'", "qwen2")
    unknown = tiny_file(tmp_path, "u.gguf", tensors=[("blk.0.attn_qkv.weight", np.zeros((512, 256), np.float32),
                                                      None)])
    _error(unknown, "'blk.0.attn_qkv.weight'")
    beyond = tiny_file(tmp_path, "b.gguf", tensors=[("blk.3.attn_norm.weight", zeros, None)])
    _error(beyond, "'blk.3.attn_norm.weight'", "llama.block_count")


def test_kilns_reader_reads_what_ggufs_own_reader_reads(tmp_path: Path) -> None:
    """The reader's header parsing through a plain array view (``_get``) gives
    gguf's fields and tensor table: values, types, offsets and data."""
    from kiln.checkpoint.gguf import _open_reader

    path = tiny_file(tmp_path, **{"tokenizer.ggml.tokens": [f"t{i}" for i in range(32)],
                                 "tokenizer.ggml.scores": [float(i) / 3 for i in range(32)],
                                 "general.name": "tiny"})
    ours, theirs = _open_reader(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), key
        assert mine.contents() == field.contents(), key
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.tensor_type, list(t.shape), int(t.data_offset), int(t.n_bytes)) for t in ours.tensors] == [
        (t.name, t.tensor_type, list(t.shape), int(t.data_offset), int(t.n_bytes)) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
