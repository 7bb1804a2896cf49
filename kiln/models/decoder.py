"""The Llama-family decoder: Llama, Mistral, Qwen2 and Qwen3.

One file, read top to bottom: attention, MLP, a decoder layer, the model. The
differences between the families are config fields (QKV bias, q/k RMSNorm,
head_dim, tied embeddings, RoPE scaling, sliding windows) that each
architecture's module sets when it parses its config.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from kiln.attention.op import attend
from kiln.checkpoint import CheckpointError, CheckpointReader, QuantizedTensor, TensorInfo
from kiln.models.config import ModelConfig
from kiln.models.interface import CausalLM
from kiln.models.layers import MergedLinear, RMSNorm, RotaryEmbedding
from kiln.models.quant import FORMATS, ROUNDED_SUFFIX, QuantFormat, QuantizedLinear, quantize_int8

__all__ = ["DecoderModel"]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = torch.empty_like(q)
        attend(q, k, v, out, self.layer_idx, self.scale, self.sliding_window)
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary)
        return h + self.mlp(self.post_attention_layernorm(h))


# checkpoint projection -> (merged parameter, index of its rows)
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_LAYER_RE = re.compile(r"^(layers\.\d+\.(?:self_attn|mlp)\.)(\w+)\.(weight|bias)$")
_PREFIX = "model."


class DecoderModel(CausalLM):
    """The causal LM. Parameter names follow the checkpoint's, minus the
    ``model.`` prefix, with q/k/v and gate/up merged (see ``MergedLinear``).
    ``max_len`` is how many positions the RoPE tables cover."""

    def __init__(self, config: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.config = config
        # Given its (uninitialised) weight, the embedding skips its random init: on
        # the meta device that init goes through torch._refs, which imports Dynamo
        # (1.8 s of an eager start).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.rotary = RotaryEmbedding(config, max_len)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # A packed LM head (``quantize``); the embedding lookup keeps the dense matrix
        # even when tied, as it reads only the rows of this step's tokens.
        self.packed_head: QuantizedLinear | None = None
        self.quantization: str | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, positions, self.rotary)
        return self.norm(h)

    def logits_weight(self) -> torch.Tensor:
        if self.packed_head is not None:
            raise RuntimeError("the LM head is packed: use logits_inputs()")
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _head_source(self) -> str:
        """The parameter the LM head reads: the embedding's when tied."""
        return "embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"

    def logits_inputs(self) -> tuple[list[torch.Tensor], QuantFormat | None]:
        if self.packed_head is not None:
            return self.packed_head.packed(), self.packed_head.fmt
        return [self.logits_weight()], None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self.packed_head(hidden)
        return F.linear(hidden, self.logits_weight())

    # ------------------------------------------------------------- quantization
    def quantize(self, mode: str, tensors: list[TensorInfo]) -> dict[str, str]:
        """Replace linear layers (and the LM head) by packed ones, on the meta
        device before materialising: every one for ``"int8"``; for ``"gguf"``
        those whose checkpoint tensors are all Q8_0, or all Q4_0/Q4_1 (others
        stay dense, dequantized at load); the ``-a8`` modes as these, their
        inputs rounded to int8. Returns module name -> format."""
        types = {self._destination(t.name): t.dtype for t in tensors}
        plan: dict[str, str] = {}
        for name, module in list(self.named_modules()):
            if not isinstance(module, nn.Linear) or name == "lm_head":
                continue
            parts = range(len(module.output_sizes)) if isinstance(module, MergedLinear) else [None]
            fmt = _plan_format(mode, [types.get((f"{name}.weight", i)) for i in parts], module.in_features)
            if fmt is None:
                continue
            sizes = module.output_sizes if isinstance(module, MergedLinear) else [module.out_features]
            parent, child = name.rsplit(".", 1)
            setattr(self.get_submodule(parent), child,
                    QuantizedLinear(module.in_features, sizes, module.bias is not None, fmt))
            plan[name] = fmt.name
        fmt = _plan_format(mode, [types.get((self._head_source(), None))], self.config.hidden_size)
        if fmt is not None:
            self.packed_head = QuantizedLinear(self.config.hidden_size, [self.config.vocab_size], False, fmt)
            self.lm_head = None  # untied: the packed copy replaces it; tied: the embedding stays
            plan["lm_head"] = fmt.name
        self.quantization = mode
        return plan

    def reset_buffers(self) -> None:
        self.rotary.reset_cache()

    # ------------------------------------------------------------------ weights
    @staticmethod
    def _destination(name: str) -> tuple[str, int | None]:
        """Checkpoint tensor name -> (kiln parameter, row block of a merged one)."""
        name = name.removeprefix(_PREFIX)
        m = _LAYER_RE.match(name)
        if m and m.group(2) in _STACKED:
            merged, index = _STACKED[m.group(2)]
            return f"{m.group(1)}{merged}.{m.group(3)}", index
        return name, None

    def load_weights(self, reader: CheckpointReader, *, read: bool = True) -> None:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        packed = {f"{n}.weight": m for n, m in modules.items() if isinstance(m, QuantizedLinear)}
        expected = {(p, i) for p in [*params, *packed] for i in self._row_blocks(p, modules)}
        loaded: set[tuple[str, int | None]] = set()
        for info in reader.tensors():
            if info.name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store the shared matrix twice
            pname, index = self._destination(info.name)
            if self.packed_head is not None and pname == self._head_source():
                self._load_packed(reader, info, self.packed_head, None, read)
                loaded.add(("packed_head.weight", None))
                if not self.config.tie_word_embeddings:
                    continue
            if pname in packed:
                self._load_packed(reader, info, packed[pname], index, read)
                loaded.add((pname, index))
                continue
            if pname not in params:
                if info.name.endswith((".weight", ".bias")):
                    # A parameter the config does not account for (a bias, say): running
                    # without it would silently give wrong outputs.
                    raise CheckpointError(
                        f"{info.file}: tensor {info.name!r} has no place in a {self.config.architecture} "
                        "built from the checkpoint's config; the config and the weights disagree"
                    )
                continue
            dest = params[pname].data
            if index is not None:
                dest = modules[pname.rsplit(".", 1)[0]].shard(dest, index)  # type: ignore[operator]
            if tuple(info.shape) != tuple(dest.shape):
                raise CheckpointError(
                    f"{info.file}: tensor {info.name!r} has shape {tuple(info.shape)}, "
                    f"expected {tuple(dest.shape)} from the checkpoint's config"
                )
            if read:
                with torch.no_grad():
                    reader.read_into(info.name, dest)
            loaded.add((pname, index))
        missing = sorted(expected - loaded, key=str)
        if missing:
            raise CheckpointError(self._missing_message(missing, reader))

    def _load_packed(self, reader: CheckpointReader, info: TensorInfo, layer: QuantizedLinear,
                     index: int | None, read: bool) -> None:
        """Checkpoint tensor ``info`` into packed layer ``layer``: as stored
        (``gguf``) or quantized here (``int8``)."""
        where = f"{info.file}: tensor {info.name!r}"
        rows = layer.output_sizes[index] if index is not None else layer.out_features
        if tuple(info.shape) != (rows, layer.in_features):
            raise CheckpointError(f"{where} has shape {tuple(info.shape)}, "
                                  f"expected {(rows, layer.in_features)} from the checkpoint's config")
        if not read:
            return
        q: QuantizedTensor | None
        per_row = self.quantization is not None and self.quantization.removesuffix(ROUNDED_SUFFIX) == "int8"
        q = quantize_int8(reader.get(info.name)) if per_row else reader.get_quantized(info.name)
        if q is None:
            raise CheckpointError(f"{where} ({info.dtype}) cannot be read packed for quantization="
                                  f"{self.quantization!r}")
        layer.load(index, q, where)

    @staticmethod
    def _row_blocks(pname: str, modules: dict[str, nn.Module]) -> list[int | None]:
        owner = modules[pname.rsplit(".", 1)[0]]
        if isinstance(owner, (MergedLinear, QuantizedLinear)) and len(owner.output_sizes) > 1:
            return list(range(len(owner.output_sizes)))
        return [None]

    def _missing_message(self, missing: list[tuple[str, int | None]], reader: CheckpointReader) -> str:
        by_index = {v: k for k, v in _STACKED.items()}
        names = []
        head = self._head_source()
        missing = sorted({(head if p == "packed_head.weight" else p, i) for p, i in missing}, key=str)
        for pname, index in missing[:8]:
            if index is not None:
                merged = pname.split(".")[-2]
                pname = pname.replace(f".{merged}.", f".{by_index[(merged, index)]}.")
            names.append(repr(pname if pname.startswith("lm_head") else _PREFIX + pname))
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        files = sorted({i.file.name for i in reader.tensors()})
        return f"tensor {', '.join(names)}{more} missing from the checkpoint ({', '.join(files)})"


_GGUF_PACKED = {"Q8_0": "q8_0", "Q4_0": "q4", "Q4_1": "q4"}


def _plan_format(mode: str, stored: list[str | None], in_features: int) -> QuantFormat | None:
    """The packed format of a layer whose checkpoint tensors are stored as
    ``stored``, or None to keep it dense (``-a8`` modes: its rounded form)."""
    if mode.removesuffix(ROUNDED_SUFFIX) == "int8":
        fmt = FORMATS["int8"]
    else:
        names = {_GGUF_PACKED.get(t or "") for t in stored}
        if len(names) != 1 or None in names:
            return None
        fmt = FORMATS[names.pop()]  # type: ignore[index]
    if mode.endswith(ROUNDED_SUFFIX):
        fmt = fmt.rounded()
    return fmt if in_features % fmt.k_multiple() == 0 else None
