"""Pre-packed oneDNN weights for `nn.Linear` on CPU, so that verifying k+1 tokens costs about as much as one.

A speculative step runs the verifier on k+1 tokens. On CPU, PyTorch's default matmul (MKL) costs nearly k+1 times a
one-token step for these short inputs, which eats the whole gain of speculation. oneDNN with weights reordered once
into its blocked layout reads each weight once per call and is almost flat from 1 to 8 rows.

The packed copy is made from the weights at the time of the call: run it after loading, for inference only (the
kernel has no backward). The parameters stay in place, so `state_dict`, `save_pretrained` and tied weights are
unaffected; `unpack_linear_weights` goes back to `nn.Linear`.
"""

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies with a oneDNN-packed copy of its weight (see the module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(input, self.packed_weight, self.bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> nn.Module:
    """Makes every `nn.Linear` of a CPU `model` a `PackedLinear`, in place. Returns `model`."""
    if not torch.backends.mkldnn.is_available():
        raise ValueError("pack_linear_weights needs a PyTorch build with oneDNN (mkldnn); this one has none.")
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, PackedLinear):
            if module.weight.device.type != "cpu":
                raise ValueError(f"pack_linear_weights is for CPU models, but {name} is on {module.weight.device}.")
            with torch.no_grad():
                module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            module.__class__ = PackedLinear
    return model


def unpack_linear_weights(model: nn.Module) -> nn.Module:
    """Turns every `PackedLinear` of `model` back into a plain `nn.Linear`, in place. Returns `model`."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            del module.packed_weight
            module.__class__ = nn.Linear
    return model
