"""Attention and KV-cache kernels behind the single ``kiln::attention`` op."""

from kiln.kernels.attention import attention, write_kv_cache

__all__ = ["attention", "write_kv_cache"]
