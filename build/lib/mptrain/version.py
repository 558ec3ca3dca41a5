"""mptrain's version, at the bottom of the imports (checkpoints record it)."""

__version__ = "0.1.0"
