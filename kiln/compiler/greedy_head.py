"""Greedy tokens of an fp32 LM head from its product in bf16, exactly.

A greedy step needs only each row's argmax of the logits. The head of the 135M
shape (49152 x 576) is a fifth of a decode step's fp32 weights and of its
multiply-adds: 9.7 of 49.6 ms of a 64-row step's linears, 3.5 of 23.5 at 16
rows (bench/results/step-linears-cpu-20261207-065754.json). Its bf16 product on
the AMX tiles reads half the bytes at 16 times the arithmetic rate (1.9 ms at
64 rows). From that product and a bound on how far it can lie from the fp32
logit (``kiln_greedy_screen`` in ``cpu_linear.c`` derives it), only the columns
that could still be the largest are computed in fp32, in the order of the
kernel that would have computed the whole head at that batch: the token is the
argmax of the logits that kernel makes, bit for bit, whatever the screen's
rounding. Over 230 greedy steps of the real model (SmolLM2-135M-Instruct) a
median of 2 columns of 49152 were left in doubt, at most 32 (scratch).

Used where the C kernel has AMX tiles and computes the fp32 head: a step's
sampling rows all greedy, without logprobs (``Sampler.argmax_only``). The
bf16 copy of the head costs half the head's fp32 bytes (56 MB for the demo
model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kiln.compiler.cpu_linear import CpuLinearKernel

__all__ = ["GreedyHead"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GreedyHead:
    """An fp32 head ``weight`` ([N, K]) with what its screen needs: its bf16
    copy laid out as the kernel's AMX tiles and each row's length, rounded up."""

    kernel: CpuLinearKernel
    weight: torch.Tensor
    tiles: torch.Tensor
    norms: torch.Tensor

    @classmethod
    def build(cls, kernel: CpuLinearKernel | None, weight: torch.Tensor) -> GreedyHead | None:
        """The screen for ``weight``, or None where it does not apply: no
        kernel, no AMX tiles or screen in it (``greedy_screens``), not an fp32 CPU matrix the
        tiles take (N a multiple of 16, K of 32)."""
        if (kernel is None or not kernel.greedy_screens or weight.dim() != 2
                or weight.dtype != torch.float32 or not weight.is_cpu or not weight.is_contiguous()):
            return None
        tiles = kernel.amx_tiles(weight.to(torch.bfloat16))
        if tiles is None:
            return None
        # summed in fp64 (each square exact), without an fp64 copy of the head: 70 ms against 110 (135M head)
        norms = torch.linalg.vector_norm(weight, dim=1, dtype=torch.float64).float()
        norms = torch.nextafter(norms, torch.full_like(norms, float("inf")))  # rounded up, never down
        logger.debug("greedy screen for a %s head: %.1f MB of bf16 tiles", tuple(weight.shape), tiles.nbytes / 1e6)
        return cls(kernel, weight, tiles, norms)

    def report(self) -> dict[str, int]:
        """What a greedy step reads of the head instead of its fp32 weight:
        the bf16 tiles and the norms (``tile_bytes``), against ``head_bytes``
        (the fp32 columns left in doubt add a few rows of it)."""
        return {"head_bytes": self.weight.nbytes, "tile_bytes": self.tiles.nbytes + self.norms.nbytes}

    def __call__(self, hidden: torch.Tensor, panels: bool) -> list[int] | None:
        """Each row's argmax of ``hidden @ weight.T`` as the panels
        (``panels``) or the dense rows of one call sum it; None where the
        kernel refuses the rows."""
        if hidden.dim() != 2 or hidden.dtype != torch.float32 or hidden.shape[0] == 0:
            return None
        rows = hidden if hidden.stride(1) == 1 else hidden.contiguous()
        screen = self.kernel.amx_linear(rows.to(torch.bfloat16), self.tiles, self.weight.shape[0], None)
        return self.kernel.greedy_screen(rows, self.weight, screen, self.norms, panels)
