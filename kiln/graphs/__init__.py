"""Graphs: which graph a step replays (dispatcher), the capture/replay
wrappers around the model and its compiled pieces, and what captures them
(CUDA graphs on a GPU, CPU call graphs on a CPU)."""

from kiln.graphs.cpu import CpuCallGraphs, NativeReplay, NotCapturable
from kiln.graphs.dispatcher import CUDAGraphDispatcher, Dispatch
from kiln.graphs.wrapper import CUDAGraphWrapper, GraphCapturer, TorchCUDAGraphs, capture_session

__all__ = ["CUDAGraphDispatcher", "CUDAGraphWrapper", "CpuCallGraphs", "Dispatch", "GraphCapturer", "NativeReplay",
           "NotCapturable", "TorchCUDAGraphs", "capture_session"]
