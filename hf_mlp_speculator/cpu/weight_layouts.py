"""Three layouts of the same `nn.Linear` weights on CPU, used forward by forward wherever each measures fastest.

A speculative step runs the verifier on k+1 tokens, and a batch of b rows on b (k+1). For these short inputs the
cost of PyTorch's default matmul (MKL, which multiplies by the weight transposed) depends on the CPU and the row
count: on some CPUs it costs nearly k+1 times a one-token step, and at 4 rows or more it can cost twice what the
same product costs on the weight stored transposed, multiplied as it lies (measured on a Xeon without AMX,
2026-12-06). So each `nn.Linear` has three kinds of weights: `plain` (its own), `transposed` (a contiguous copy of
its transpose, through the same public `F.linear`) and `packed` (a copy reordered into oneDNN's blocked layout, almost
flat from 1 to 8 rows on some CPUs and slower than plain on others, such as a Xeon with AMX). No probe decides once:
`adaptive_weights(model)` times the model's own forwards, and each forward runs on the kind its shape's recent
forwards measured fastest (`WeightChoice`). Speculative `generate()` enters it by itself; `fast_cpu_decoding(model)`
(`fast_decoding.py`) is the same for plain decoding.

Inside, every `nn.Linear` of the model multiplies with one of its copies or its own weight, by turns; on leaving,
every one is a plain `nn.Linear` again, so the user's model is as it was: same classes, same parameters, `state_dict`,
tied weights, `.to(...)` and training all unaffected. The one lasting trace is memory: the copies are kept (as long
as the model lives) so that the next call need not make them again, which takes seconds, and a kind whose copy would
take more than its share of the memory available is left out (`kinds_that_fit`). A copy is remade whenever its weight
changed since it was made (an in-place update or `load_state_dict` bumps the weight's version counter; a
new tensor, dtype or device has another identity), so it is never stale.

The packed kernels are private PyTorch ops (`torch.ops.mkldnn._reorder_linear_weight` and `_linear_pointwise`), which
any torch release may change or drop. So nothing here trusts them: the packed kind is used only where both ops exist,
and only for a model on which a probe saw packed and plain forwards agree (`packed_matches_plain`). Where an op is
missing, raises or disagrees, one INFO line says so and the forwards choose between the other two kinds, on any torch.
"""

import contextlib
import math
import statistics
import time
import weakref
from collections import deque
from pathlib import Path

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

