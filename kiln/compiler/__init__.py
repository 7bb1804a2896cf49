"""The compiler: one Dynamo trace, split at attention, per-bucket Inductor pieces,
dispatch by token count."""

from kiln.compiler.backend import CompiledModel, CompileStats, compile_model
from kiln.compiler.piecewise import PiecewiseBackend, TokenCountError

__all__ = ["CompiledModel", "CompileStats", "compile_model", "PiecewiseBackend", "TokenCountError"]
