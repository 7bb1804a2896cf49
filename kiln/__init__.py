"""kiln: a compiler-centric LLM inference runtime.

>>> from kiln import Runtime, SamplingParams
>>> rt = Runtime.load("demo")
>>> rt.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0))[0].text
"""

from kiln.config import CompilationConfig, CUDAGraphMode
from kiln.runtime import RequestOutput, Runtime, SamplingParams, StreamDelta

__version__ = "0.1.0"

__all__ = [
    "Runtime",
    "SamplingParams",
    "RequestOutput",
    "StreamDelta",
    "CompilationConfig",
    "CUDAGraphMode",
    "__version__",
]
