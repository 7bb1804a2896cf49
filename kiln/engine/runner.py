"""Running one scheduled step through the model.

``execute`` stages the step into the persistent input buffers, asks the CUDA
graph dispatcher (when graphs are installed) for the step's mode and padded
size, builds the attention backend's metadata, runs the forward (the compiled
pieces when there are some) inside a forward context, computes logits only for
the rows that sample, and samples them; and, for requests that asked for their
prompt's logprobs, the logits of their prompt rows, a slice at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.attention.backend import AttentionBackend
from kiln.config import CUDAGraphMode
from kiln.engine.input_batch import InputBatch, StepShape
from kiln.engine.request import RequestId, SamplingParams
from kiln.engine.sampler import Sampler, SamplerOutput, TokenLogprobs, prompt_logprobs
from kiln.engine.scheduler import ScheduledRequest, SchedulerOutput
from kiln.engine.structured import TokenConstraint
from kiln.forward_context import BatchDescriptor, ForwardContext, set_forward_context
from kiln.graphs import CUDAGraphDispatcher, CUDAGraphWrapper, Dispatch, GraphCapturer, NotCapturable, capture_session
from kiln.models import CausalLM
from kiln.progress import Progress

__all__ = ["CaptureReport", "ModelRunner", "RunnerOutput", "RunnerStats"]

logger = logging.getLogger(__name__)

# logits computed at once for prompt logprobs: rows x vocabulary fp32 values (32 MiB)
PROMPT_LOGITS_VALUES = 1 << 23


@dataclass
class RunnerStats:
    steps: int = 0
    tokens: int = 0
    prepare_seconds: float = 0.0
    model_seconds: float = 0.0
    sample_seconds: float = 0.0


@dataclass(frozen=True)
class RunnerOutput:
    """What a step produced: a token (and its logprobs, when asked) per
    sampled row in schedule order (a sampling request's, then one per draft
    it ran), and the prompt logprobs of the rows each
    ``ScheduledRequest.prompt_logprobs`` named, by request."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: dict[RequestId, list[TokenLogprobs]] | None = None


@dataclass(frozen=True)
class CaptureReport:
    graphs: int = 0
    seconds: float = 0.0
    memory_bytes: int = 0


