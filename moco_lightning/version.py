"""The library's version (read by setup.cfg and written into every checkpoint)."""

__version__ = "0.3.0"
