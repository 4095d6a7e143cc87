"""Tributary: a Matrix homeserver that scales out with worker processes."""

__version__ = "0.1.0"
