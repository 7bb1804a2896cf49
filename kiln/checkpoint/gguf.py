"""GGUF files (llama.cpp's format): one file holding the config as metadata, the
tokenizer, and the weights, often quantized.

The file is parsed once with ``gguf.GGUFReader`` (memory-mapped); the metadata
becomes a Hugging Face style ``config.json`` dict and the tensors get their
Hugging Face names and shapes, so the rest of kiln treats a GGUF like any other
checkpoint. ``get`` dequantizes one tensor to float32 on the CPU and undoes
llama.cpp's rotary permutation of the Q and K projections (its converter
interleaves the two rotary halves of each head for the ``llama`` architecture;
``qwen2`` and ``qwen3`` are stored unpermuted).

Supported tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the
K-quants Q2_K..Q6_K, all dequantized by ``gguf.quants.dequantize`` (numpy,
single-threaded). A torch version of the common types was about 2x faster on one
thread but far slower with threads on a busy machine, so it is not used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.checkpoint.reader import Checkpoint, CheckpointError, CheckpointReader, QuantizedTensor, TensorInfo

__all__ = ["GGUFCheckpoint", "GGUFReader", "ARCHITECTURES", "SUPPORTED_TYPES", "GGUF_MAGIC"]

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

# general.architecture (also the model_type) -> Hugging Face class
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# architectures whose Q/K weights llama.cpp's converter permutes
_PERMUTED_ARCHITECTURES = frozenset({"llama"})

SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# per-block GGUF names -> Hugging Face module path inside model.layers.N
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)")
# llama.cpp's per-dimension RoPE factors (written for Llama 3.1-style scaling)
_ROPE_FREQS = "rope_freqs.weight"

_SAMPLING_KEYS = {  # general.sampling.* -> generation_config.json names
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise CheckpointError("reading GGUF files needs the 'gguf' package (pip install gguf)") from e
    return gguf


# ----------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class _Tensor:
    """One stored tensor, located in the file, with its Hugging Face identity."""

    gguf_name: str
    hf_name: str
    type_name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is the contiguous (innermost) dimension
    hf_shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    permute_heads: int | None  # undo llama.cpp's rotary permutation with this many heads


class _TableError(Exception):
    """Raised inside the reader subclass; turned into a CheckpointError naming the file."""


def _make_reader_class() -> type:
    gguf = _gguf()

    class _CheckedReader(gguf.GGUFReader):  # type: ignore[misc, name-defined]
        """GGUFReader that checks each tensor's type id, row size and extent
        before gguf maps it, so that a bad table names the tensor, and reads
        the header through a plain array view of the mapped file.

        gguf slices its ``np.memmap`` once per value read, and a memmap slice
        costs numpy's memmap bookkeeping each time: the demo file's 49152
        tokens and 48900 merges took 5.8 s to parse, most of a warm start
        (``load_tokenizer`` in the startup report). The same slices of an
        ``ndarray`` view of the map, the same bytes, took a fraction of that
        (``_get``); arrays of strings and numbers are walked in one loop
        (``_flat_array_parts``)."""

        def _plain(self) -> np.ndarray:
            """The mapped file as a plain uint8 array (made once)."""
            plain = self.__dict__.get("_plain_view")
            if plain is None:
                plain = self._plain_view = self.data.view(np.ndarray)
            return plain

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> Any:
            plain = self._plain()
            count = int(count)
            dtype = np.dtype(dtype)
            arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            flat = _flat_array_parts(self, gguf, orig_offs) if raw_type == gguf.GGUFValueType.ARRAY else None
            return flat if flat is not None else super()._get_field_parts(orig_offs, raw_type)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            _check_tensor_table(gguf, fields, int(start_offs), len(self.data))
            super()._build_tensors(start_offs, fields)

    return _CheckedReader


def _check_tensor_table(gguf: Any, fields: list[Any], start_offs: int, size: int) -> None:
    """Each tensor's type id, row size and extent, before gguf maps it
    (``_CheckedReader._build_tensors``): a bad table names the tensor."""
    known = {int(t) for t in gguf.GGMLQuantizationType}
    for field in fields:
        name_data, dims, raw_dtype, offset = (field.parts[i] for i in field.data)
        name = bytes(name_data).decode("utf-8", errors="replace")
        type_id = int(raw_dtype[0])
        if type_id not in known:
            raise _TableError(
                f"tensor {name!r} has tensor type id {type_id}, which is not a GGML type kiln knows; "
                f"supported: {', '.join(SUPPORTED_TYPES)}"
            )
        qtype = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        ne = [int(d) for d in dims]
        if ne and ne[0] % block:
            raise _TableError(
                f"tensor {name!r} ({qtype.name}) has rows of {ne[0]} values, "
                f"not a multiple of the {qtype.name} block size {block}"
            )
        end = start_offs + int(offset[0]) + math.prod(ne) * type_size // block
        if end > size:
            raise _TableError(
                f"the file is truncated: tensor {name!r} needs bytes up to {end}, but the file has {size}"
            )


def _flat_array_parts(reader: Any, gguf: Any, orig_offs: int) -> Any:
    """gguf's parts of the array at ``orig_offs`` when it holds strings or
    scalars (else None: gguf's own loop), walked in one loop where gguf
    recurses once per element (``_CheckedReader._get_field_parts``). The demo
    file's whole parse, its 49152 tokens and types and 48900 merges most of
    it: 0.49-0.52 -> 0.10-0.13 s, a fifth of a warm start before. The same
    parts, data indices and types as gguf's."""
    value = gguf.GGUFValueType
    raw_itype = reader._get(orig_offs, np.uint32)
    alen = reader._get(orig_offs + 4, np.uint64)
    if len(raw_itype) < 1 or len(alen) < 1:
        raise ValueError(f"an array at byte {orig_offs} runs past the end of the file")
    item_type, count = int(raw_itype[0]), int(alen[0])
    scalar = reader.gguf_scalar_to_np.get(item_type)
    if item_type != value.STRING and scalar is None:  # arrays of arrays
        return None
    types = [value.ARRAY] + ([value(item_type)] if count else [])
    offs = orig_offs + 12
    parts: list[Any] = [raw_itype, alen]
    if scalar is not None:
        values = reader._get(offs, scalar, count)
        if len(values) < count:
            raise ValueError(f"an array of {count} values at byte {orig_offs} runs past the end of the file")
        parts += [values[i:i + 1] for i in range(count)]
        return 12 + values.nbytes, parts, list(range(2, 2 + count)), types
    plain = reader._plain()
    lengths = np.dtype(np.uint64).newbyteorder(reader.byte_order)
    data_idxs = []
    for _ in range(count):
        if offs + 8 > len(plain):
            raise ValueError(f"an array of {count} strings at byte {orig_offs} runs past the end of the file")
        slen = plain[offs:offs + 8].view(lengths)
        stop = offs + 8 + int(slen[0])
        if stop > len(plain):
            raise ValueError(f"a string at byte {offs} runs past the end of the file")
        parts += [slen, plain[offs + 8:stop]]
        data_idxs.append(len(parts) - 1)
        offs = stop
    return offs - orig_offs, parts, data_idxs, types


_READER_CLASS: type | None = None


def _reader_class() -> type:
    """kiln's ``_CheckedReader``, made once (it subclasses gguf's, imported late)."""
    global _READER_CLASS
    if _READER_CLASS is None:
        _READER_CLASS = _make_reader_class()
    return _READER_CLASS


def _open_reader(path: Path) -> Any:
    """The parsed GGUFReader, or a CheckpointError naming the file and what is wrong."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as e:
        raise CheckpointError(f"{path} could not be read: {e}") from e
    if head[:4] != GGUF_MAGIC:
        raise CheckpointError(
            f"{path} is not a GGUF file: it does not start with the GGUF magic (found {head[:4]!r})"
        )
    if len(head) < 8:
        raise CheckpointError(f"{path} is truncated: it ends inside the GGUF header ({len(head)} bytes)")
    cls = _reader_class()
    reader = cls.__new__(cls)
    try:
        reader.__init__(str(path))
    except _TableError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        fields = [k for k in getattr(reader, "fields", {}) if not k.startswith("GGUF.")]
        where = (
            f"after metadata key {fields[-1]!r} ({len(fields)} key/value pairs read)" if fields
            else "in the GGUF header"
        )
        raise CheckpointError(f"{path} is truncated or corrupt: reading stopped {where}: {e}") from e
    return reader


def _field_value(field: Any) -> Any:
    """A metadata value as Python: str, int, float, bool, or a list of them.
    float32 values come back as their shortest decimal (1e-05, not 9.99999974e-06)."""
    gguf = _gguf()
    types = field.types
    value = field.contents()
    float32 = gguf.GGUFValueType.FLOAT32
    if types and types[-1] == float32:
        if isinstance(value, list):
            return [float(str(np.float32(v))) for v in value]
        return float(str(np.float32(value)))
    return value


class _Metadata:
    """Typed access to the metadata; every error names the file and the key."""

    def __init__(self, path: Path, fields: dict[str, Any]) -> None:
        self.path = path
        self.fields = fields

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    def has(self, key: str) -> bool:
        return key in self.fields

    def _required(self, key: str, required: bool) -> Any:
        if key not in self.fields:
            if required:
                raise self.error(f"required metadata key {key!r} is missing")
            return None
        return self.fields[key]

    def int(self, key: str, required: bool = True, minimum: int = 1) -> int | None:
        value = self._required(key, required)
        if value is None:
            return None
        if isinstance(value, list):  # some files give a per-layer array; kiln needs one value
            if not value or len(set(value)) != 1:
                raise self.error(f"metadata key {key!r} differs between layers ({value!r}); kiln needs one value")
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(f"metadata key {key!r} must be an integer >= {minimum}, got {value!r}")
        return value

    def float(self, key: str, required: bool = True) -> float | None:
        value = self._required(key, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise self.error(f"metadata key {key!r} must be a number, got {value!r}")
        return float(value)

    def str(self, key: str, required: bool = True) -> str | None:
        value = self._required(key, required)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.error(f"metadata key {key!r} must be a string, got {value!r}")
        return value

    def token_id(self, key: str) -> int | None:
        return self.int(key, required=False, minimum=0)


@dataclass(frozen=True)
class _Layout:
    """Everything kiln needs from a GGUF, extracted once."""

    architecture: str
    config: dict[str, Any]
    generation: dict[str, Any]
    tensors: tuple[_Tensor, ...]
    chat_template: str | None
    special_tokens: dict[str, int]
    has_tokenizer: bool
    identity: dict[str, Any]


def _expected_shapes(cfg: dict[str, Any], arch: str, vocab_key: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF shape of each tensor kind, and the metadata keys it follows from (for errors)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, inter, vocab = cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]
    q, k = heads * d, kv * d
    emb, ff = f"{arch}.embedding_length", f"{arch}.feed_forward_length"
    qk = f"{arch}.attention.head_count x {arch}.attention.key_length"
    kvk = f"{arch}.attention.head_count_kv x {arch}.attention.key_length"
    return {
        "attn_q.weight": ((q, h), f"{qk}, {emb}"),
        "attn_q.bias": ((q,), qk),
        "attn_k.weight": ((k, h), f"{kvk}, {emb}"),
        "attn_k.bias": ((k,), kvk),
        "attn_v.weight": ((k, h), f"{kvk}, {emb}"),
        "attn_v.bias": ((k,), kvk),
        "attn_output.weight": ((h, q), f"{emb}, {qk}"),
        "attn_output.bias": ((h,), emb),
        "attn_q_norm.weight": ((d,), f"{arch}.attention.key_length"),
        "attn_k_norm.weight": ((d,), f"{arch}.attention.key_length"),
        "attn_norm.weight": ((h,), emb),
        "ffn_norm.weight": ((h,), emb),
        "ffn_gate.weight": ((inter, h), f"{ff}, {emb}"),
        "ffn_gate.bias": ((inter,), ff),
        "ffn_up.weight": ((inter, h), f"{ff}, {emb}"),
        "ffn_up.bias": ((inter,), ff),
        "ffn_down.weight": ((h, inter), f"{emb}, {ff}"),
        "ffn_down.bias": ((h,), emb),
        "token_embd.weight": ((vocab, h), f"{vocab_key}, {emb}"),
        "output.weight": ((vocab, h), f"{vocab_key}, {emb}"),
        "output_norm.weight": ((h,), emb),
    }


def _llama3_rope_factors(theta: float, dim: int, factor: float, low: float, high: float,
                         original: int) -> torch.Tensor:
    """The rope_freqs llama.cpp's converter writes for Llama 3.1-style scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _rope_scaling(meta: _Metadata, arch: str) -> dict[str, Any] | None:
    """``rope_scaling`` from ``{arch}.rope.scaling.*`` (or the older ``rope.scale_linear``)."""
    prefix = f"{arch}.rope.scaling"
    kind = meta.str(f"{prefix}.type", required=False)
    factor = meta.float(f"{prefix}.factor", required=False)
    if kind is None:
        linear = meta.float(f"{arch}.rope.scale_linear", required=False)
        if linear is not None and linear != 1.0:
            return {"rope_type": "linear", "factor": linear}
        return None
    if kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = factor
    original = meta.int(f"{prefix}.original_context_length", required=False)
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    if kind == "yarn":
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("attn_factor", "attention_factor")):
            value = meta.float(f"{prefix}.{key}", required=False)
            if value is not None:
                scaling[name] = value
    return scaling


