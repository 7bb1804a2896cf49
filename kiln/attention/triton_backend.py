"""The Triton attention backend: one varlen paged-attention kernel for the whole
mixed prefill/decode batch, plus a scatter kernel for the KV write.

Both read only device buffers and size their grids from shapes, so a FULL CUDA
graph may hold them for any batch. On CPU they run only under
``TRITON_INTERPRET=1`` (Triton's interpreter: slow, for tests).
"""

from __future__ import annotations

from kiln.attention.backend import AttentionBackend, CommonAttentionMetadata
from kiln.config import CUDAGraphSupport

__all__ = ["TritonAttentionBackend"]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cudagraph_support = CUDAGraphSupport.ALWAYS

    def __init__(self) -> None:
        # Imported here: TRITON_INTERPRET is read when the kernels are defined.
        from kiln.attention import triton_kernels

        self._kernels = triton_kernels

    def build_metadata(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common  # device tensors and the (padded) request count are all it reads

    def forward(self, query, key, value, out, kv_cache, meta, scale, sliding_window) -> None:  # noqa: ANN001
        k = self._kernels
        k.write_kv_cache_triton(key, value, kv_cache, meta.slot_mapping)
        k.paged_attention_triton(
            query, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
            meta.num_reqs, scale, sliding_window,
        )
