"""The compiler: one Dynamo trace, split at attention, per-bucket Inductor pieces,
dispatch by token count, and the on-disk entries that make a second start warm."""

from kiln.compiler.pieces import BucketedPiece, TokenCountError
from kiln.compiler.pipeline import CompiledModel, CompileStats, compile_traced, trace_model

__all__ = ["BucketedPiece", "CompiledModel", "CompileStats", "TokenCountError", "compile_traced", "trace_model"]
