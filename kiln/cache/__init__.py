"""On-disk compile cache: keys from every factor that changes compiled code,
atomic writes, locks and checksums, and the entries behind ``kiln cache``."""

from kiln.cache.keys import cache_factors, cache_key, diff_factors

__all__ = ["cache_factors", "cache_key", "diff_factors"]
