"""Attention: the ``kiln::attention`` op every model calls (``op``), the backend
interface with per-backend metadata (``backend``), the torch reference backend
and the Triton backend with its kernels.

This ``__init__`` imports nothing: models import ``kiln.attention.op`` alone,
which sits below them; the backends sit above the models, beside the compiler.
"""