# Forwards of each kind a shape runs before the kinds are compared, and how many recent comparisons decide.
TRIALS, WINDOW = 3, 16
# One forward in this many, per shape, runs a kind other than the fastest (each in turn), so that a change of the
# machine shows.
EXPLORE_EVERY = 50


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies with a oneDNN-packed copy of its weight (inside `adaptive_weights` and
    `fixed_layout`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return OPS._linear_pointwise(input, self.packed_weight, self.bias, "none", [], "")


class TransposedLinear(nn.Linear):
    """An `nn.Linear` that multiplies with a contiguous copy of its weight's transpose (inside `adaptive_weights` and
    `fixed_layout`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # The transpose of the copy is a view with the weight's values: `F.linear` multiplies by the copy as it lies.
        return nn.functional.linear(input, self.transposed_weight.t(), self.bias)


# The kinds of weights, each with the class a linear takes to run on it and the attribute holding its copy.
LAYOUTS = {"plain": (nn.Linear, None), "transposed": (TransposedLinear, "transposed_weight"),
           "packed": (PackedLinear, "packed_weight")}  # fmt: skip


def _eligible(model: nn.Module) -> bool:
    """
    Whether `model` is one that the other kinds of weights are meant for (the packed ops aside): fp32 weights on the
    CPU, whole. A model that accelerate dispatched (`hf_device_map`: its hooks run the layers' own forwards, some
    weights offloaded) or that tensor parallelism split (each rank would choose its weights by its own timings) is left
    as it is.
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


def _restore(linears: list[nn.Linear]) -> None:
    """Makes every one of `linears` a plain `nn.Linear` again, holding no copy."""
    for module in linears:
        module.__class__ = nn.Linear
        for _, attribute in LAYOUTS.values():
            module.__dict__.pop(attribute, None)


@contextlib.contextmanager
def fixed_layout(model: nn.Module, kind: str):
    """
    Inside, every `nn.Linear` of `model` multiplies with its `kind` of weights (see `LAYOUTS`), whatever that measures:
    where `kind` is "plain", or not available (not an fp32 CPU model; "packed" on a torch without the ops), nothing
    changes; so too inside `adaptive_weights` of the same model, which keeps choosing.
    """
    layout, attribute = LAYOUTS[kind]
    weights = cpu_weights(model)
    available = attribute is not None and _eligible(model) and (kind != "packed" or OPS is not None)
    linears = [m for m in model.modules() if type(m) is nn.Linear] if available and not weights.active else []
    try:
        for module in linears:
            setattr(module, attribute, weights.copy(module.weight, kind))
            module.__class__ = layout
        yield model
    finally:
        _restore(linears)


@torch.no_grad()
def packed_matches_plain(model: nn.Module, inputs: torch.LongTensor | None = None) -> bool:
    """
    Whether `model` may run on packed weights here: it is an fp32 CPU model, both ops exist, and its logits over
    `inputs` (random tokens if not given) agree packed and plain within `TOLERANCE`. Where the model is one for packing
    but an op is missing, raises or disagrees, logs why on one INFO line and returns False.
    """
    if not _eligible(model):
        return False
    if OPS is None:
        logger.info(f"torch {torch.__version__} has no oneDNN packed-linear ops: no packed weights.")
        return False
    if inputs is None:
        vocab = model.config.get_text_config().vocab_size
        inputs = torch.randint(vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    try:
        plain = model(inputs, use_cache=False).logits
        with fixed_layout(model, "packed"):
            packed = model(inputs, use_cache=False).logits
    except Exception as error:  # a private op may fail in any way: none of it may reach the user
        failure = f"{type(error).__name__}: {error}"
        logger.info(f"Packed oneDNN weights failed here ({failure}): not using them.")
        return False
    difference = float((packed - plain).abs().max() / plain.abs().max().clamp(min=1e-12))
    if not difference <= TOLERANCE:  # NaN included
        logger.info(
            f"Packed oneDNN weights disagree with the plain ones here (largest difference {difference:.2g} of the "
            f"largest logit, more than {TOLERANCE:g}): not using them."
        )
        return False
    return True


class WeightChoice:
    """
    The kind of weights (`LAYOUTS`) for each forward of a model, from the model's own forwards of the same shape
    (`shape`). Each kind runs a first forward of a shape that is not counted (the first calls of a process or of a
    kernel pay one-time costs), then `TRIALS` that are, by turns; after that the fastest kind runs, and one forward in
    `EXPLORE_EVERY` another one (each in turn), so that a choice the real forwards show losing is undone.

    Which is fastest is read side by side: each time a shape's forward runs another kind than its previous one, the two
    make a ratio of their seconds, and the medians of the last `WINDOW` ratios of each pair of kinds decide: the kind
    whose medians against the others multiply to the smallest. Two neighbouring forwards share the machine's spell;
    each kind's best time over its own recent forwards does not, since a slower kind runs once in `EXPLORE_EVERY`
    (measured on a shared 2-core CPU: a slow spell of the plain weights against an old fast timing of the packed ones
    ran 16 forwards in a row on the packed weights, 27% slower).
    """

    def __init__(self, kinds: tuple[str, ...] = tuple(LAYOUTS)):
        self.kinds = kinds
        self.times = {}  # (batch bucket, tokens bucket) -> {kind: deque of seconds}
        self.ratios = {}  # (batch bucket, tokens bucket) -> {(kind, other kind): deque of their neighbours' ratios}
        self.previous = {}  # (batch bucket, tokens bucket) -> (kind, seconds) of its latest counted forward
        self.forwards = {}  # (batch bucket, tokens bucket) -> forwards run
        self.steady = True  # whether the latest forward ran on the kind that measured fastest (no trial, no exploring)

    @staticmethod
    def shape(input_ids: torch.Tensor) -> tuple[int, int]:
        """(batch bucket, tokens bucket): one token (a plain step), up to 8 (a step that verifies drafts: one
        verdict for all its depths, so that trying every kind costs a call few forwards), or more (a prefill)."""
        rows, tokens = (int(n) for n in input_ids.shape[:2])
        return 1 << max(0, rows - 1).bit_length(), 1 if tokens == 1 else max(8, 1 << (tokens - 1).bit_length())

    def fastest(self, shape) -> str:
        """The kind whose median ratios against the others multiply to the smallest (the first kind on a tie)."""
        score = dict.fromkeys(self.kinds, 0.0)
        for (kind, other), ratios in self.ratios.get(shape, {}).items():
            score[kind] += math.log(statistics.median(ratios))
            score[other] -= math.log(statistics.median(ratios))
        return min(self.kinds, key=score.__getitem__)

    def on_trial(self, shape) -> list[str]:
        """The kinds still short of their `TRIALS` counted forwards of `shape`."""
        times = self.times.get(shape, {})
        return [kind for kind in self.kinds if times.get(kind) is None or len(times[kind]) < TRIALS]

    def choose(self, shape) -> str:
        count = self.forwards[shape] = self.forwards.get(shape, 0) + 1
        short = self.on_trial(shape)
        exploring = count % EXPLORE_EVERY == 0 and len(self.kinds) > 1
        self.steady = not short and not exploring
        if short:  # the kinds still short of their trials, by turns
            return short[count % len(short)]
        fastest = self.fastest(shape)
        if not exploring:
            return fastest
        others = [kind for kind in self.kinds if kind != fastest]
        return others[count // EXPLORE_EVERY % len(others)]

    def chosen(self, shape) -> str | None:
        """The kind that `shape`'s forwards run now, or None while its kinds are still on trial."""
        return None if self.on_trial(shape) else self.fastest(shape)

    def record(self, shape, kind: str, seconds: float) -> None:
        times = self.times.setdefault(shape, dict.fromkeys(self.kinds))
        if times[kind] is None:  # this kind's first forward of the shape: one-time costs, not counted
            times[kind] = deque(maxlen=WINDOW)
            return
        times[kind].append(seconds)
        previous = self.previous.get(shape)
        if previous is not None and previous[0] != kind:
            # Kept under the pair in `kinds`' order, as the earlier kind's seconds over the later one's.
            (first, first_seconds), (second, second_seconds) = sorted(
                [previous, (kind, seconds)], key=lambda entry: self.kinds.index(entry[0])
            )
            pair = self.ratios.setdefault(shape, {}).setdefault((first, second), deque(maxlen=WINDOW))
            pair.append(max(first_seconds, 1e-9) / max(second_seconds, 1e-9))
        self.previous[shape] = (kind, seconds)

    def summary(self) -> dict:
        """{(batch bucket, tokens bucket): {kind: its fastest recent forward's seconds, or None}}."""
        return {shape: {kind: min(t[kind]) if t[kind] else None for kind in self.kinds}
                for shape, t in self.times.items()}  # fmt: skip


class CpuWeights:
    """
    What a model's forwards on CPU taught `adaptive_weights` and `fixed_layout`, kept on the model itself
    (`cpu_weights(model)`) so that its later calls start from there: whether its packed and plain forwards agree (asked
    once), each shape's `WeightChoice`, and the copies of its weights in the other layouts (packing takes seconds). It
    dies with the model; a copied or pickled model starts without it (the copy may live on another device).
    """

    def __init__(self):
        self.agrees = None  # `packed_matches_plain(model)`, once asked
        self.choice = None  # the `WeightChoice`, made once `agrees` tells which kinds there are
        self.copies = {}  # (kind, id(weight)) -> (weak reference to the weight, its version, its dtype, copy)
        self.active = False  # inside `adaptive_weights` now: an inner one leaves the choice to the outer

    def __deepcopy__(self, memo):
        return CpuWeights()

    def __reduce__(self):
        return CpuWeights, ()

    def reset(self) -> None:
        """Forgets the timings, the verdict and the copies: the next forwards measure again."""
        self.agrees, self.choice, self.copies = None, None, {}

    def drop(self, kind: str) -> None:
        """Frees the copies of `kind`."""
        self.copies = {key: entry for key, entry in self.copies.items() if key[0] != kind}

    def summary(self) -> dict:
        """`WeightChoice.summary()`, or nothing before the first forward chose."""
        return self.choice.summary() if self.choice else {}

    def copy(self, weight: torch.Tensor, kind: str) -> torch.Tensor:
        """The `kind` ("packed" or "transposed") copy of `weight`, remade whenever the weight changed since."""
        key, copies = (kind, id(weight)), self.copies
        entry = copies.get(key)
        if entry is None or entry[0]() is not weight or entry[1] != weight._version or entry[2] != weight.dtype:
            with torch.no_grad():
                weight_copy = (OPS._reorder_linear_weight(weight.detach(), None) if kind == "packed"
                               else weight.detach().t().contiguous())  # fmt: skip
            entry = (weakref.ref(weight, lambda _: copies.pop(key, None)), weight._version, weight.dtype, weight_copy)
            copies[key] = entry
        return entry[3]


def cpu_weights(model: nn.Module) -> CpuWeights:
    """`model`'s `CpuWeights`, made on first use."""
    weights = getattr(model, "_cpu_weights", None)
    if weights is None:
        weights = model._cpu_weights = CpuWeights()
    return weights


def available_memory() -> int | None:
    """
    Bytes of memory this process can still get: the smaller of Linux's MemAvailable and the room left under its
    cgroup's limit (a container's, which MemAvailable does not show), or None where neither says.
    """
    room = []
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        room += [int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            room.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(room) if room else None


def kinds_that_fit(linears: list[nn.Linear], kinds: list[str]) -> tuple[str, ...]:
    """
    `kinds` less those whose copies would not fit: each kind but plain holds a copy of every linear weight for the
    model's lifetime, and together the copies may take at most half the memory still available, in the order given.
    The kinds left out are named on one INFO line.
    """
    weights = {id(m.weight): m.weight for m in linears}.values()  # a tied weight is copied once
    size, free = sum(w.numel() * w.element_size() for w in weights), available_memory()
    budget = math.inf if free is None else free // 2
    fitting = [kind for number, kind in enumerate(kinds) if number * size <= budget]
    if len(fitting) < len(kinds):
        logger.info(
            f"Not using the {' and '.join(kinds[len(fitting):])} weights: a copy of the linear weights takes "
            f"{size / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB of memory is available."
        )
    return tuple(fitting)


@contextlib.contextmanager
def adaptive_weights(model: nn.Module):
    """
    Inside, each forward of an fp32 CPU `model` runs on the kind of weights (plain, transposed, or packed where the
    packed ops exist and agree with the plain weights, checked once per model) that its shape's recent forwards
    measured fastest (`WeightChoice`, kept for the model's lifetime); elsewhere nothing changes. On leaving, the model
    is as it was.
    """
    # Asked each time: the model may have moved to another device or dtype since it was last checked. Inside an
    # outer `adaptive_weights` of the same model, the outer one chooses.
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    weights = cpu_weights(model)
    if weights.active or not (linears and _eligible(model)):
        yield model
        return
    if weights.choice is None:
        # Memory first: the probe of the packed weights makes their copies.
        kinds = kinds_that_fit(linears, ["plain", "transposed", "packed"])
        if "packed" in kinds and weights.agrees is None:
            weights.agrees = packed_matches_plain(model)
        if not weights.agrees:
            weights.drop("packed")
        weights.choice = WeightChoice(tuple(kind for kind in kinds if kind != "packed" or weights.agrees))
    choice = weights.choice
    if len(choice.kinds) == 1:  # nothing to choose
        yield model
        return
    state = {}

    def set_kind(kind: str) -> None:
        layout = LAYOUTS[kind][0]
        if type(linears[0]) is not layout:
            for module in linears:
                module.__class__ = layout

    # A compiled forward (the verifier's compiled steps, `model.compile()`) traces the model's hooks: there they do
    # nothing, and the graph keeps the weights it was traced with, of whichever kind, with no choice to make per call.
    def before(module, args, kwargs):
        if torch.compiler.is_compiling():
            return
        inputs = kwargs.get("input_ids", args[0] if args else None)
        inputs = inputs if inputs is not None else kwargs.get("inputs_embeds")
        shape = WeightChoice.shape(inputs)
        kind = choice.choose(shape)
        set_kind(kind)
        state["pending"] = (shape, kind, time.perf_counter())

    def after(module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return
        pending = state.pop("pending", None)
        if pending is None:  # a forward whose `before` ran compiled: nothing to time
            return
        shape, kind, start = pending
        choice.record(shape, kind, time.perf_counter() - start)

    hooks = []
    weights.active = True
    try:
        for module in linears:
            for kind in choice.kinds[1:]:
                setattr(module, LAYOUTS[kind][1], weights.copy(module.weight, kind))
        hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
                 model.register_forward_hook(after, with_kwargs=True)]  # fmt: skip
        yield model
    finally:
        weights.active = False
        for hook in hooks:
            hook.remove()
        _restore(linears)


def steady_forward(model: nn.Module) -> bool:
    """Whether `model`'s latest forward ran as its later ones will: not one that tried or re-measured a kind of
    weights that is not the fastest (a cost model timing it would see the slower kind's time)."""
    choice = cpu_weights(model).choice
    return choice is None or choice.steady
