"""Chorus: streaming neural text-to-speech serving."""

__version__ = "0.1.0"