class ModelRunner:
    """Runs steps of ``model``; ``compiled`` (the compiled pieces' callable, with
    its own CPU LM head) replaces the model's forward when given."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        attention_backend: AttentionBackend,
        *,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        seed: int = 0,
        compiled: Any = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        # the compiled entry's CPU attention kernels, when it brings them
        self.attention_backend = attention_backend.with_decode_kernel(_attention_kernel(compiled))
        self.forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = compiled or model
        self.compute_logits = compiled.compute_logits if compiled is not None else model.compute_logits
        # a greedy step's tokens without the logits, where the compiled model can (None: it cannot)
        self.greedy_tokens: Callable[[torch.Tensor], list[int] | None] | None = _greedy_tokens(compiled)
        self.compiled = compiled
        self.device = device
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.inputs = InputBatch(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                 max_blocks_per_seq=-(-max_model_len // block_size), block_size=block_size,
                                 device=device)
        self.sampler = Sampler(device, seed, native_argmax=_argmax_kernel(compiled))
        self.stats = RunnerStats()
        self.dispatcher: CUDAGraphDispatcher | None = None
        self.graphs: GraphCapturer | None = None

    def use_compiled(self, compiled: Any) -> None:
        """Run the compiled pieces from the next step on (a background build
        finished): the forward, the LM head and the decode-attention kernel are
        the compiled model's, over the same parameters and KV cache. Only before
        CUDA graphs are installed."""
        if self.dispatcher is not None:
            raise RuntimeError("the compiled pieces must be swapped in before CUDA graphs are captured")
        self.forward = compiled
        self.compute_logits = compiled.compute_logits
        self.greedy_tokens = _greedy_tokens(compiled)
        self.compiled = compiled
        self.attention_backend = self.attention_backend.with_decode_kernel(_attention_kernel(compiled))
        self.sampler.native_argmax = _argmax_kernel(compiled)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run the step; one sampled token (and its logprobs, when asked) per
        sampled row, in schedule order (a request's drafts' rows after its
        token's), and the prompt logprobs asked for."""
        t0 = time.perf_counter()
        shape = self.inputs.stage(sched)
        dispatch = self._dispatch(shape)
        num_reqs = dispatch.descriptor.num_reqs if dispatch.mode is CUDAGraphMode.FULL else shape.num_reqs
        if dispatch.num_tokens != shape.num_tokens or num_reqs != shape.num_reqs:
            self.inputs.pad(shape, dispatch.num_tokens, num_reqs)  # type: ignore[arg-type]
        meta = self._metadata(shape, dispatch.num_tokens, num_reqs)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        try:
            hidden = self._run(meta, dispatch)
        except NotCapturable as e:
            # A CPU call graph refused at its first step, before the work it would
            # leave out: that size runs without one, and this step runs again
            # unpadded. That only rewrites the same keys and values into the same
            # slots (padding tokens write none).
            logger.info("no %s graph of %d tokens: %s", dispatch.mode.value, dispatch.num_tokens, e)
            self.dispatcher.drop(dispatch.num_tokens)  # type: ignore[union-attr]
            hidden = self._run(self._metadata(shape, shape.num_tokens, shape.num_reqs), _unpadded(shape))
        prompt = self._prompt_logprobs(sched, hidden) if any(s.prompt_logprobs for s in sched.scheduled) else None
        rows = hidden[self.inputs.logits_indices.view(shape.num_samples)]
        sampling = _sampled_rows(sched)
        params: list[SamplingParams] = [s.sampling for s in sampling]  # type: ignore[misc]
        suppressed = [s.suppressed for s in sampling]
        constraints = [s.constraint for s in sampling]
        # a step of greedy rows alone: their tokens without the fp32 logits (kiln.compiler.greedy_head)
        argmax = self.greedy_tokens is not None and Sampler.argmax_only(params, suppressed)
        tokens = self.greedy_tokens(rows) if argmax else None
        if tokens is not None:
            t2 = time.perf_counter()
            sampled = SamplerOutput(self._keep_structures(rows, params, tokens, constraints))
        else:
            logits = self.compute_logits(rows)
            t2 = time.perf_counter()
            sampled = self.sampler(logits, params, [s.num_output_tokens for s in sampling],
                                   [s.history for s in sampling], suppressed, constraints)
        t3 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.tokens += shape.num_tokens
        st.prepare_seconds += t1 - t0
        st.model_seconds += t2 - t1
        st.sample_seconds += t3 - t2
        return RunnerOutput(sampled.tokens, sampled.logprobs, prompt)

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor) -> dict[RequestId, list[TokenLogprobs]]:
        """The prompt logprobs of the rows each scheduled request named: their
        logits a slice of rows at a time (a 2048-token chunk's logits over a
        151936-token vocabulary would be 1.2 GB at once)."""
        out: dict[RequestId, list[TokenLogprobs]] = {}
        offset = 0
        for s in sched.scheduled:  # the step's tokens are the requests' chunks in schedule order
            rows = s.prompt_logprobs
            if rows is not None:
                first, lps = offset + rows.first, []
                size = max(1, PROMPT_LOGITS_VALUES // self.model.config.vocab_size)
                for i in range(0, len(rows.targets), size):
                    targets = rows.targets[i:i + size]
                    logits = self.compute_logits(hidden[first + i:first + i + len(targets)])
                    lps += prompt_logprobs(logits, targets, rows.k)
                out[s.request_id] = lps
            offset += s.num_tokens
        return out

    def _keep_structures(self, rows: torch.Tensor, params: list[SamplingParams], tokens: list[int],
                         constraints: list[TokenConstraint | None]) -> list[int]:
        """Greedy tokens with each structured row's argmax that its automaton
        refuses replaced by its most likely allowed token: the logits of those
        rows alone are computed (one row in a batch of 16 that refuses its
        argmax must not cost the batch's whole fp32 head)."""
        refused = [i for i, (c, t) in enumerate(zip(constraints, tokens)) if c is not None and not c.allows(t)]
        if not refused:
            return tokens
        logits = self.compute_logits(rows[torch.tensor(refused, device=rows.device)])
        chosen = self.sampler(logits, [params[i] for i in refused], [0] * len(refused),
                              constraints=[constraints[i] for i in refused]).tokens
        for i, token in zip(refused, chosen):
            tokens[i] = token
        return tokens

    def _dispatch(self, shape: StepShape) -> Dispatch:
        if self.dispatcher is None:
            return _unpadded(shape)
        return self.dispatcher.dispatch(shape.num_tokens, shape.num_reqs, shape.uniform_decode)

    def _metadata(self, shape: StepShape, num_tokens: int, num_reqs: int) -> Any:
        """The attention backend's metadata for the staged step run as
        ``num_tokens`` tokens of ``num_reqs`` requests (padded or not)."""
        return self.attention_backend.build_metadata(self.inputs.upload(shape, num_tokens, num_reqs))

    def _run(self, meta: Any, dispatch: Dispatch) -> torch.Tensor:
        t = dispatch.num_tokens
        context = ForwardContext(
            attn_metadata=meta,
            kv_caches=self.kv_caches,
            batch_descriptor=dispatch.descriptor,
            cudagraph_mode=dispatch.mode,
            attention_backend=self.attention_backend,
        )
        with set_forward_context(context):
            return self.forward(self.inputs.input_ids.view(t), self.inputs.positions.view(t))

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
            if self.compiled is None:
                raise ValueError(f"cudagraph_mode {mode.value} needs compiled pieces (optimization level >= 1)")
            self.compiled.wrap_pieces(lambda name, fn: CUDAGraphWrapper(
                fn, CUDAGraphMode.PIECEWISE, graphs, pool, name=name, check_addresses=check_addresses))
        if mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE):
            self.forward = CUDAGraphWrapper(
                self.forward, CUDAGraphMode.FULL, graphs, pool, name="model", check_addresses=check_addresses
            )
        self.dispatcher = dispatcher
        self.graphs = graphs

    @torch.inference_mode()
    def capture_graphs(self, progress: bool | None = None) -> CaptureReport:
        """Capture every graph of the dispatcher's plan, largest first, each after
        one plain warm-up run of the same shape (first calls compile kernels and
        allocate, which must not happen inside a capture). Every capture runs a
        step of padding only: no KV written, none read. Graphs captured by live
        steps (CPU call graphs) are not captured here."""
        if self.dispatcher is None or self.graphs is None or self.graphs.captures_live_steps:
            return CaptureReport()
        plan = self.dispatcher.capture_plan()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        with capture_session(), Progress(len(plan), "capturing graphs", enabled=progress) as bar:
            for d in plan:
                reqs = d.descriptor.num_reqs or 1
                empty = StepShape(0, 0, 0, 0, 0)
                self.inputs.pad(empty, d.num_tokens, reqs)
                meta = self._metadata(empty, d.num_tokens, reqs)
                self._run(meta, Dispatch(CUDAGraphMode.NONE, d.descriptor))
                self._run(meta, d)
                bar.update(f"{d.mode.value} {d.num_tokens} tokens")
        memory = 0
        if cuda:
            torch.cuda.synchronize(self.device)
            memory = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        report = CaptureReport(len(plan), round(time.perf_counter() - t0, 4), memory)
        logger.info("captured %d graphs in %.2fs (%d MiB)", report.graphs, report.seconds, memory >> 20)
        return report

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward over ``max_num_batched_tokens`` dummy tokens with no metadata
        (attention writes nothing), to measure peak activation memory; the
        sampler's buffers for that many rows of logits are counted in it."""
        n = self.max_num_batched_tokens
        with set_forward_context(ForwardContext(attn_metadata=None, kv_caches=self.kv_caches)):
            hidden = self.forward(self.inputs.input_ids.device[:n], self.inputs.positions.device[:n])
            self.sampler.workspace.reserve(self.compute_logits(hidden[: self.max_num_seqs]))


