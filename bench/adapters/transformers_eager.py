"""transformers ``generate`` as a measured system, greedy, in eager PyTorch (no
``torch.compile``) with the model's default attention implementation: batch 1
(:class:`TransformersEngine`) and one left-padded batch of every request
(:class:`TransformersThroughputEngine`). EOS is off, so the token budget ends
every generate."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common.harness import (
    BenchSettings,
    Engine,
    median,
    rate_spread,
    split_token_ids,
    sync,
    throughput_figures,
    throughput_summary,
)

PAD_TOKEN_ID = 0


def load_transformers(model_path: Path, settings: BenchSettings) -> tuple[Any, float]:
    """The checkpoint (a directory, or a ``.gguf`` file) as a transformers model
    in the run dtype on the device, in eval mode, with no EOS in its generation
    config; and the seconds the load took."""
    from transformers import AutoModelForCausalLM
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    if model_path.is_file() and model_path.suffix.lower() == ".gguf":
        # transformers dequantizes a GGUF's weights itself, then casts them to the run dtype
        model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                     dtype=settings.torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=settings.torch_dtype)
    model = model.to(settings.device).eval()
    sync(settings.device)
    seconds = time.perf_counter() - t0
    # The token budget, not EOS, ends every generate: with no EOS in the
    # generation config, ``min_new_tokens`` has nothing to mask and the logits
    # stay untouched.
    model.generation_config.eos_token_id = None
    return model, seconds


def left_pad(prompts: list[list[int]], pad: int = PAD_TOKEN_ID) -> tuple[list[list[int]], list[list[int]]]:
    """Input ids and attention mask of a left-padded batch."""
    width = max(map(len, prompts))
    ids = [[pad] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


class _TransformersAdapter(Engine):
    """What both transformers adapters share: the model, its left-padded input
    batch, one timed greedy ``generate``, and the result's head."""

    engine = "transformers"
    description = ""  # what a run is, for the label

    def __init__(self, model_path: Path, prompts: list[list[int]], settings: BenchSettings) -> None:
        self.prompts = prompts
        self.max_tokens = settings.max_tokens
        self.device = settings.device
        self.model, self.load_seconds = load_transformers(model_path, settings)
        self.attn_implementation = self.model.config._attn_implementation
        self.label = f"{self.description}, eager, {self.attn_implementation}"
        ids, mask = left_pad(prompts)
        self.input_ids = torch.tensor(ids, dtype=torch.long, device=settings.device)
        self.attention_mask = torch.tensor(mask, dtype=torch.long, device=settings.device)
        self.grad_mode: Callable[[], Any] = torch.inference_mode

    def generate(self, new_tokens: int) -> tuple[float, list[list[int]]]:
        """Seconds of one greedy ``generate`` of ``new_tokens`` per request, and
        each request's new tokens (checked to be ``new_tokens`` long)."""
        sync(self.device)
        start = time.perf_counter()
        with self.grad_mode():
            out = self.model.generate(
                self.input_ids,
                attention_mask=self.attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD_TOKEN_ID,
            )
        sync(self.device)
        seconds = time.perf_counter() - start
        tokens = out[:, self.input_ids.shape[1]:].tolist()
        if any(len(t) != new_tokens for t in tokens):
            raise RuntimeError(f"transformers generated {[len(t) for t in tokens]} tokens, expected {new_tokens}")
        return seconds, tokens

    def _head(self) -> dict[str, Any]:
        import transformers

        return {"engine": self.engine, "label": self.label, "transformers_version": transformers.__version__,
                "attn_implementation": self.attn_implementation, "torch_compile": False}

    def _load_figures(self) -> dict[str, Any]:
        return {"num_parameters": sum(p.numel() for p in self.model.parameters()),
                "load_seconds": self.load_seconds, "warmup_seconds": self.warmup_seconds}

    def close(self) -> None:
        del self.model


class TransformersEngine(_TransformersAdapter):
    """Batch 1. Each run times a generate of ``max_tokens`` new tokens and one of a
    single token (prefill and the first token); decode is their difference. The
    summary rate is ``(max_tokens - 1) / (median t_N - median t_1)``; every run
    keeps its own paired rate too.
    """

    description = "generate"

    def __init__(self, model_path: Path, prompt: list[int], settings: BenchSettings) -> None:
        super().__init__(model_path, [prompt], settings)

    def warmup(self) -> None:
        t0 = time.perf_counter()
        self.generate(self.max_tokens)
        self.generate(1)
        self.warmup_seconds = time.perf_counter() - t0

    def run_once(self) -> dict[str, Any]:
        n = self.max_tokens
        t_n, tokens = self.generate(n)
        t_1, _ = self.generate(1)
        return {"token_ids": tokens[0], "generate_seconds": t_n, "prefill_seconds": t_1,
                "decode_tokens_per_s": (n - 1) / (t_n - t_1)}

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        runs, token_ids, deterministic = split_token_ids(runs)
        result: dict[str, Any] = {
            **self._head(),
            **self._load_figures(),
            "deterministic_across_runs": deterministic,
            "prefill_seconds": median([r["prefill_seconds"] for r in runs]),
            "generate_seconds": median([r["generate_seconds"] for r in runs]),
        }
        result["decode_tokens_per_s"] = (self.max_tokens - 1) / (result["generate_seconds"]
                                                                 - result["prefill_seconds"])
        result["ms_per_token"] = 1e3 / result["decode_tokens_per_s"]
        result.update(rate_spread([r["decode_tokens_per_s"] for r in runs]))
        result["runs"] = runs
        result["token_ids"] = token_ids
        return result


class TransformersThroughputEngine(_TransformersAdapter):
    """One batched greedy ``generate`` of every prompt, left-padded (attention
    mask), ``max_tokens`` new tokens each. With ``settings.output_lens`` the batch
    runs to the longest budget (a static batch), and each request keeps, and is
    credited with, only its own budget's tokens."""

    description = "batched generate"
    rate_key = "output_tokens_per_s"

    def __init__(self, model_path: Path, prompts: list[list[int]], settings: BenchSettings) -> None:
        super().__init__(model_path, prompts, settings)
        self.output_lens = settings.output_lens or (settings.max_tokens,) * len(prompts)

    def run_once(self) -> dict[str, Any]:
        """The batch, then a one-token generate of it (untimed in the rate):
        its time is the prefill, the rest of the batch's is decode."""
        wall, tokens = self.generate(max(self.output_lens))
        prefill, _ = self.generate(1)
        tokens = [t[:n] for t, n in zip(tokens, self.output_lens)]
        return {**throughput_figures(wall, tokens, sum(map(len, self.prompts))),
                "prefill_seconds": prefill, "decode_seconds": wall - prefill}

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._head(), "padding": "left (attention mask)", **self._load_figures(),
                **throughput_summary(runs, ("output_tokens_per_s", "total_tokens_per_s", "wall_seconds",
                                            "prefill_seconds", "decode_seconds"))}
