"""Stand-in for the flash-attn package (tests only; see tests/standins/README.md)."""

__version__ = "2.8.3"