def _sampled_rows(sched: SchedulerOutput) -> list[ScheduledRequest]:
    """The request of each row whose token is picked, in row order: a request
    that runs drafts once for its token's row and once for each draft's."""
    sampling = [s for s in sched.scheduled if s.sampling is not None]
    if not any(s.draft_token_ids for s in sampling):
        return sampling
    return [s for s in sampling for _ in range(s.num_samples)]


def _unpadded(shape: StepShape) -> Dispatch:
    """The step as it is, without a graph."""
    return Dispatch(CUDAGraphMode.NONE, BatchDescriptor(shape.num_tokens, shape.num_reqs, shape.uniform_decode))


def _argmax_kernel(compiled: Any) -> Any:
    """The argmax of the C linear kernel ``compiled`` brings, for greedy steps, or None."""
    kernel = getattr(compiled, "linear_kernel", None) if compiled is not None else None
    return kernel.argmax_rows if kernel is not None else None


def _greedy_tokens(compiled: Any) -> Callable[[torch.Tensor], list[int] | None] | None:
    """The compiled model's greedy tokens without logits (CompiledModel.greedy_tokens), or None."""
    return getattr(compiled, "greedy_tokens", None) if compiled is not None else None


def _attention_kernel(compiled: Any) -> Any:
    """The CPU decode-attention kernel ``compiled`` brings (CompiledModel.attention_kernel), or None."""
    return getattr(compiled, "attention_kernel", None) if compiled is not None else None
