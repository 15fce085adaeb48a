"""OpenForgeRL: train agents inside the harnesses they really run in."""

__version__ = "0.1.0"
