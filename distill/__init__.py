"""distill: self-distilled data, Medusa heads and fast serving for chat models."""

__version__ = "0.1.0"
