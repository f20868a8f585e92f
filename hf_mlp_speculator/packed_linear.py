"""Pre-packed oneDNN weights for `nn.Linear` on CPU, so that verifying k+1 tokens costs about as much as one.

A speculative step runs the verifier on k+1 tokens. On CPU, PyTorch's default matmul (MKL) costs nearly k+1 times a
one-token step for these short inputs, which eats the whole gain of speculation. oneDNN with weights reordered into
its blocked layout reads each weight once per call and is almost flat from 1 to 8 rows.

`packed_weights(model)` is what speculative `generate()` enters on its own, where a probe measured it faster
(`packing_pays`). It is a context: inside, every `nn.Linear` of the model multiplies with a packed copy; on leaving,
every one is a plain `nn.Linear` again, so the user's model is as it was: same classes, same parameters, `state_dict`,
tied weights, `.to(...)` and training all unaffected. The one lasting trace is memory: the packed copies are kept (as
long as the model lives) so that the next call need not pack again, which takes seconds. A copy is remade whenever its
weight changed since it was packed (an in-place update or `load_state_dict` bumps the weight's version counter; a new
tensor, dtype or device has another identity), so it is never stale.

The kernel is a private PyTorch op (`torch.ops.mkldnn._linear_pointwise`), which is why pyproject.toml caps torch at
the releases the tests ran on; where the op is missing or refuses a weight, nothing is packed and decoding runs on
the plain weights.
"""

import contextlib
import statistics
import time
import weakref

import torch
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

# id(weight) -> (weak reference to the weight, its version, its dtype, packed copy): dropped with the weight.
_PACKED: dict[int, tuple] = {}
# model -> {batch bucket: whether packed verification measured faster}; weakly keyed, so that a new model never
# inherits the verdict of a freed one that lived at the same address.
_PAYS = weakref.WeakKeyDictionary()


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies with a oneDNN-packed copy of its weight (only inside `packed_weights`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(input, self.packed_weight, self.bias, "none", [], "")


def _packable(model: nn.Module) -> bool:
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and not param.is_inference()  # inference tensors keep no version counter to tell a stale copy by
    )


def _packed_copy(weight: torch.Tensor) -> torch.Tensor:
    key = id(weight)
    entry = _PACKED.get(key)
    if entry is None or entry[0]() is not weight or entry[1] != weight._version or entry[2] != weight.dtype:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        entry = (weakref.ref(weight, lambda _: _PACKED.pop(key, None)), weight._version, weight.dtype, packed)
        _PACKED[key] = entry
    return entry[3]


@contextlib.contextmanager
def packed_weights(model: nn.Module, enabled: bool = True):
    """Inside, `model`'s `nn.Linear`s multiply with packed weights (see the module docstring), if `enabled`."""
    linears = [m for m in model.modules() if type(m) is nn.Linear] if enabled and _packable(model) else []
    try:
        for module in linears:
            module.packed_weight = _packed_copy(module.weight)
            module.__class__ = PackedLinear
        yield model
    finally:
        for module in linears:
            if type(module) is PackedLinear:
                module.__class__ = nn.Linear
            module.__dict__.pop("packed_weight", None)


@torch.no_grad()
def packing_pays(model: nn.Module, batch_size: int, max_new_tokens: int, repeats: int = 3) -> bool:
    """
    Whether packed weights make `model`'s forward over 1 and over `max_new_tokens` tokens per row faster, at this
    batch size (its power-of-two bucket). Measured once per process, on forwards of random tokens, plain and packed
    taking turns; the first call also pays the packing.
    """
    if not _packable(model):
        return False
    from .cost_model import batch_bucket

    verdicts = _PAYS.setdefault(model, {})
    key = batch_bucket(batch_size)
    if key not in verdicts:
        vocab = model.config.get_text_config().vocab_size
        generator = torch.Generator().manual_seed(0)
        inputs = [torch.randint(vocab, (batch_size, m), generator=generator) for m in (1, max_new_tokens)]
        times = {False: [], True: []}
        try:
            with packed_weights(model):  # packs now, so that the timings below do not include packing
                pass
            for _ in range(repeats):
                for packed in (False, True):
                    with packed_weights(model, packed):
                        start = time.perf_counter()
                        for x in inputs:
                            model(x, use_cache=False)
                        times[packed].append(time.perf_counter() - start)
        except RuntimeError as error:  # a oneDNN build that refuses this weight: stay on the plain weights
            logger.warning(f"Packed oneDNN weights are unavailable here ({error}); verifying with the plain weights.")
            verdicts[key] = False
            return False
        verdicts[key] = statistics.median(times[True]) < statistics.median(times[False])
        logger.info(
            f"Packed weights {'are' if verdicts[key] else 'are not'} faster at batch {batch_size}: "
            f"{statistics.median(times[True]):.4f} s against {statistics.median(times[False]):.4f} s."
        )
    return verdicts[key]


def pack_linear_weights(model: nn.Module) -> nn.Module:
    """
    Makes every `nn.Linear` of a CPU fp32 `model` a `PackedLinear` for good, in place; for a model that only runs
    forward from now on, such as the trainer's frozen base. Its packed copies are not remade if the weights change:
    `unpack_linear_weights` first. Returns `model`.
    """
    if not _packable(model):
        raise ValueError(
            "pack_linear_weights is for fp32 CPU models on a PyTorch build with oneDNN (mkldnn); leave the model "
            "unpacked (speculative generate() packs by itself where it measures faster)."
        )
    for module in model.modules():
        if type(module) is nn.Linear:
            module.packed_weight = _packed_copy(module.weight)
            module.__class__ = PackedLinear
    return model


def unpack_linear_weights(model: nn.Module) -> nn.Module:
    """Turns every `PackedLinear` of `model` back into a plain `nn.Linear`, in place. Returns `model`."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.__dict__.pop("packed_weight", None)
            module.__class__ = nn.Linear
    return model
