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

The kernels are private PyTorch ops (`torch.ops.mkldnn._reorder_linear_weight` and `_linear_pointwise`), which any
torch release may change or drop. So nothing here trusts them: packing is used only where both ops exist, and only for
a model on which a probe saw packed and plain forwards agree (`packed_matches_plain`). Where an op is missing, raises
or disagrees, one INFO line says so and decoding runs on the plain weights, on any torch.
"""

import contextlib
import statistics
import time
import weakref

import torch
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)


def _find_ops():
    """The namespace of the private oneDNN ops, or None where this torch build lacks either of them."""
    try:
        ops = torch.ops.mkldnn
        found = torch.backends.mkldnn.is_available() and all(
            hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
        )
    except Exception:  # a torch that reorganised its op registry
        return None
    return ops if found else None


OPS = _find_ops()
# Largest difference between packed and plain logits, relative to the largest plain logit, that counts as agreement:
# fp32 kernels that sum in another order differ by 3e-6 to 2e-5 of it (measured on SmolLM2-135M).
TOLERANCE = 1e-4

# id(weight) -> (weak reference to the weight, its version, its dtype, packed copy): dropped with the weight.
_PACKED: dict[int, tuple] = {}
# model -> {batch bucket: whether packed verification measured faster}; weakly keyed, so that a new model never
# inherits the verdict of a freed one that lived at the same address.
_PAYS = weakref.WeakKeyDictionary()
# model -> whether its packed and plain forwards agreed (`packed_matches_plain`, asked once per model).
_AGREES = weakref.WeakKeyDictionary()


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies with a oneDNN-packed copy of its weight (only inside `packed_weights`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return OPS._linear_pointwise(input, self.packed_weight, self.bias, "none", [], "")


def _packable(model: nn.Module) -> bool:
    """Whether `model` is one that packing is meant for (its ops aside): fp32 weights on the CPU."""
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and not param.is_inference()  # inference tensors keep no version counter to tell a stale copy by
    )


def _packed_copy(weight: torch.Tensor) -> torch.Tensor:
    key = id(weight)
    entry = _PACKED.get(key)
    if entry is None or entry[0]() is not weight or entry[1] != weight._version or entry[2] != weight.dtype:
        with torch.no_grad():
            packed = OPS._reorder_linear_weight(weight.detach(), None)
        entry = (weakref.ref(weight, lambda _: _PACKED.pop(key, None)), weight._version, weight.dtype, packed)
        _PACKED[key] = entry
    return entry[3]


@contextlib.contextmanager
def packed_weights(model: nn.Module, enabled: bool = True):
    """Inside, `model`'s `nn.Linear`s multiply with packed weights (see the module docstring), if `enabled`."""
    linears = [m for m in model.modules() if type(m) is nn.Linear] if enabled and OPS and _packable(model) else []
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
def packed_matches_plain(model: nn.Module, inputs: torch.LongTensor | None = None) -> bool:
    """
    Whether `model` may run on packed weights here: it is an fp32 CPU model, both ops exist, and its logits over
    `inputs` (random tokens if not given) agree packed and plain within `TOLERANCE`. Where the model is one for packing
    but an op is missing, raises or disagrees, logs why on one INFO line and returns False.
    """
    if not _packable(model):
        return False
    if OPS is None:
        logger.info(f"torch {torch.__version__} has no oneDNN packed-linear ops: decoding on the plain weights.")
        return False
    if inputs is None:
        vocab = model.config.get_text_config().vocab_size
        inputs = torch.randint(vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    try:
        plain = model(inputs, use_cache=False).logits
        with packed_weights(model):
            packed = model(inputs, use_cache=False).logits
    except Exception as error:  # a private op may fail in any way: none of it may reach the user
        failure = f"{type(error).__name__}: {error}"
        logger.info(f"Packed oneDNN weights failed here ({failure}): decoding on the plain weights.")
        return False
    difference = float((packed - plain).abs().max() / plain.abs().max().clamp(min=1e-12))
    if not difference <= TOLERANCE:  # NaN included
        logger.info(
            f"Packed oneDNN weights disagree with the plain ones here (largest difference {difference:.2g} of the "
            f"largest logit, more than {TOLERANCE:g}): decoding on the plain weights."
        )
        return False
    return True


def _agrees(model: nn.Module) -> bool:
    """`packed_matches_plain(model)`, asked once per model (for speculative `generate()` and `fast_cpu_decoding`)."""
    if model not in _AGREES:
        _AGREES[model] = packed_matches_plain(model)
    return _AGREES[model]


@torch.no_grad()
def packing_pays(model: nn.Module, batch_size: int, max_new_tokens: int, repeats: int = 3) -> bool:
    """
    Whether packed weights make `model`'s forward over 1 and over `max_new_tokens` tokens per row faster, at this
    batch size (its power-of-two bucket), having first checked that they compute what the plain ones do
    (`packed_matches_plain`). Measured once per process, on forwards of random tokens, plain and packed taking turns.
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
        verdicts[key] = _agrees(model)
        if verdicts[key]:
            with packed_weights(model):  # packs now (once per weight), so that no timing below includes packing
                pass
            times = {False: [], True: []}
            for _ in range(repeats):
                for packed in (False, True):
                    with packed_weights(model, packed):
                        start = time.perf_counter()
                        for x in inputs:
                            model(x, use_cache=False)
                        times[packed].append(time.perf_counter() - start)
            verdicts[key] = statistics.median(times[True]) < statistics.median(times[False])
            logger.info(
                f"Packed weights {'are' if verdicts[key] else 'are not'} faster at batch {batch_size}: "
                f"{statistics.median(times[True]):.4f} s against {statistics.median(times[False]):.4f} s."
            )
    return verdicts[key]


@contextlib.contextmanager
def fast_cpu_decoding(model: nn.Module):
    """
    The fast CPU path for plain decoding, without a speculator: inside, an fp32 CPU `model` multiplies with
    oneDNN-packed weights, as speculative `generate()` does by itself, where a probe saw packed and plain forwards
    agree (once per model; elsewhere, or on another device or dtype, nothing changes). On leaving, the model is as it
    was; packed copies are kept for the next time and remade for any weight that changed, so they are never stale.

    ```python
    >>> from hf_mlp_speculator import fast_cpu_decoding
    >>> with fast_cpu_decoding(model):
    ...     output = model.generate(input_ids, max_new_tokens=128)
    ```
    """
    with packed_weights(model, _agrees(model)):
        yield model


def pack_linear_weights(model: nn.Module) -> nn.Module:
    """
    Makes every `nn.Linear` of a CPU fp32 `model` a `PackedLinear` for good, in place; for a model that only runs
    forward from now on, such as the trainer's frozen base (check `packed_matches_plain(model)` first). Its packed
    copies are not remade if the weights change: `unpack_linear_weights` first. Returns `model`.
    """
    if not (OPS and _packable(model)):
        raise ValueError(
            "pack_linear_weights is for fp32 CPU models on a PyTorch build with oneDNN's packed-linear ops; leave the "
            "model unpacked (speculative generate() packs by itself where it measures faster)."
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
