"""Running one scheduled step through the model.

Inputs go into persistent buffers allocated once, sized by
``max_num_batched_tokens`` and ``max_num_seqs``: the model always reads views of the
same memory, which is what CUDA graph capture will need. The host side stages
every value in numpy views of (pinned, on CUDA) CPU tensors, then one copy per
buffer moves them to the device. Logits are computed only for the rows that
sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kiln.forward_context import AttentionImpl, AttentionMetadata, ForwardContext, set_forward_context
from kiln.runtime.model import DecoderModel
from kiln.runtime.sampler import Sampler
from kiln.runtime.scheduler import SchedulerOutput

__all__ = ["ModelRunner", "RunnerStats"]


@dataclass
class RunnerStats:
    steps: int = 0
    tokens: int = 0
    prepare_seconds: float = 0.0
    model_seconds: float = 0.0
    sample_seconds: float = 0.0


class _Buffer:
    """A device tensor and its host staging twin (the same memory on CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first ``n`` rows to the device; return the device view."""
        if self.device is not self.cpu:
            self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device[:n]


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        seed: int = 0,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        attention_backend: AttentionImpl | None = None,
    ) -> None:
        self.model = model
        self.attention_backend = attention_backend
        # the compiled model when there is one; ``model`` stays for its lm_head
        self.forward = forward or model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        t, r = max_num_batched_tokens, max_num_seqs
        self.input_ids = _Buffer((t,), torch.int64, device)
        self.positions = _Buffer((t,), torch.int64, device)
        self.slot_mapping = _Buffer((t,), torch.int64, device)
        self.query_start_loc = _Buffer((r + 1,), torch.int32, device)
        self.seq_lens = _Buffer((r,), torch.int32, device)
        self.block_table = _Buffer((r, self.max_blocks_per_seq), torch.int32, device)
        self.logits_indices = _Buffer((r,), torch.int64, device)
        self.sampler = Sampler(device, seed)
        self.stats = RunnerStats()

    def _prepare(self, sched: SchedulerOutput) -> tuple[AttentionMetadata, int]:
        num_reqs = len(sched.scheduled)
        if num_reqs > self.max_num_seqs:
            raise RuntimeError(f"{num_reqs} requests scheduled, buffers hold {self.max_num_seqs}")
        ids, pos, slots = self.input_ids.np, self.positions.np, self.slot_mapping.np
        qsl, seq_lens, table = self.query_start_loc.np, self.seq_lens.np, self.block_table.np
        logits_idx = self.logits_indices.np
        qsl_cpu = [0]
        seq_lens_cpu: list[int] = []
        nblocks_cpu: list[int] = []
        offset = num_samples = max_q = max_blocks = 0
        bs = self.block_size
        for i, s in enumerate(sched.scheduled):
            req, start, n = s.request, s.start, s.num_tokens
            end_tok = offset + n
            ids[offset:end_tok] = req.tokens(start, start + n)
            p = np.arange(start, start + n)
            pos[offset:end_tok] = p
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            slots[offset:end_tok] = blocks[p // bs] * bs + p % bs
            nb = len(req.block_ids)
            table[i, :nb] = req.block_ids
            seq_len = start + n
            seq_lens_cpu.append(seq_len)
            nblocks_cpu.append(-(-seq_len // bs))
            max_q, max_blocks = max(max_q, n), max(max_blocks, nb)
            offset = end_tok
            qsl_cpu.append(offset)
            if s.samples:
                logits_idx[num_samples] = offset - 1
                num_samples += 1
        if offset > self.max_num_batched_tokens:
            raise RuntimeError(f"{offset} tokens scheduled, buffers hold {self.max_num_batched_tokens}")
        qsl[: num_reqs + 1] = qsl_cpu
        seq_lens[:num_reqs] = seq_lens_cpu
        meta = AttentionMetadata(
            num_actual_tokens=offset,
            num_reqs=num_reqs,
            max_query_len=max_q,
            max_seq_len=max(seq_lens_cpu, default=0),
            query_start_loc=self.query_start_loc.upload(num_reqs + 1),
            seq_lens=self.seq_lens.upload(num_reqs),
            block_table=self.block_table.upload(num_reqs)[:, :max_blocks],
            slot_mapping=self.slot_mapping.upload(offset),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            num_blocks_cpu=nblocks_cpu,
        )
        self.input_ids.upload(offset)
        self.positions.upload(offset)
        self.logits_indices.upload(num_samples)
        return meta, num_samples

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[int]:
        """Run the step; return one sampled token per sampling request, in order."""
        t0 = time.perf_counter()
        meta, num_samples = self._prepare(sched)
        n = meta.num_actual_tokens
        t1 = time.perf_counter()
        context = ForwardContext(
            attn_metadata=meta, kv_caches=self.kv_caches, attention_backend=self.attention_backend
        )
        with set_forward_context(context):
            hidden = self.forward(self.input_ids.device[:n], self.positions.device[:n])
        logits = self.model.compute_logits(hidden[self.logits_indices.device[:num_samples]])
        t2 = time.perf_counter()
        sampling = [s for s in sched.scheduled if s.samples]
        tokens = self.sampler(
            logits,
            [s.request.params for s in sampling],
            [len(s.request.output_token_ids) for s in sampling],
        )
        t3 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.tokens += n
        st.prepare_seconds += t1 - t0
        st.model_seconds += t2 - t1
        st.sample_seconds += t3 - t2
        return tokens

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward over ``max_num_batched_tokens`` dummy tokens with no metadata
        (attention writes nothing), to measure peak activation memory."""
        n = self.max_num_batched_tokens
        with set_forward_context(ForwardContext(attn_metadata=None, kv_caches=self.kv_caches)):
            hidden = self.model(self.input_ids.device[:n], self.positions.device[:n])
            self.model.compute_logits(hidden[: self.max_num_seqs])
