"""kiln's version: the bottom floor, so that cache keys and bundles can record it
without importing the package's public face."""

__version__ = "0.2.0"