# the tokenizer's big arrays are left to transformers' tokenizer builder
_TOKENIZER_KEYS = frozenset({
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.model",
})
_SPECIAL_TOKENS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
                   ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("pad", "padding_token_id"))


def _read_fields(path: Path, reader: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or (key.startswith("tokenizer.ggml.") and key not in _TOKENIZER_KEYS):
            continue
        try:
            fields[key] = _field_value(field)
        except (ValueError, UnicodeDecodeError, IndexError) as e:
            raise CheckpointError(f"{path}: metadata key {key!r} could not be read: {e}") from e
    return fields


def _architecture(meta: _Metadata) -> str:
    arch = meta.str("general.architecture")
    if arch not in ARCHITECTURES:
        raise meta.error(
            f"metadata key 'general.architecture' is {arch!r}, which kiln does not run; "
            f"supported GGUF architectures: {', '.join(ARCHITECTURES)}"
        )
    return arch  # type: ignore[return-value]


def _attention(meta: _Metadata, arch: str) -> dict[str, Any]:
    """hidden size, head counts and head size, checked against each other."""
    hidden = meta.int(f"{arch}.embedding_length")
    heads = meta.int(f"{arch}.attention.head_count")
    kv_heads = meta.int(f"{arch}.attention.head_count_kv", required=False) or heads
    assert hidden is not None and heads is not None
    if heads % kv_heads:
        raise meta.error(f"metadata key '{arch}.attention.head_count' ({heads}) is not a multiple of "
                         f"'{arch}.attention.head_count_kv' ({kv_heads})")
    head_dim = meta.int(f"{arch}.attention.key_length", required=False)
    if head_dim is None:
        if hidden % heads:
            raise meta.error(f"metadata key '{arch}.embedding_length' ({hidden}) is not a multiple of "
                             f"'{arch}.attention.head_count' ({heads}) and '{arch}.attention.key_length' is missing")
        head_dim = hidden // heads
    value_dim = meta.int(f"{arch}.attention.value_length", required=False)
    if value_dim is not None and value_dim != head_dim:
        raise meta.error(f"metadata key '{arch}.attention.value_length' ({value_dim}) differs from the key "
                         f"length ({head_dim}); kiln needs equal key and value head sizes")
    rope_dim = meta.int(f"{arch}.rope.dimension_count", required=False)
    if rope_dim is not None and rope_dim != head_dim:
        raise meta.error(f"metadata key '{arch}.rope.dimension_count' ({rope_dim}) differs from the head size "
                         f"({head_dim}); partial rotary embeddings are not supported")
    return {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim}


def _vocab(meta: _Metadata, arch: str, reader: Any, tokens: Any) -> tuple[int, str]:
    """The vocabulary size and where it came from: the token list (llama.cpp's
    n_vocab), else ``{arch}.vocab_size``, else the embedding's rows."""
    if tokens is not None:
        return len(tokens.data), "tokenizer.ggml.tokens"
    key = f"{arch}.vocab_size"
    if meta.has(key):
        return meta.int(key), key  # type: ignore[return-value]
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise meta.error(f"the vocabulary size is unknown: no 'tokenizer.ggml.tokens', no '{key}' "
                         "and no 'token_embd.weight' tensor")
    return int(embd.shape[-1]), "token_embd.weight"


def _biases(meta: _Metadata, arch: str, names: set[str]) -> dict[str, Any]:
    if arch == "qwen2":
        if "blk.0.attn_q.bias" not in names:
            raise meta.error("tensor 'blk.0.attn_q.bias' is missing; a qwen2 model has q/k/v biases")
        return {"attention_bias": True}
    out = {"attention_bias": "blk.0.attn_q.bias" in names}
    if arch == "llama":
        out["mlp_bias"] = "blk.0.ffn_up.bias" in names
    return out


def _token_ids(meta: _Metadata) -> dict[str, Any]:
    """bos_token_id, and eos_token_id: EOS plus end-of-turn / end-of-message when named."""
    out: dict[str, Any] = {}
    bos = meta.token_id("tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = bos
    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tid = meta.token_id(f"tokenizer.ggml.{key}")
        if tid is not None and tid not in eos:
            eos.append(tid)
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def _model_config(meta: _Metadata, arch: str, reader: Any, tokens: Any) -> tuple[dict[str, Any], str]:
    """The ``config.json`` dict, and the key the vocabulary size came from."""
    names = {t.name for t in reader.tensors}
    vocab, vocab_key = _vocab(meta, arch, reader, tokens)
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        **_attention(meta, arch),
        "intermediate_size": meta.int(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.int(f"{arch}.block_count"),
        "max_position_embeddings": meta.int(f"{arch}.context_length"),
        "rms_norm_eps": meta.float(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.float(f"{arch}.rope.freq_base", required=False) or 10000.0,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        **_biases(meta, arch, names),
        **_token_ids(meta),
    }
    scaling = _rope_scaling(meta, arch)
    if scaling:
        cfg["rope_scaling"] = scaling
    return cfg, vocab_key


def _generation(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    for key, name in _SAMPLING_KEYS.items():
        value = fields.get(f"general.sampling.{key}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            generation[name] = value
    return generation


def _parse(path: Path) -> _Layout:
    reader = _open_reader(path)
    fields = _read_fields(path, reader)
    meta = _Metadata(path, fields)
    arch = _architecture(meta)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    cfg, vocab_key = _model_config(meta, arch, reader, tokens)
    tensors = _tensor_table(path, reader, arch, cfg, vocab_key)
    rope_freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if rope_freqs is not None:
        _apply_rope_freqs(path, cfg, rope_freqs, _gguf())
    matrix_types = {t.type_name for t in tensors if len(t.ne) == 2}
    if len(matrix_types) == 1 and next(iter(matrix_types)) in _FLOAT_DTYPES:
        cfg["torch_dtype"] = _FLOAT_DTYPES[next(iter(matrix_types))]
    special = {name: tid for name, key in _SPECIAL_TOKENS
               if (tid := meta.token_id(f"tokenizer.ggml.{key}")) is not None}
    chat = fields.get("tokenizer.chat_template")
    return _Layout(
        architecture=arch,
        config=cfg,
        generation=_generation(cfg, fields),
        tensors=tensors,
        chat_template=chat if isinstance(chat, str) else None,
        special_tokens=special,
        has_tokenizer=tokens is not None and "tokenizer.ggml.model" in fields,
        identity=_identity(reader, tensors),
    )


def _tensor_table(path: Path, reader: Any, arch: str, cfg: dict[str, Any], vocab_key: str) -> tuple[_Tensor, ...]:
    """Each tensor's Hugging Face name and shape, checked against the metadata."""
    expected = _expected_shapes(cfg, arch, vocab_key)
    layers = cfg["num_hidden_layers"]
    permuted = arch in _PERMUTED_ARCHITECTURES
    rotary_heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    out = []
    for t in reader.tensors:
        name = t.name
        if name == _ROPE_FREQS:
            continue
        m = _BLOCK_RE.fullmatch(name)
        kind = None
        if m is not None:
            block, kind, suffix = int(m.group(1)), m.group(2), m.group(3)
            if kind not in _BLOCK_NAMES:
                raise CheckpointError(f"{path}: tensor {name!r} has no counterpart in a {arch} model kiln runs")
            if block >= layers:
                raise CheckpointError(f"{path}: tensor {name!r} belongs to block {block}, but metadata key "
                                      f"'{arch}.block_count' is {layers}")
            hf_name = f"model.layers.{block}.{_BLOCK_NAMES[kind]}.{suffix}"
            shape_key = f"{kind}.{suffix}"
        elif name in _GLOBAL_NAMES:
            hf_name, shape_key = _GLOBAL_NAMES[name], name
        else:
            raise CheckpointError(f"{path}: tensor {name!r} has no counterpart in a {arch} model kiln runs")
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} is stored as {type_name}, a quantization kiln cannot dequantize; "
                f"supported: {', '.join(SUPPORTED_TYPES)}"
            )
        ne = tuple(int(d) for d in t.shape)
        hf_shape = tuple(reversed(ne))
        want, keys = expected[shape_key]
        if hf_shape != want:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(hf_shape)} (GGUF dims {list(ne)}), but the metadata "
                f"({keys}) makes it {list(want)}"
            )
        heads = rotary_heads.get(kind) if permuted else None  # type: ignore[arg-type]
        out.append(_Tensor(name, hf_name, type_name, ne, hf_shape, int(t.data_offset), int(t.n_bytes), heads))
    return tuple(out)


def _apply_rope_freqs(path: Path, cfg: dict[str, Any], tensor: Any, gguf: Any) -> None:
    """Recover the Llama 3.1-style ``rope_scaling`` that llama.cpp's converter
    turned into the ``rope_freqs`` tensor; refuse factors that match no such setting."""
    try:
        values = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                           dtype=np.float32)).reshape(-1)
    except (NotImplementedError, ValueError) as e:
        raise CheckpointError(
            f"{path}: tensor {_ROPE_FREQS!r} ({tensor.tensor_type.name}) could not be read: {e}"
        ) from e
    dim = cfg["head_dim"]
    if values.numel() != dim // 2:
        raise CheckpointError(f"{path}: tensor {_ROPE_FREQS!r} has {values.numel()} values; "
                              f"the head size {dim} needs {dim // 2}")
    if torch.all(values == 1):
        return
    factor = float(str(np.float32(values.max().item())))
    original = cfg.get("rope_scaling", {}).get("original_max_position_embeddings", 8192)
    want = _llama3_rope_factors(cfg["rope_theta"], dim, factor, 1.0, 4.0, original)
    if not torch.allclose(values, want, rtol=1e-4, atol=1e-6):
        raise CheckpointError(
            f"{path}: tensor {_ROPE_FREQS!r} holds per-dimension RoPE factors that match no Llama 3 RoPE "
            f"scaling (factor {factor}, low/high frequency factors 1/4, original context {original}); "
            "kiln cannot run it"
        )
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": original}


