"""Running one scheduled step through the model.

Inputs go into persistent buffers allocated once, sized by
``max_num_batched_tokens`` and ``max_num_seqs``: the model always reads views of the
same memory, which is what CUDA graph replay needs. The host side stages every
value in numpy views of (pinned, on CUDA) CPU tensors, then one copy per buffer
moves them to the device. Logits are computed only for the rows that sample.

With CUDA graphs, a dispatcher picks each step's graph and padded size. Padding
tokens get id 0, position 0 and slot -1 (no KV write); a FULL graph also pads the
request rows with requests that own no tokens and no context. Neither changes a
real row's output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from kiln.config import CUDAGraphMode
from kiln.forward_context import (
    AttentionImpl,
    AttentionMetadata,
    BatchDescriptor,
    ForwardContext,
    set_forward_context,
)
from kiln.graphs import CUDAGraphDispatcher, CUDAGraphWrapper, Dispatch, GraphCapturer, capture_session
from kiln.progress import Progress
from kiln.runtime.model import DecoderModel
from kiln.runtime.sampler import Sampler
from kiln.runtime.scheduler import SchedulerOutput

__all__ = ["CaptureReport", "ModelRunner", "RunnerStats"]

logger = logging.getLogger(__name__)


@dataclass
class RunnerStats:
    steps: int = 0
    tokens: int = 0
    prepare_seconds: float = 0.0
    model_seconds: float = 0.0
    sample_seconds: float = 0.0


@dataclass
class CaptureReport:
    graphs: int = 0
    seconds: float = 0.0
    memory_bytes: int = 0


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
        # the compiled model's LM head when it has one (CPU GEMV form), else the model's
        self.compute_logits = getattr(forward, "compute_logits", model.compute_logits)
        # the compiled model when there is one; ``model`` keeps the eager LM head
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
        self.dispatcher: CUDAGraphDispatcher | None = None

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
        dispatch = self._dispatch(meta)
        if dispatch.num_tokens != n or dispatch.mode is CUDAGraphMode.FULL:
            meta = self._pad(meta, dispatch)
        t1 = time.perf_counter()
        hidden = self._run(meta, dispatch)
        logits = self.compute_logits(hidden[self.logits_indices.device[:num_samples]])
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

    def _dispatch(self, meta: AttentionMetadata) -> Dispatch:
        uniform = meta.max_query_len == 1
        if self.dispatcher is None:
            return Dispatch(CUDAGraphMode.NONE, BatchDescriptor(meta.num_actual_tokens, meta.num_reqs, uniform))
        return self.dispatcher.dispatch(meta.num_actual_tokens, meta.num_reqs, uniform)

    def _run(self, meta: AttentionMetadata | None, dispatch: Dispatch) -> torch.Tensor:
        t = dispatch.num_tokens
        context = ForwardContext(
            attn_metadata=meta,
            kv_caches=self.kv_caches,
            batch_descriptor=dispatch.descriptor,
            cudagraph_mode=dispatch.mode,
            attention_backend=self.attention_backend,
        )
        with set_forward_context(context):
            return self.forward(self.input_ids.device[:t], self.positions.device[:t])

    def _pad(self, meta: AttentionMetadata, dispatch: Dispatch) -> AttentionMetadata:
        """Extend the step to the graph's padded token (and, for FULL, request)
        counts; the padding rows are inert."""
        n, t = meta.num_actual_tokens, dispatch.num_tokens
        self.input_ids.np[n:t] = 0
        self.positions.np[n:t] = 0
        self.slot_mapping.np[n:t] = -1
        self.input_ids.upload(t)
        self.positions.upload(t)
        meta = replace(meta, slot_mapping=self.slot_mapping.upload(t))
        reqs = dispatch.descriptor.num_reqs
        if dispatch.mode is not CUDAGraphMode.FULL or reqs is None or reqs == meta.num_reqs:
            return meta
        r = meta.num_reqs
        self.query_start_loc.np[r + 1 : reqs + 1] = n
        self.seq_lens.np[r:reqs] = 0
        self.block_table.np[r:reqs] = 0
        return replace(
            meta,
            num_reqs=reqs,
            query_start_loc=self.query_start_loc.upload(reqs + 1),
            seq_lens=self.seq_lens.upload(reqs),
            block_table=self.block_table.upload(reqs)[:, : meta.block_table.shape[1]],
            query_start_loc_cpu=meta.query_start_loc_cpu + [n] * (reqs - r),
            seq_lens_cpu=meta.seq_lens_cpu + [0] * (reqs - r),
            num_blocks_cpu=meta.num_blocks_cpu + [0] * (reqs - r),
        )

    # ------------------------------------------------------------------ CUDA graphs
    def install_cuda_graphs(
        self, dispatcher: CUDAGraphDispatcher, graphs: GraphCapturer, *, check_addresses: bool = False
    ) -> None:
        """Wrap the forward (FULL) and its compiled pieces (PIECEWISE) as the
        dispatcher's mode needs, sharing one memory pool; ``capture_graphs`` then
        records them. ``graphs`` makes and replays the graphs."""
        if dispatcher.max_capture_size > self.max_num_batched_tokens:
            raise ValueError(
                f"capture size {dispatcher.max_capture_size} exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        pool = graphs.new_pool()
        mode = dispatcher.mode
        if mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE):
            wrap_pieces = getattr(self.forward, "wrap_pieces", None)
            if wrap_pieces is None:
                raise ValueError(f"cudagraph_mode {mode.value} needs compiled pieces (optimization level >= 1)")
            wrap_pieces(lambda name, fn: CUDAGraphWrapper(
                fn, CUDAGraphMode.PIECEWISE, graphs, pool, name=name, check_addresses=check_addresses))
        if mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE):
            self.forward = CUDAGraphWrapper(
                self.forward, CUDAGraphMode.FULL, graphs, pool, name="model", check_addresses=check_addresses
            )
        self.dispatcher = dispatcher

    def _dummy_metadata(self, dispatch: Dispatch) -> AttentionMetadata:
        """Inputs for capturing ``dispatch``'s graph: every token padding (slot
        -1) and every request empty, so the captured step writes and reads no KV.
        Replays read whatever the buffers hold then."""
        t = dispatch.num_tokens
        reqs = dispatch.descriptor.num_reqs or 1
        self.input_ids.np[:t] = 0
        self.positions.np[:t] = 0
        self.slot_mapping.np[:t] = -1
        self.query_start_loc.np[: reqs + 1] = 0
        self.seq_lens.np[:reqs] = 0
        self.block_table.np[:reqs] = 0
        self.input_ids.upload(t)
        self.positions.upload(t)
        return AttentionMetadata(
            num_actual_tokens=0,
            num_reqs=reqs,
            max_query_len=0,
            max_seq_len=0,
            query_start_loc=self.query_start_loc.upload(reqs + 1),
            seq_lens=self.seq_lens.upload(reqs),
            block_table=self.block_table.upload(reqs),
            slot_mapping=self.slot_mapping.upload(t),
            query_start_loc_cpu=[0] * (reqs + 1),
            seq_lens_cpu=[0] * reqs,
            num_blocks_cpu=[0] * reqs,
        )

    @torch.inference_mode()
    def capture_graphs(self, progress: bool | None = None) -> CaptureReport:
        """Capture every graph of the dispatcher's plan, largest first, each after
        one plain warm-up run of the same shape (first calls compile kernels and
        allocate, which must not happen inside a capture)."""
        report = CaptureReport()
        if self.dispatcher is None:
            return report
        plan = self.dispatcher.capture_plan()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        with capture_session(), Progress(len(plan), "capturing CUDA graphs", enabled=progress) as bar:
            for d in plan:
                meta = self._dummy_metadata(d)
                self._run(meta, Dispatch(CUDAGraphMode.NONE, d.descriptor))
                self._run(meta, d)
                report.graphs += 1
                bar.update(f"{d.mode.value} {d.num_tokens} tokens")
        if cuda:
            torch.cuda.synchronize(self.device)
            report.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        report.seconds = round(time.perf_counter() - t0, 4)
        logger.info("captured %d CUDA graphs in %.2fs (%d MiB)", report.graphs, report.seconds,
                    report.memory_bytes >> 20)
        return report

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward over ``max_num_batched_tokens`` dummy tokens with no metadata
        (attention writes nothing), to measure peak activation memory."""
        n = self.max_num_batched_tokens
        with set_forward_context(ForwardContext(attn_metadata=None, kv_caches=self.kv_caches)):
            hidden = self.model(self.input_ids.device[:n], self.positions.device[:n])
            self.model.compute_logits(hidden[: self.max_num_seqs])
