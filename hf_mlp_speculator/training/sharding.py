"""FSDP for the speculator (`--fsdp`), its parameters, gradients and optimizer state split across the processes, and
for the frozen base model (`--fsdp-base`) while it computes the targets.

`fully_shard` (FSDP2) keeps 1/N of every parameter on each of N processes, with its gradient and its AdamW moments;
a forward gathers the whole parameters for the time of the computation, and a backward reduce-scatters the
gradients, averaged as DDP averages them, so a step computes what the DDP step computes. It runs on CPU with gloo as
on GPUs with NCCL. Untied, each head's embedding, projection and output layer is an FSDP unit of its own, so that
only one layer's whole weights exist at a time; tied heads share those tensors, which units may not, and the
speculator (then about one head's size) is a single unit.

The base model only runs forward, to compute the targets: sharded, each of its decoder layers is a unit, gathered for
its own forward only, so a process never holds more than its shard and one layer of it. All processes then compute
every target batch together, on the same inputs (a sharded forward needs every process), where the unsharded base
splits the batches among them.

Checkpoints hold full state dicts, gathered and written by the main process in the same layout as any run's (the
weights loadable with `from_pretrained`, the optimizer beside them). Every process reads the checkpoint and keeps its
own shard. The final speculator is saved once, whole.
"""

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ..models.modeling_mlp_speculator import MLPSpeculatorPreTrainedModel

try:  # public from torch 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - torch < 2.6 is below the supported range
    from torch.distributed._composable.fsdp import fully_shard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard(speculator: MLPSpeculatorPreTrainedModel) -> MLPSpeculatorPreTrainedModel:
    """Shards `speculator` in place across the default process group; it stays the same object (and class family)."""
    heads = speculator.speculator
    if not speculator.config.tie_weights:
        for layers in (heads.emb, heads.proj, heads.head):
            for layer in layers:
                fully_shard(layer)
    fully_shard(speculator)
    return speculator


def shard_base(base):
    """Shards the frozen `base` in place: each decoder layer (the model's `_no_split_modules`) a unit, then the rest."""
    layers = set(getattr(base, "_no_split_modules", None) or [])
    for module in list(base.modules())[1:]:
        if type(module).__name__ in layers:
            fully_shard(module)
    fully_shard(base)
    return base


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` whole: gathered from every process if it is a shard (then every process must call it, in turn)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gathered(speculator, optimizer=None):
    """
    The whole speculator as a plain model, and the optimizer's full state dict, on the main process (`None`, `None`
    elsewhere). Every process must call it: gathering is collective.
    """
    weights = get_model_state_dict(speculator, options=FULL)
    state = None if optimizer is None else get_optimizer_state_dict(speculator, optimizer, options=FULL)
    if torch.distributed.get_rank() != 0:
        return None, None
    whole = MLPSpeculatorPreTrainedModel(speculator.config)
    whole.load_state_dict(weights)
    return whole, state


def restore(speculator, optimizer, weights: dict, optimizer_state: dict) -> None:
    """Loads full state dicts (`gathered`'s, as a checkpoint holds them) into the sharded speculator and optimizer."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(speculator, weights, options=options)
    set_optimizer_state_dict(speculator, optimizer, optimizer_state, options=options)
