"""The serving loop: requests, scheduler, KV block pool, model runner, sampler,
checkpoint loading and the model definition."""

from kiln.runtime.request import RequestOutput, SamplingParams, StreamDelta
from kiln.runtime.runtime import Runtime

__all__ = ["Runtime", "SamplingParams", "RequestOutput", "StreamDelta"]
