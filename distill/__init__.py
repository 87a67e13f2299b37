"""distill: self-distilled data, speculative drafters (Medusa, EAGLE-3, lookup) and fast serving for chat models."""

__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's module ``__getattr__`` (PEP 562): each exported name imported from its module on first use.

    For the packages whose config module must load without the heavy rest (``--help`` and unknown
    options of a stage command read only its torch-free config; see ``distill.cli.STAGE_CONFIGS``).
    """
    from importlib import import_module

    def __getattr__(name: str):
        if name in exports:
            return getattr(import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
