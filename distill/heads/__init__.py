"""Speculative drafters: Medusa heads and the EAGLE-3 drafter, with their vLLM-loadable folder formats."""

from distill.heads.eagle import DrafterConfig, EagleDrafter, is_eagle3_folder
from distill.heads.model import DISTILL_HEADS_FILE, HeadsConfig, MedusaHeads, ResidualBlock, read_distill_meta
from distill.heads.vocab import DraftVocab

__all__ = ["DISTILL_HEADS_FILE", "DraftVocab", "DrafterConfig", "EagleDrafter", "HeadsConfig", "MedusaHeads", "ResidualBlock",
           "is_eagle3_folder", "read_distill_meta"]
