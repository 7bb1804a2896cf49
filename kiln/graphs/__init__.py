"""CUDA graphs: which graph a step replays (dispatcher) and the capture/replay
wrappers around the model and its compiled pieces."""

from kiln.graphs.dispatcher import CUDAGraphDispatcher, Dispatch
from kiln.graphs.wrapper import CUDAGraphWrapper, GraphCapturer, TorchCUDAGraphs, capture_session

__all__ = ["CUDAGraphDispatcher", "CUDAGraphWrapper", "Dispatch", "GraphCapturer", "TorchCUDAGraphs", "capture_session"]
