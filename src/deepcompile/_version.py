"""The package's version (also part of the plan cache's key: compiler/cache.py)."""

__version__ = "0.1.0"
