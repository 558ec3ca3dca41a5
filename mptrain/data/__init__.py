"""Deterministic batch sources: batch ``i`` is a pure function of ``(seed, i)``."""
