"""Hugging Face Hub: ``distill push`` and the dataset card rendered from ``data_cards/``."""

from distill.hub.card import CardOptions, render_card
from distill.hub.push import PushSummary, push, stage

__all__ = ["CardOptions", "PushSummary", "push", "render_card", "stage"]
