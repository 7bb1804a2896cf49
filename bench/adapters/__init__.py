"""One engine adapter per system measured, each an implementation of
:class:`bench.common.harness.Engine`: kiln (``kiln_engine``), transformers eager
(``transformers_eager``) and transformers with a static cache under
``torch.compile`` (``transformers_compiled``), each in a batch-1 and a
throughput variant; and llama.cpp's ``llama-bench`` (``llama_cpp``), an optional
baseline of ``bench.llama_cpp`` only.

Adding a baseline means writing its adapter and registering it below; its
``summary`` dict becomes its entry under ``baselines`` in the decode report.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench.adapters.kiln_engine import KilnEngine, KilnThroughputEngine
from bench.adapters.transformers_compiled import TransformersCompiledEngine, TransformersCompiledThroughputEngine
from bench.adapters.transformers_eager import TransformersEngine, TransformersThroughputEngine
from bench.common.harness import BenchSettings, Engine

__all__ = ["BASELINES", "THROUGHPUT_BASELINES", "KilnEngine", "KilnThroughputEngine"]

# name -> constructor (model_path, prompt, settings) of a batch-1 baseline engine
BASELINES: dict[str, Callable[[Path, list[int], BenchSettings], Engine]] = {
    "transformers": TransformersEngine,
    "transformers-compiled": TransformersCompiledEngine,
}
# name -> constructor (model_path, prompts, settings) of a throughput baseline engine
THROUGHPUT_BASELINES: dict[str, Callable[[Path, list[list[int]], BenchSettings], Engine]] = {
    "transformers": TransformersThroughputEngine,
    "transformers-compiled": TransformersCompiledThroughputEngine,
}
