"""kiln: a compiler-centric LLM inference runtime.

>>> from kiln import Runtime, SamplingParams
>>> rt = Runtime.load("demo")
>>> rt.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0))[0].text
"""

from kiln.config import CompilationConfig, CUDAGraphMode
from kiln.engine import EngineStats, RequestNotFoundError, RequestOutput, SamplingParams, StreamDelta
from kiln.entrypoints.runtime import Runtime
from kiln.version import __version__

__all__ = [
    "Runtime",
    "SamplingParams",
    "RequestOutput",
    "StreamDelta",
    "EngineStats",
    "RequestNotFoundError",
    "CompilationConfig",
    "CUDAGraphMode",
    "__version__",
]
