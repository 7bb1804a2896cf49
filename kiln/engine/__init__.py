"""The engine: loader steps, the engine core (add, abort, step -> plain data),
scheduler, KV block pool, model runner, sampler and output processor."""

from kiln.engine.core import Engine, RequestNotFoundError
from kiln.engine.outputs import EngineOutput, EngineOutputs, EngineStats, RequestOutput, StreamDelta
from kiln.engine.request import SamplingParams

__all__ = [
    "Engine", "EngineOutput", "EngineOutputs", "EngineStats", "RequestNotFoundError", "RequestOutput",
    "SamplingParams", "StreamDelta",
]
