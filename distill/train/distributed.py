"""``train-heads`` on several processes: how the global batch is split, and the frozen target sharded with FSDP2.

Terms
-----
global batch
    what one optimizer step trains on: ``--batch-size`` x ``--grad-accum`` x processes items
    (windows or packed rows), the next ones of the data stream whatever the split; micro-batch m
    of process r holds items ``(m * processes + r) * batch_size`` onwards. The loss of a step is
    the mean over the global batch's targets (each term over its own targets): every micro-batch
    divides its loss sums by the step's counts summed over all processes
    (:data:`distill.train.losses.STEP_COUNTS`), so one process at ``--batch-size 8``, one at
    ``--batch-size 4 --grad-accum 2`` and two at ``--batch-size 4`` train the same run, up to
    float rounding.
replicated run (DDP)
    ``accelerate launch`` without FSDP: the train module is wrapped in DDP, which averages the
    gradients; each micro-batch's loss is scaled by the number of processes so that the average
    is the global batch's sum.
sharded target (FSDP2)
    ``accelerate launch --use_fsdp --fsdp_version 2`` (or an ``accelerate config`` with FSDP
    version 2): every decoder layer and the input embeddings of the frozen target are sharded
    across the processes with ``torch.distributed.fsdp.fully_shard``, so each device holds
    1/N of its weights and gathers one unit at a time for the forward. The drafter (heads, or the
    EAGLE-3 drafter) is small and trains replicated: its gradients are summed across the processes
    after the step's last backward (:func:`sum_gradients`), and checkpoints, evaluation figures and
    the saved folder are the same as a one-process run's. Of the FSDP plugin's settings
    ``reshard_after_forward``, ``cpu_offload`` and ``cpu_ram_efficient_loading`` apply (with the
    latter, transformers loads the weights on the first process of each machine only, and they are
    broadcast from process 0 into the shards). Medusa-2 trains the target itself (LoRA) and is refused.
    accelerate sets its FSDP mode only on accelerators; on CPUs (gloo) the launcher's FSDP settings
    are read from the environment it sets, and the same sharding runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from distill.errors import ConfigError
from distill.train.config import TrainConfig

FSDP_COMMAND = "accelerate launch --use_fsdp --fsdp_version 2"


@dataclass
class Sharding:
    """How the frozen target is sharded (from accelerate's FSDP plugin)."""

    reshard_after_forward: bool = True
    offload: object = None  # a torch.distributed.fsdp offload policy (None: none)
    broadcast: bool = False  # weights loaded on process 0 only (cpu_ram_efficient_loading): broadcast into the shards


def _fsdp_requested(acc) -> bool:
    from accelerate.utils import DistributedType

    return acc.distributed_type == DistributedType.FSDP or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def sharding_plan(acc, cfg: TrainConfig) -> Sharding | None:
    """The sharding of the frozen target this launch asks for (None: the target is replicated), or a one-line error
    for a launch that asks for what train-heads does not do."""
    from accelerate.utils import DistributedType

    if acc.distributed_type == DistributedType.DEEPSPEED:
        raise ConfigError(f"train-heads shards the frozen target with FSDP2, not DeepSpeed: launch with `{FSDP_COMMAND}`")
    if acc.num_processes == 1 or not _fsdp_requested(acc):
        return None
    plugin = acc.state.fsdp_plugin if acc.distributed_type == DistributedType.FSDP else None
    # A CPU launch: accelerate keeps its multi-CPU mode, and the launcher's FSDP settings are in the environment (read
    # before the plugin is built from them: FSDP1's plugin asks for an accelerator).
    version = plugin.fsdp_version if plugin is not None else int(os.environ.get("FSDP_VERSION", "1"))
    if version != 2:
        raise ConfigError(f"train-heads shards the frozen target with FSDP2: launch with `{FSDP_COMMAND}` "
                          f"(or fsdp_version: 2 in the accelerate config); this launch asks for FSDP version {version}")
    if plugin is None:
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin()
    if cfg.arch == "medusa" and cfg.mode == "medusa2":
        raise ConfigError("--medusa-mode medusa2 trains the target (LoRA) and cannot shard it: train Medusa-2 without FSDP "
                          "(plain `accelerate launch`), or shard the target for --medusa-mode medusa1 or --arch eagle3")
    return Sharding(reshard_after_forward=bool(plugin.reshard_after_forward), offload=plugin.cpu_offload,
                    broadcast=bool(plugin.cpu_ram_efficient_loading))


def decoder_layers(decoder: nn.Module) -> list[nn.Module]:
    """The decoder's repeated blocks: the modules of the classes transformers never splits (``_no_split_modules``)."""
    names = set(getattr(decoder, "_no_split_modules", None) or [])
    layers = [m for m in decoder.modules() if type(m).__name__ in names]
    if not layers and isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        layers = list(decoder.layers)
    if not layers:
        raise ConfigError(f"cannot find the decoder layers of {type(decoder).__name__} to shard: train without FSDP")
    return layers


def shard_target(backbone: nn.Module, sharding: Sharding, device: torch.device, world: int) -> None:
    """Shard the frozen ``backbone``'s decoder in place across ``world`` processes onto ``device``: one FSDP unit per
    decoder layer, one for the input embeddings, the decoder as the root (what the train modules call).

    The backbone's LM head, outside the decoder, is left as loaded and unused: Medusa-1 heads and the EAGLE-3
    drafter copy what they need of it before this runs."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    decoder = backbone.get_decoder()
    full = decoder.state_dict() if sharding.broadcast and torch.distributed.get_rank() == 0 else {}
    mesh = init_device_mesh(device.type, (world,))
    kwargs = {"mesh": mesh, "reshard_after_forward": sharding.reshard_after_forward,
              "offload_policy": sharding.offload if sharding.offload is not None else OffloadPolicy()}
    for layer in decoder_layers(decoder):
        fully_shard(layer, **kwargs)
    embed = decoder.get_input_embeddings()
    if embed is not None:
        fully_shard(embed, **kwargs)
    fully_shard(decoder, **kwargs)
    if sharding.broadcast:
        set_model_state_dict(decoder, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def move_except(module: nn.Module, skip: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for everything but its child ``skip`` (a sharded target places itself)."""
    for child in module.children():
        if child is not skip:
            child.to(device)
    for name, buf in list(module.named_buffers(recurse=False)):
        setattr(module, name, buf.to(device))


def broadcast_module(module: nn.Module) -> None:
    """Every parameter and buffer of ``module`` set to process 0's (what DDP does when it wraps a module)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            torch.distributed.broadcast(t.data, src=0)


def sum_gradients(params: list[torch.Tensor]) -> None:
    """Sum the gradients of ``params`` across the processes, in place (a parameter without one counts as zeros).

    One collective per tensor: a drafter has a dozen, and no flat copy of them all is made."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        torch.distributed.all_reduce(p.grad)


def all_sum(values: torch.Tensor, world: int) -> torch.Tensor:
    """``values`` summed over the processes (itself on one)."""
    if world > 1:
        torch.distributed.all_reduce(values)
    return values


def same_everywhere(value: int, device: torch.device, world: int) -> bool:
    """Whether every process holds the same ``value``."""
    if world == 1:
        return True
    t = torch.tensor([value, -value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # (max, -min)
    return bool(t[0] == -t[1])
