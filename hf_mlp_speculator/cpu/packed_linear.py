"""Pre-packed oneDNN weights for `nn.Linear` on CPU, used forward by forward wherever they measure faster.

A speculative step runs the verifier on k+1 tokens. On some CPUs, PyTorch's default matmul (MKL) costs nearly k+1 times
a one-token step for these short inputs, and oneDNN with weights reordered into its blocked layout reads each weight
once per call, almost flat from 1 to 8 rows; on others (a Xeon with AMX, measured 2026-12-04) the packed path is
slower than the plain one. No probe decides that once: `adaptive_packing(model)` times the model's own forwards, and
each forward runs on the weights, packed or plain, that its shape's recent forwards measured faster
(`PackingChoice`). Speculative `generate()` enters it by itself; `fast_cpu_decoding(model)` is the same for plain
decoding.

Inside, every `nn.Linear` of the model multiplies with a packed copy or its own weight, by turns; on leaving, every one
is a plain `nn.Linear` again, so the user's model is as it was: same classes, same parameters, `state_dict`, tied
weights, `.to(...)` and training all unaffected. The one lasting trace is memory: the packed copies are kept (as long
as the model lives) so that the next call need not pack again, which takes seconds. A copy is remade whenever its
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
from collections import deque

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

# Forwards of each kind a shape runs before the two are compared, and how many recent comparisons decide.
TRIALS, WINDOW = 3, 16
# One forward in this many, per shape, runs the kind that measured slower, so that a change of the machine shows.
EXPLORE_EVERY = 50


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies with a oneDNN-packed copy of its weight (only inside `packed_weights`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return OPS._linear_pointwise(input, self.packed_weight, self.bias, "none", [], "")


def _packable(model: nn.Module) -> bool:
    """
    Whether `model` is one that packing is meant for (its ops aside): fp32 weights on the CPU, whole. A model that
    accelerate dispatched (`hf_device_map`: its hooks run the layers' own forwards, some weights offloaded) or that
    tensor parallelism split (each rank would choose its weights by its own timings) is left as it is.
    """
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and not param.is_inference()  # inference tensors keep no version counter to tell a stale copy by
        and not getattr(model, "hf_device_map", None)
        and (getattr(model, "_tp_size", None) or 1) < 2
    )


@contextlib.contextmanager
def packed_weights(model: nn.Module, enabled: bool = True):
    """Inside, `model`'s `nn.Linear`s multiply with packed weights (see the module docstring), if `enabled`."""
    linears = [m for m in model.modules() if type(m) is nn.Linear] if enabled and OPS and _packable(model) else []
    weights = cpu_weights(model)
    try:
        for module in linears:
            module.packed_weight = weights.packed_copy(module.weight)
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


class PackingChoice:
    """
    Packed or plain, per forward of a model, from the model's own forwards of the same shape (`shape`). Each kind runs
    a first forward of a shape that is not counted (the first calls of a process or of a kernel pay one-time costs),
    then `TRIALS` that are, by turns; after that the faster kind runs, and one forward in `EXPLORE_EVERY` the slower
    one, so that a choice the real forwards show losing is undone.

    Which is faster is read side by side: each time a shape's forward runs the other kind than its previous one, the
    two make a ratio (packed seconds over plain seconds), and the median of the last `WINDOW` ratios decides. Two
    neighbouring forwards share the machine's spell; each kind's best time over its own recent forwards does not,
    since the slower kind runs once in `EXPLORE_EVERY` (measured on a shared 2-core CPU: a slow spell of the plain
    weights against an old fast timing of the packed ones ran 16 forwards in a row on the packed weights, 27% slower).
    """

    def __init__(self):
        self.times = {}  # (batch bucket, tokens bucket) -> {packed: deque of seconds}
        self.ratios = {}  # (batch bucket, tokens bucket) -> deque of packed / plain seconds of neighbouring forwards
        self.previous = {}  # (batch bucket, tokens bucket) -> (packed, seconds) of its latest counted forward
        self.forwards = {}  # (batch bucket, tokens bucket) -> forwards run
        self.steady = True  # whether the latest forward ran on the kind that measured faster (no trial, no exploring)

    @staticmethod
    def shape(input_ids: torch.Tensor) -> tuple[int, int]:
        """(batch bucket, tokens bucket): one token (a plain step), up to 8 (a step that verifies drafts: one
        verdict for all its depths, so that trying both kinds costs a call few forwards), or more (a prefill)."""
        rows, tokens = (int(n) for n in input_ids.shape[:2])
        return 1 << max(0, rows - 1).bit_length(), 1 if tokens == 1 else max(8, 1 << (tokens - 1).bit_length())

    def choose(self, shape) -> bool:
        times = self.times.setdefault(shape, {False: None, True: None})
        count = self.forwards[shape] = self.forwards.get(shape, 0) + 1
        short = [packed for packed in (False, True) if times[packed] is None or len(times[packed]) < TRIALS]
        self.steady = not short and count % EXPLORE_EVERY != 0
        if short or not self.ratios.get(shape):  # both kinds, by turns, until each has its trials and a ratio
            return short[0] if len(short) == 1 else bool(count % 2)
        faster = statistics.median(self.ratios[shape]) < 1
        return faster != (count % EXPLORE_EVERY == 0)

    def record(self, shape, packed: bool, seconds: float) -> None:
        times = self.times.setdefault(shape, {False: None, True: None})
        if times[packed] is None:  # this kind's first forward of the shape: one-time costs, not counted
            times[packed] = deque(maxlen=WINDOW)
            return
        times[packed].append(seconds)
        previous = self.previous.get(shape)
        if previous is not None and previous[0] != packed:
            plain, packed_seconds = (previous[1], seconds) if packed else (seconds, previous[1])
            self.ratios.setdefault(shape, deque(maxlen=WINDOW)).append(packed_seconds / max(plain, 1e-9))
        self.previous[shape] = (packed, seconds)

    def summary(self) -> dict:
        """{(batch bucket, tokens bucket): (plain seconds, packed seconds)}: each kind's fastest recent forward."""
        return {shape: tuple(min(t[packed]) if t[packed] else None for packed in (False, True))
                for shape, t in self.times.items()}  # fmt: skip


class CpuWeights:
    """
    What a model's forwards on CPU taught `adaptive_packing` and `packed_weights`, kept on the model itself
    (`cpu_weights(model)`) so that its later calls start from there: whether its packed and plain forwards agree (asked
    once), each shape's `PackingChoice`, and the packed copies of its weights (packing takes seconds). It dies with the
    model; a copied or pickled model starts without it (the copy may live on another device).
    """

    def __init__(self):
        self.agrees = None  # `packed_matches_plain(model)`, once asked
        self.choice = PackingChoice()
        self.copies = {}  # id(weight) -> (weak reference to the weight, its version, its dtype, packed copy)
        self.active = False  # inside `adaptive_packing` now: an inner one leaves the choice to the outer

    def __deepcopy__(self, memo):
        return CpuWeights()

    def __reduce__(self):
        return CpuWeights, ()

    def reset(self) -> None:
        """Forgets the timings, the verdict and the packed copies: the next forwards measure again."""
        self.agrees, self.choice, self.copies = None, PackingChoice(), {}

    def packed_copy(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of `weight`, remade whenever the weight changed since it was packed."""
        key, copies = id(weight), self.copies
        entry = copies.get(key)
        if entry is None or entry[0]() is not weight or entry[1] != weight._version or entry[2] != weight.dtype:
            with torch.no_grad():
                packed = OPS._reorder_linear_weight(weight.detach(), None)
            entry = (weakref.ref(weight, lambda _: copies.pop(key, None)), weight._version, weight.dtype, packed)
            copies[key] = entry
        return entry[3]


def cpu_weights(model: nn.Module) -> CpuWeights:
    """`model`'s `CpuWeights`, made on first use."""
    weights = getattr(model, "_cpu_weights", None)
    if weights is None:
        weights = model._cpu_weights = CpuWeights()
    return weights


@contextlib.contextmanager
def adaptive_packing(model: nn.Module):
    """
    Inside, each forward of an fp32 CPU `model` runs on packed or plain weights, whichever its shape's recent forwards
    measured faster (`PackingChoice`, kept for the model's lifetime); elsewhere, or where packing is unavailable or
    disagrees with the plain weights (checked once per model), nothing changes. On leaving, the model is as it was.
    """
    # Asked each time: the model may have moved to another device or dtype since it was last checked. Inside an
    # outer `adaptive_packing` of the same model, the outer one chooses.
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    weights = cpu_weights(model)
    if weights.active or not (linears and _packable(model)):
        yield model
        return
    if weights.agrees is None:
        weights.agrees = packed_matches_plain(model)
    if not weights.agrees:
        yield model
        return
    choice = weights.choice
    state = {}

    def set_packed(packed: bool) -> None:
        if packed != (type(linears[0]) is PackedLinear):
            for module in linears:
                module.__class__ = PackedLinear if packed else nn.Linear

    # A compiled forward (the verifier's compiled steps, `model.compile()`) traces the model's hooks: there they do
    # nothing, and the graph keeps the weights it was traced with, plain or packed, with no choice to make per call.
    def before(module, args, kwargs):
        if torch.compiler.is_compiling():
            return
        inputs = kwargs.get("input_ids", args[0] if args else None)
        inputs = inputs if inputs is not None else kwargs.get("inputs_embeds")
        state["shape"] = shape = PackingChoice.shape(inputs)
        set_packed(choice.choose(shape))
        state["start"] = time.perf_counter()

    def after(module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return
        choice.record(state["shape"], type(linears[0]) is PackedLinear, time.perf_counter() - state["start"])

    hooks = []
    weights.active = True
    try:
        for module in linears:
            module.packed_weight = weights.packed_copy(module.weight)
        hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
                 model.register_forward_hook(after, with_kwargs=True)]  # fmt: skip
        yield model
    finally:
        weights.active = False
        for hook in hooks:
            hook.remove()
        set_packed(False)
        for module in linears:
            module.__dict__.pop("packed_weight", None)


def steady_forward(model: nn.Module) -> bool:
    """Whether `model`'s latest forward ran as its later ones will: not one that tried or re-measured the kind of
    weights that is not the faster (a cost model timing it would see the slower kind's time)."""
    return cpu_weights(model).choice.steady


@contextlib.contextmanager
def fast_cpu_decoding(model: nn.Module):
    """
    Plain decoding on the faster of packed and plain weights, forward by forward (`adaptive_packing`), as speculative
    `generate()` does by itself: for an fp32 CPU `model` whose packed and plain forwards agree (checked once per
    model); elsewhere nothing changes. It is never slower than the plain weights for long: a shape's first forwards
    try both kinds, and then the faster runs. On leaving, the model is as it was.

    ```python
    >>> from hf_mlp_speculator import fast_cpu_decoding
    >>> with fast_cpu_decoding(model):
    ...     output = model.generate(input_ids, max_new_tokens=128)
    ```
    """
    with adaptive_packing(model):
        yield model
