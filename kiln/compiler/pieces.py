"""Compute pieces compiled by Inductor per token-count bucket, and the run-time
dispatch between them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

__all__ = ["BucketedPiece", "TokenCountError", "inductor_compile", "token_arg"]

class TokenCountError(RuntimeError):
    """A step's token count that no compiled runnable covers."""


def token_arg(gm: fx.GraphModule) -> tuple[int, int | None]:
    """Where a piece finds the step's token count: (placeholder index, None) for a
    SymInt input, or (index, dim) of a tensor input whose size there is symbolic."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        if isinstance(node.meta.get("example_value"), torch.SymInt):
            return i, None
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    return i, d
    raise RuntimeError("a compute piece has no input that carries the token count")


def inductor_compile(
    gm: fx.GraphModule, example_inputs: Sequence[Any], dynamic: bool, options: dict[str, Any]
) -> Callable[..., Any]:
    """Compile one piece: for the symbolic range (``dynamic``) or the exact sizes of
    ``example_inputs``. ``options`` are Inductor config settings (``max_autotune``...)."""
    mode = "from_graph" if dynamic else "from_example_inputs"
    return torch._inductor.standalone_compile(
        gm, list(example_inputs), dynamic_shapes=mode, options={"config_patches": dict(options)}
    )


class BucketedPiece:
    """The compiled runnables of one compute piece (shared by every identical
    piece): one per exact compile size; on CPU, one for the few-row span
    ``few_rows`` (token counts that kiln's C linear kernel serves,
    ``kiln.compiler.gemv``); one for the range ``[1, max_num_tokens]``. Each
    call picks one by the step's token count, in that order."""

    def __init__(self, signature: str, token_index: tuple[int, int | None], max_num_tokens: int, returns_tuple: bool) -> None:
        self.signature = signature
        self.token_index = token_index
        self.max_num_tokens = max_num_tokens
        self.returns_tuple = returns_tuple
        self.exact: dict[int, Callable[..., Any]] = {}
        self.few: Callable[..., Any] | None = None
        self.few_rows: tuple[int, int] = (0, -1)  # the token counts ``few`` serves, both ends included
        self.range: Callable[..., Any] | None = None
        self.last_bucket: int | str | None = None  # which runnable the last call used

    def runnables(self) -> list[Callable[..., Any]]:
        """Every compiled runnable of the piece."""
        return [*self.exact.values(), *([self.few] if self.few is not None else []),
                *([self.range] if self.range is not None else [])]

    def num_tokens(self, args: Sequence[Any]) -> int:
        i, dim = self.token_index
        return int(args[i]) if dim is None else int(args[i].shape[dim])

    def select(self, n: int) -> tuple[Callable[..., Any], int | str]:
        fn = self.exact.get(n)
        if fn is not None:
            return fn, n
        if self.few is not None and self.few_rows[0] <= n <= self.few_rows[1]:
            return self.few, "few"
        if self.range is not None and 1 <= n <= self.max_num_tokens:
            return self.range, "range"
        raise TokenCountError(
            f"no compiled runnable covers {n} tokens (exact sizes {sorted(self.exact)}, "
            f"range [1, {self.max_num_tokens}]); kiln never recompiles at run time"
        )

    def __call__(self, *args: Any) -> Any:
        fn, self.last_bucket = self.select(self.num_tokens(args))
        out = fn(*args)
        # A fresh artifact returns a bare tensor for a one-output graph, a loaded one a list.
        if self.returns_tuple:
            return tuple(out)
        return out[0] if isinstance(out, (list, tuple)) else out
