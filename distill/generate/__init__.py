"""``distill generate``: regenerate seed conversations with the target model."""

from distill.generate.config import GenerateConfig
from distill.generate.runner import GenerateSummary, Generator


def generate(cfg: GenerateConfig, progress=None) -> GenerateSummary:
    return Generator(cfg, progress=progress).run()


__all__ = ["GenerateConfig", "GenerateSummary", "Generator", "generate"]
