"""The benchmark checkpoints and prompts.

Benchmarks run on the shapes of real models with random weights, so that they
need no download: each shape is built once with transformers, offline, into
``<kiln cache>/bench-models/`` (:func:`ensure_shape_model`), and checked to read
back in kiln as the intended architecture. Prompts are random token ids with a
fixed seed (:func:`make_prompt`).

A real model runs too: :func:`resolve_model_arg` takes a checkpoint directory, a
``.gguf`` file, ``demo`` (SmolLM2-135M-Instruct, Q4_1 GGUF, after ``kiln
fetch-demo``) or ``random-demo``; :func:`chat_prompts` renders a fixed list of
English prompts through the model's own tokenizer and chat template.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.models import ModelConfig

logger = logging.getLogger("bench.models")

DEFAULT_MODEL_NAME = "smollm2-135m-shape"
MODEL_SEED = 0

# The shape of HuggingFaceTB/SmolLM2-135M, with random weights: no download needed.
SMOLLM2_135M_SHAPE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 0,
}
# The shape of Qwen/Qwen3-0.6B (its config.json), with random weights.
QWEN3_0_6B_SHAPE: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "initializer_range": 0.02,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# Qwen3's architecture at a toy size: for smoke tests of the benchmarks, not for numbers.
QWEN3_TINY_SHAPE: dict[str, Any] = {
    **QWEN3_0_6B_SHAPE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A benchmark model: a transformers config, built with random weights."""

    dir_name: str  # under <kiln cache>/bench-models
    config_class: str
    model_class: str
    config: dict[str, Any]
    dtype: str  # the checkpoint's dtype, and the benchmark's default
    note: str

    def describe_width(self) -> str:
        """The layer width in a few words (for reports that vary the depth)."""
        c = self.config
        return (f"{self.note} (hidden {c['hidden_size']}, {c['num_attention_heads']}/{c['num_key_value_heads']} "
                f"heads, intermediate {c['intermediate_size']}, vocab {c['vocab_size']})")


SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape(DEFAULT_MODEL_NAME, "LlamaConfig", "LlamaForCausalLM", SMOLLM2_135M_SHAPE,
                               "float32", "the shape of HuggingFaceTB/SmolLM2-135M"),
    "qwen3-0.6b": ModelShape("qwen3-0.6b-shape", "Qwen3Config", "Qwen3ForCausalLM", QWEN3_0_6B_SHAPE,
                             "bfloat16", "the shape of Qwen/Qwen3-0.6B"),
    "qwen3-tiny": ModelShape("qwen3-tiny-shape", "Qwen3Config", "Qwen3ForCausalLM", QWEN3_TINY_SHAPE,
                             "bfloat16", "Qwen3's architecture at a toy size (smoke tests only)"),
}
DEFAULT_SHAPE = "smollm2-135m"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the directory of the SmolLM2-135M-shaped checkpoint, building it first
    if it is not there yet (see :func:`ensure_shape_model`)."""
    return ensure_shape_model(DEFAULT_SHAPE, cache_dir)


def ensure_shape_model(shape_name: str, cache_dir: Path | None = None) -> Path:
    """Return the directory of the checkpoint of ``SHAPES[shape_name]``, building
    it first if it is not there yet.

    It lives in ``<kiln cache>/bench-models/<dir_name>``. It is built in a
    temporary sibling directory and moved into place with ``os.replace``, so a
    half-built model is never found there.
    """
    shape = SHAPES[shape_name]
    if cache_dir is None:
        from kiln.config import default_cache_dir

        cache_dir = default_cache_dir()
    target = Path(cache_dir) / "bench-models" / shape.dir_name
    if target.exists():
        if not (target / "config.json").is_file() or not any(target.glob("*.safetensors")):
            raise RuntimeError(f"{target} exists but holds no complete checkpoint; remove it and run again")
        logger.info("reusing the benchmark model in %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape.dir_name}.tmp-", dir=target.parent))
    try:
        logger.info("building the benchmark model %s (random weights, seed %d) in %s",
                    shape_name, MODEL_SEED, target)
        t0 = time.perf_counter()
        save_random_checkpoint(shape, tmp)
        verify_shape(shape, tmp)
        _publish_dir(tmp, target)
        logger.info("built %s in %.1fs", shape.dir_name, time.perf_counter() - t0)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish_dir(tmp: Path, target: Path) -> None:
    """Move the finished ``tmp`` to ``target``, with the permissions of a directory
    made under the current umask (``mkdtemp`` made it private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        os.replace(tmp, target)
    except OSError:
        # Another process finished first: keep its copy.
        if not (target / "config.json").is_file():
            raise


def save_random_checkpoint(shape: ModelShape, path: Path, **overrides: Any) -> None:
    """Save ``shape`` (its config updated with ``overrides``, e.g. another
    ``num_hidden_layers``) with random weights to ``path``. The weights are drawn
    in fp32 after ``torch.manual_seed(MODEL_SEED)``, then cast to the shape's
    dtype, so that the draws are the same whatever the checkpoint's dtype."""
    import transformers

    config_cls = getattr(transformers, shape.config_class)
    model_cls = getattr(transformers, shape.model_class)
    torch.manual_seed(MODEL_SEED)
    config = config_cls(**{**shape.config, **overrides}, dtype=shape.dtype)
    config.architectures = [shape.model_class]
    model = model_cls(config).to(torch.float32).eval()
    model.to(getattr(torch, shape.dtype)).save_pretrained(path, safe_serialization=True)


def read_model_config(path: Path) -> ModelConfig:
    """The checkpoint's ``config.json`` as kiln reads it."""
    from kiln.models import config_from_dict

    config_file = Path(path) / "config.json"
    return config_from_dict(json.loads(config_file.read_text()), str(config_file))


def verify_shape(shape: ModelShape, path: Path) -> None:
    """Check that the checkpoint in ``path``, as kiln reads it, has ``shape``'s
    architecture: transformers versions spell some config fields differently
    (RoPE's), and a silently dropped field would benchmark another model."""
    mc = read_model_config(path)
    c = shape.config
    expected = {
        "architecture": shape.model_class,
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_layers": c["num_hidden_layers"],
        "num_heads": c["num_attention_heads"],
        "num_kv_heads": c["num_key_value_heads"],
        "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        "max_position_embeddings": c["max_position_embeddings"],
        "tie_word_embeddings": c["tie_word_embeddings"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "qk_norm": shape.model_class == "Qwen3ForCausalLM",
        "sliding_windows": (0,) * c["num_hidden_layers"],
    }
    got = {k: getattr(mc, k) for k in expected if hasattr(mc, k)}
    got["rope_theta"] = mc.rope.theta
    wrong = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
    if wrong:
        raise RuntimeError(f"the built {shape.dir_name} checkpoint does not have the intended shape "
                           f"(field: (built, intended)): {wrong}")


def resolve_model_arg(text: str) -> Path:
    """A ``--model`` argument as a path: ``demo`` (the chat demo GGUF, which must
    have been fetched: ``kiln fetch-demo``), ``random-demo`` (built once when
    missing), or a checkpoint directory or ``.gguf`` file. Raises kiln's
    ``CheckpointError`` (a ``ValueError``) naming the problem."""
    from kiln.checkpoint.names import resolve_model_name
    from kiln.config import default_cache_dir

    path = resolve_model_name(text, default_cache_dir())
    if not path.exists():
        from kiln.checkpoint import CheckpointError

        raise CheckpointError(f"model {text!r}: {path} does not exist")
    return path


def describe_model(path: Path, name: str) -> dict[str, Any]:
    """The model's shape as kiln reads it from its config (``config.json``, or a
    GGUF's metadata); for a GGUF its tensor types too."""
    from kiln.checkpoint import open_checkpoint
    from kiln.models.registry import parse_model_config

    checkpoint = open_checkpoint(Path(path))
    mc = parse_model_config(checkpoint)
    extra = {}
    if checkpoint.format == "gguf":
        extra = {"tensor_types": checkpoint.identity().get("tensor_types")}
    return {
        "name": name,
        "architecture": mc.architecture,
        "vocab_size": mc.vocab_size,
        "hidden_size": mc.hidden_size,
        "intermediate_size": mc.intermediate_size,
        "num_layers": mc.num_layers,
        "num_attention_heads": mc.num_heads,
        "num_kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
        "max_position_embeddings": mc.max_position_embeddings,
        "tie_word_embeddings": mc.tie_word_embeddings,
        "rope_theta": mc.rope.theta,
        "rms_norm_eps": mc.rms_norm_eps,
        "qk_norm": mc.qk_norm,
        "checkpoint_dtype": str(mc.checkpoint_dtype).removeprefix("torch.") if mc.checkpoint_dtype else None,
        "format": checkpoint.format,
        **extra,
    }


def make_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """``length`` token ids drawn uniformly from the vocabulary with a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


# Real prompts (:func:`chat_prompts`): questions, instructions and story openings.
CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France, and what is it famous for?",
    "Write a short story about a robot who learns to paint.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for sleeping better.",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker. "
    "Continue the story.",
    "How do I make a simple tomato sauce for pasta?",
    "What are the main differences between a comet and an asteroid?",
    "Write a haiku about autumn rain.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Why is the sky blue?",
    "Suggest a name for a coffee shop run by cats, and explain your choice.",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Describe the water cycle step by step.",
    "Write a polite email asking my landlord to fix a leaking tap.",
    "It was a dark and stormy night when the lighthouse keeper heard a knock at the door. What happened next?",
    "What are some good habits for learning a new language?",
)


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer as kiln builds it (for a GGUF: transformers'
    ``gguf_file`` tokenizer); raises when the checkpoint has none."""
    from kiln.checkpoint import open_checkpoint

    tokenizer = open_checkpoint(Path(path)).load_tokenizer()
    if tokenizer is None:
        raise ValueError(f"{path} has no tokenizer: real prompts need one")
    return tokenizer


def chat_prompts(tokenizer: Any, count: int) -> tuple[list[str], list[list[int]], bool]:
    """The first ``count`` of :data:`CHAT_PROMPTS` (cycled if more are asked for),
    each as one user message rendered by the tokenizer's chat template with the
    assistant's generation prompt (as plain text when it has none) and encoded
    without added special tokens (the template has them). Returns the texts
    rendered, their token ids, and whether the chat template was used."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    texts = []
    for i in range(count):
        message = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
        if templated:
            message = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                    add_generation_prompt=True, tokenize=False)
        texts.append(message)
    ids = [list(tokenizer(t, add_special_tokens=not templated)["input_ids"]) for t in texts]
    return texts, ids, templated
