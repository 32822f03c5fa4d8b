"""The package version, kept apart so that modules below `sift/__init__.py` can read it."""

__version__ = "0.1.0"