def _identity(reader: Any, tensors: tuple[_Tensor, ...]) -> dict[str, Any]:
    """What the file's layout is, independent of its path: tensor names, shapes
    and types, and a hash of the metadata bytes."""
    table = hashlib.sha256()
    for t in tensors:
        table.update(f"{t.gguf_name}:{','.join(map(str, t.ne))}:{t.type_name};".encode())
    kv = [f for k, f in reader.fields.items() if not k.startswith("GGUF.")]
    meta = hashlib.sha256()
    if kv:
        start = kv[0].offset
        end = reader.tensors[0].field.offset if reader.tensors else reader.data_offset
        meta.update(memoryview(reader.data[start:end]))
    return {
        "format": "gguf",
        "tensor_types": dict(sorted(Counter(t.type_name for t in tensors).items())),
        "tensors_sha256": table.hexdigest(),
        "metadata_sha256": meta.hexdigest(),
    }


# ----------------------------------------------------------------------------- dequantization
def dequantize(raw: np.ndarray, type_name: str, ne: tuple[int, ...]) -> torch.Tensor:
    """Bytes of one tensor (``raw``: uint8, as stored) -> float32 torch tensor of
    shape ``reversed(ne)`` (numpy/torch order): Q8_0, Q4_0 and Q4_1 in torch
    (``_dequantize_blocks``), the other block types by ``gguf.quants.dequantize``."""
    gguf = _gguf()
    shape = tuple(reversed(ne))
    if type_name == "F32":
        return torch.from_numpy(raw.view(np.float32).copy()).reshape(shape)
    if type_name == "F16":
        return torch.from_numpy(raw.view(np.float16).astype(np.float32)).reshape(shape)
    if type_name in PACKED_TYPES and ne[0] % 32 == 0:
        return _dequantize_blocks(raw, type_name, ne).reshape(shape)
    qtype = gguf.GGMLQuantizationType[type_name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, ne[0] // block * type_size)
    values = gguf.quants.dequantize(rows, qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


# Block formats handed over packed (``GGUFReader.get_quantized``): bytes per block of
# 32 elements, and whether the block stores an offset ``m`` after its scale ``d``.
PACKED_TYPES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _dequantize_blocks(raw: np.ndarray, type_name: str, ne: tuple[int, ...]) -> torch.Tensor:
    """Q8_0, Q4_0 or Q4_1 bytes -> float32 values, rows in file order, from
    their blocks as ``split_blocks`` reads them: gguf's arithmetic (``d * q``,
    ``d * (q - 8)``, ``d * q + m``, each step rounded to float32), the same
    bits, as whole-tensor ops. The demo file's tensors (210 Q4_1) by gguf's
    numpy loop over groups of rows: 0.62-0.71 s; this way 0.31-0.35 s (three
    rounds taking turns, 2026-12-07, a busy hour)."""
    q = split_blocks(raw, type_name, ne)
    rows, k = q.values.shape
    values = q.values.reshape(rows, k // 32, 32).float()
    d = q.scales.unsqueeze(-1)
    if type_name == "Q8_0":
        out = values * d
    elif type_name == "Q4_0":
        out = d * (values - 8)
    else:
        out = d * values + q.offsets.unsqueeze(-1)
    return out.reshape(rows, k)


def split_blocks(raw: np.ndarray, type_name: str, ne: tuple[int, ...]) -> QuantizedTensor:
    """Bytes of a Q8_0, Q4_0 or Q4_1 tensor -> its integers and per-block fp16
    scales (as float32), rows in file order. Q8_0 blocks are ``d, qs[32]``
    (element ``d * qs[j]``); Q4_0 ``d, qs[16]`` (element ``j`` is the low nibble of
    ``qs[j]``, element ``j + 16`` the high one, value ``d * (q - 8)``); Q4_1 ``d, m,
    qs[16]`` (value ``d * q + m``)."""
    size = PACKED_TYPES[type_name]
    rows, k = (math.prod(ne[1:]) if len(ne) > 1 else 1), ne[0]
    if k % 32:
        raise ValueError(f"row length {k} is not a multiple of the 32-element block")
    blocks = raw.reshape(rows * (k // 32), size)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, k // 32)
    if type_name == "Q8_0":
        values = torch.from_numpy(blocks[:, 2:].copy().view(np.int8).reshape(rows, k))
        return QuantizedTensor(values, torch.from_numpy(d), None, 8, type_name)
    start = 2 if type_name == "Q4_0" else 4
    qs = blocks[:, start:start + 16]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(rows, k)
    if type_name == "Q4_0":
        m = -8.0 * d
    else:
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, k // 32)
    return QuantizedTensor(torch.from_numpy(nibbles), torch.from_numpy(d), torch.from_numpy(m), 4, type_name)


def unpermute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's ``permute``: it reshapes rows to (n_head, 2, head_dim/2)
    and swaps the last two, interleaving each head's rotary halves."""
    shape = weight.shape
    return (weight.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:])
            .swapaxes(1, 2).reshape(shape).contiguous())


# ----------------------------------------------------------------------------- reader / checkpoint
class GGUFReader(CheckpointReader):
    """Tensors of a GGUF file by Hugging Face name: ``get`` dequantizes one tensor
    from the memory map to float32, undoing the rotary permutation."""

    def __init__(self, path: Path, tensors: tuple[_Tensor, ...]) -> None:
        self.path = path
        self._tensors = {t.hf_name: t for t in tensors}
        self._order = tensors
        try:
            # copy-on-write: the arrays are writable (torch.from_numpy takes them without a
            # warning), and nothing is ever written back to the file
            self._map: np.memmap | None = np.memmap(path, mode="c")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path} could not be mapped: {e}") from e

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(t.hf_name, t.hf_shape, t.type_name, self.path) for t in self._order]

    def get(self, name: str) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            raise CheckpointError(f"tensor {name!r} is not in {self.path}")
        raw = self._raw(t)
        try:
            value = dequantize(np.asarray(raw), t.type_name, t.ne)
        except Exception as e:  # gguf/numpy raise assorted types on malformed data
            raise CheckpointError(f"{self.path}: tensor {t.gguf_name!r} ({t.type_name}) could not be "
                                  f"dequantized: {e}") from e
        value = value.reshape(t.hf_shape)
        if t.permute_heads is not None:
            value = unpermute_rotary(value, t.permute_heads)
        return value

    def get_quantized(self, name: str) -> QuantizedTensor | None:
        """A Q8_0, Q4_0 or Q4_1 tensor's blocks, rows unpermuted as ``get``
        does; None for other types."""
        t = self._tensors.get(name)
        if t is None or t.type_name not in PACKED_TYPES or len(t.hf_shape) != 2:
            return None
        raw = self._raw(t)
        try:
            q = split_blocks(np.asarray(raw), t.type_name, t.ne)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: tensor {t.gguf_name!r} ({t.type_name}): {e}") from e
        if t.permute_heads is None:
            return q
        rows = [unpermute_rotary(x, t.permute_heads) if x is not None else None
                for x in (q.values, q.scales, q.offsets)]
        return QuantizedTensor(rows[0], rows[1], rows[2], q.bits, q.source)

    def _raw(self, t: _Tensor) -> np.ndarray:
        if self._map is None:
            raise CheckpointError(f"{self.path}: reader is closed (reading tensor {t.gguf_name!r})")
        raw = self._map[t.offset:t.offset + t.nbytes]
        if raw.size != t.nbytes:
            raise CheckpointError(f"{self.path} is truncated: tensor {t.gguf_name!r} ends past the end of the file")
        return raw

    def close(self) -> None:
        self._map = None


_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def _checked_reader_for_transformers() -> Iterator[None]:
    """``gguf.GGUFReader`` as kiln's ``_CheckedReader`` (``_make_reader_class``)
    while transformers parses the file to build its tokenizer: it reads the
    metadata through gguf's reader, whose memmap slices took 3.8 of the demo
    file's 6.1 s tokenizer build (cProfile, 2026-12-07). The subclass reads
    the same bytes through an array view and checks the tensor table, which
    kiln's own parse of the file has passed already."""
    gguf = _gguf()
    checked = _reader_class()
    with _SWAP_LOCK:  # two threads building tokenizers would otherwise restore each other's swap
        saved = gguf.GGUFReader
        gguf.GGUFReader = checked
        try:
            yield
        finally:
            gguf.GGUFReader = saved



# transformers' tokenizer classes with no model-specific behaviour, which a kept
# tokenizer built from GGUF metadata is saved as (transformers 5: TokenizersBackend)
_PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _load_kept_tokenizer(saved: Path) -> Any:
    """The tokenizer kept at ``saved`` (``_keep_tokenizer``). One saved as a
    plain class is loaded by that class: ``AutoTokenizer``'s import of its
    model registry took 0.25 s of the demo file's 0.87 s ``load_tokenizer``
    on a warm start (2026-12-07); any other class goes through it."""
    import transformers

    name = json.loads((saved / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    cls = getattr(transformers, name, None) if name in _PLAIN_TOKENIZER_CLASSES else None
    if cls is None:
        from transformers import AutoTokenizer as cls
    return cls.from_pretrained(str(saved), local_files_only=True)


def _keep_tokenizer(tok: Any, target: Path) -> None:
    """Save ``tok`` at ``target``, written beside it and renamed into place so
    that a concurrent reader never sees half of it; where that fails nothing is
    kept (logged at debug level) and the next start builds it again."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            tok.save_pretrained(str(scratch))
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - a read-only cache, another process's copy renamed in first,
        # or a tokenizer transformers cannot save: the load goes on, nothing kept
        logger.debug("the tokenizer was not kept in %s: %s", target, e)


class GGUFCheckpoint(Checkpoint):
    """A single ``.gguf`` file: config, tokenizer and weights together."""

    format = "gguf"

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise CheckpointError(f"model path {path} is not a file")
        self.path = path
        self._layout: _Layout | None = None  # parsed on first use; the magic is checked now
        try:
            with open(path, "rb") as fh:
                head = fh.read(4)
        except OSError as e:
            raise CheckpointError(f"{path} could not be read: {e}") from e
        if head != GGUF_MAGIC:
            raise CheckpointError(f"{path} is not a GGUF file: it does not start with the GGUF magic "
                                  f"(found {head!r})")

    def _parsed(self) -> _Layout:
        if self._layout is None:
            self._layout = _parse(self.path)
        return self._layout

    def config(self) -> dict[str, Any]:
        return dict(self._parsed().config)

    def config_source(self) -> str:
        return f"{self.path} (metadata)"

    def generation_config(self) -> dict[str, Any]:
        return dict(self._parsed().generation)

    def reader(self) -> GGUFReader:
        return GGUFReader(self.path, self._parsed().tensors)

    def chat_template(self) -> str | None:
        """``tokenizer.chat_template`` from the metadata, if any."""
        return self._parsed().chat_template

    def special_token_ids(self) -> dict[str, int]:
        """bos / eos / eot / eom / unk / pad ids the metadata names."""
        return dict(self._parsed().special_tokens)

    def load_tokenizer(self, cache_dir: Path | None = None) -> Any:
        """transformers' tokenizer built from the metadata. Building it takes
        seconds (the demo file: 5.6 s, most of a warm start), loading it saved
        0.4 s: with ``cache_dir`` it is kept there once built, under a hash of
        the file's metadata and transformers' version, and loaded from there
        next time."""
        layout = self._parsed()
        if not layout.has_tokenizer:
            return None
        import transformers

        key = hashlib.sha256(f"{layout.identity['metadata_sha256']}:{transformers.__version__}".encode())
        saved = cache_dir / "tokenizers" / key.hexdigest()[:24] if cache_dir is not None else None
        if saved is not None and (saved / "tokenizer_config.json").is_file():
            try:
                return _load_kept_tokenizer(saved)
            except Exception as e:  # noqa: BLE001 - a damaged copy: build it again
                logger.warning("the tokenizer kept in %s did not load (%s); building it from %s again",
                               saved, e, self.path)
                shutil.rmtree(saved, ignore_errors=True)
        from transformers import AutoTokenizer

        try:
            with _checked_reader_for_transformers():
                tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                    local_files_only=True)
        except Exception as e:  # transformers raises many types here
            raise CheckpointError(f"{self.path}: the tokenizer could not be built from the GGUF metadata: "
                                  f"{e}") from e
        if layout.chat_template and not getattr(tok, "chat_template", None):
            tok.chat_template = layout.chat_template
        if saved is not None:
            _keep_tokenizer(tok, saved)
        return tok

    def metadata_files(self) -> list[Path]:
        return []

    def weight_files(self) -> list[Path]:
        return [self.path]

    @property
    def weights_dir(self) -> Path:
        return self.path.parent

    @property
    def weights_source(self) -> Path:
        return self.path

    def identity(self) -> dict[str, Any]:
        return dict(self._parsed().identity)
