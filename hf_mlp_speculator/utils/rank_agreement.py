"""Every rank of a tensor-parallel verifier takes the same drafting decision each step: its first rank's.

Under tensor parallelism every rank runs the same `generate()`, and the verifier's collectives need the same shapes on
all of them. Drafts are the same everywhere by construction (each rank holds the whole speculator, and the verifier's
hidden states and logits come out of its all-reduces the same on every rank), but what the controller decides from
its own rank's timings is not: the depth, where a chain ends, the seed of keyed sampling. Those few integers are
broadcast from the group's first rank, once per decision.
"""

import torch
import torch.distributed as dist


class RankAgreement:
    """Broadcasts decisions over a verifier's tensor-parallel group; passes them through for any other verifier."""

    def __init__(self, group=None):
        self.group = group
        if group is not None:
            self.source = dist.get_global_rank(group, 0)
            # NCCL moves CUDA tensors only; gloo, CPU ones.
            cuda = dist.get_backend(group) == "nccl"
            self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    @classmethod
    def for_model(cls, model) -> "RankAgreement":
        """The agreement over `model`'s tensor-parallel group (transformers' `tp_plan` or `DistributedConfig`)."""
        mesh = getattr(model, "_device_mesh", None)
        if (getattr(model, "_tp_size", None) or 1) < 2 or mesh is None or not dist.is_initialized():
            return cls()
        if mesh.ndim > 1:  # newer releases keep one mesh of several dimensions, tensor parallelism's named "tp"
            mesh = mesh["tp"]
        return cls(mesh.get_group())

    @property
    def active(self) -> bool:
        return self.group is not None

    def decide(self, values: list[int]) -> list[int]:
        """The group's first rank's `values` (the same count of integers on every rank)."""
        if self.group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.broadcast(tensor, src=self.source, group=self.group)
        return tensor.tolist()
