"""Medusa heads: the module and its vLLM-loadable folder format."""

from distill.heads.model import DISTILL_HEADS_FILE, HeadsConfig, MedusaHeads, ResidualBlock, read_distill_meta

__all__ = ["DISTILL_HEADS_FILE", "HeadsConfig", "MedusaHeads", "ResidualBlock", "read_distill_meta"]
