"""The on-disk compile cache: keys from every factor that changes compiled code,
atomic writes, locks and checksums, the entries behind ``kiln cache``, and the
relocatable bundles ``kiln compile`` writes."""

from kiln.cache.keys import cache_factors, cache_key, diff_factors

__all__ = ["cache_factors", "cache_key", "diff_factors"]
