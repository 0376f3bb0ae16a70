"""specq: a batch engine for lossless speculative decoding."""

__version__ = "0.1.0"
