"""Modules of the CPU kernels put in the place of a model's own, by name, and put back."""

from __future__ import annotations

from typing import Callable

from torch import nn


def put_in_place(model: nn.Module, named: list[tuple[str, nn.Module]], make: Callable[[nn.Module], nn.Module],
                 reproduces: Callable[[nn.Module], bool]) -> int:
    """Replace each ``(name, module)`` of ``model`` by ``make(module)`` where ``reproduces`` holds for its class (checked
    once per class, on its first module); a module under several names gets one replacement -> modules replaced."""
    checked: dict[type, bool] = {}
    replaced: dict[int, nn.Module] = {}
    for name, module in named:
        if type(module) not in checked:
            checked[type(module)] = reproduces(module)
        if checked[type(module)]:
            if id(module) not in replaced:
                replaced[id(module)] = make(module)
            model.set_submodule(name, replaced[id(module)])
    return len(replaced)


def put_back(model: nn.Module, kind: type) -> int:
    """Put the ``original`` of every module of class ``kind`` back in its place -> how many."""
    named = [(name, m) for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, kind)]
    for name, module in named:
        model.set_submodule(name, module.original)
    return len({id(m) for _, m in named})
