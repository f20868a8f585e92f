"""Every private transformers API the package touches, in one place, so that a release that changes one fails here.

transformers gives speculative decoding no public plug-in point, and its cache layers' internals change between
releases. Each touchpoint is below, with the releases it was seen to change in, and `tests/test_transformers_hooks.py`
checks each one's behaviour (not only its signature) on every stack CI runs (transformers 5.13, 5.17 and 5.25):

- `GenerationMixin.generate`'s `custom_generate` slot and the decoding-method convention of `_sample`, through which
  the package's loop runs (`mixin`); `_prepare_generation_config`, to see a call's merged config first;
- `GenerationMixin._get_candidate_generator` and `CandidateGenerator.requires_model_outputs`, the way into
  transformers' assisted decoding (`candidate_generator`, which also implements `get_candidates`' keyword arguments
  and `num_drafting_tokens`, read by 5.25's cache rollback);
- the cache under two names: forwards take it as `cache` from 5.24 on, as `past_key_values` before, and return it and
  hand it to `custom_generate` under the same names (`cache_kwargs`, `output_cache`, `pop_prepared_cache`,
  `GENERATE_OUTPUT_CACHE`);
- `GenerationMixin._valid_auto_compile_criteria` and `get_compiled_call`, to compile decoding steps where plain
  `generate()` would (`compiled_call`);
- cache layers: `batch_select_indices` and `device` per layer (`select_rows`), `DynamicCache.crop(-n)` (before
  5.17 `crop(0)` keeps nothing, so a rewind of 0 never calls it),
  `StaticLayer.cumulative_length` (a device tensor: rewound without reading the device), the layers' `keys`/`values`
  (moved together by `gather_slots`), `is_sliding`, and whether sliding layers keep what they drop
  (`DynamicSlidingWindowLayer.activate_past_recording`, 5.17 on: before, they refuse `crop` past their window).
"""

import inspect

import transformers
from packaging import version
from transformers import DynamicCache, GenerationMixin
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerateDecoderOnlyOutput

# transformers' own methods that `mixin` replaces, kept to fall back on.
STOCK = {name: getattr(GenerationMixin, name) for name in ("generate", "_get_candidate_generator")}

# The oldest and the newest transformers releases the test suite ran on (.ci/run runs both; pyproject.toml requires the
# oldest). Later releases are accepted as long as the hooks below are as this package knows them.
OLDEST_TRANSFORMERS, NEWEST_TESTED_TRANSFORMERS = "5.13.0", "5.25.0"

# The field of `generate()`'s output that returns the cache.
GENERATE_OUTPUT_CACHE = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
# Whether this transformers' sliding-window cache layers keep what they drop, so that assisted decoding can crop them.
REWINDS_SLIDING_LAYERS = hasattr(DynamicSlidingWindowLayer, "activate_past_recording")


def check_transformers_hooks() -> None:
    """
    Raises an `ImportError` naming the supported range when transformers is older than it, or when one of the private
    hooks this package relies on is not as in the tested releases, so that a changed transformers fails at import
    rather than midway through generate().
    """
    supported = f"transformers>={OLDEST_TRANSFORMERS}"
    if version.parse(transformers.__version__) < version.parse(OLDEST_TRANSFORMERS):
        raise ImportError(
            f"hf_mlp_speculator supports {supported}, but transformers {transformers.__version__} is installed. "
            f"Upgrade it: pip install '{supported}'."
        )

    def parameters(function):
        return list(inspect.signature(function).parameters)

    hooks = {
        "GenerationMixin._get_candidate_generator (overridden with the same positional parameters)": (
            parameters(STOCK["_get_candidate_generator"]),
            ["self", "generation_config", "input_ids", "inputs_tensor", "logits_processor", "model_kwargs",
             "assistant_model", "target_tokenizer", "assistant_tokenizer"],
        ),  # fmt: skip
        "GenerationMixin.generate's custom_generate argument (batches and trees run there)": (
            "custom_generate" in parameters(STOCK["generate"]),
            True,
        ),
        # generate() calls a custom_generate callable as it calls its own decoding methods, such as _sample.
        "the decoding-method convention of GenerationMixin._sample": (
            parameters(GenerationMixin._sample)[:5],
            ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config"],
        ),
        "GenerationMixin._prepare_generation_config (merges a call's generation config)": (
            parameters(GenerationMixin._prepare_generation_config)[:2],
            ["self", "generation_config"],
        ),
        "CandidateGenerator.requires_model_outputs (drafts read the verifier's hidden states)": (
            "requires_model_outputs" in vars(CandidateGenerator),
            True,
        ),
    }
    changed = [name for name, (found, expected) in hooks.items() if found != expected]
    if changed:
        raise ImportError(
            f"hf_mlp_speculator supports {supported} as far as its private hooks stay as they were, but transformers "
            f"{transformers.__version__} changed {'; '.join(changed)}. Install a release it was tested on: "
            f"pip install '{supported},<={NEWEST_TESTED_TRANSFORMERS}'."
        )


def cache_kwargs(model, cache) -> dict:
    """`cache` as a keyword argument of `model`'s forward, under the name that forward takes it by."""
    takes_cache = "cache" in inspect.signature(model.forward).parameters
    return {"cache" if takes_cache else "past_key_values": cache}


def output_cache(outputs):
    """The cache a forward returned."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else outputs.past_key_values


def pop_prepared_cache(model_kwargs: dict):
    """Removes the cache that `generate()` prepared from `model_kwargs` and returns it (None if there is none)."""
    cache, legacy = model_kwargs.pop("cache", None), model_kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy


def compiled_call(model, cache, generation_config):
    """
    The verifier's forward for decoding steps: compiled where plain `generate()` would compile its own (a static cache
    on a GPU, or `compile_config` asking for it; transformers' `_valid_auto_compile_criteria`), else the model itself.
    Prefill runs uncompiled, as in plain `generate()`. A step verifies 1 to k + 1 tokens: one graph per count.
    """
    criteria = getattr(model, "_valid_auto_compile_criteria", None)
    if criteria is None or not criteria({"cache": cache, "past_key_values": cache}, generation_config):
        return model
    return model.get_compiled_call(generation_config.compile_config)


def has_sliding_layers(cache) -> bool:
    """Whether any layer of `cache` keeps only a sliding window of slots."""
    return any(getattr(cache, "is_sliding", []))


def cache_kind(cache) -> str | None:
    """
    "dynamic" for a `DynamicCache` (slots appended, cropped, gathered), "static" for a cache whose every layer is a
    plain static one (slots written at a running length on the device, rewound by lowering it; `torch.compile`'s
    kind), None for any other (offloaded, quantized, sliding static, ...), which the decoding loop cannot rewind.
    """
    if type(cache) is DynamicCache:
        return "dynamic"
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is StaticLayer for layer in layers) and not getattr(cache, "offloading", False):
        return "static"
    return None


def drop_last_slots(cache, count: int) -> None:
    """
    Forgets the last `count` slots of every layer, without reading the device: a dynamic cache crops them, a static
    one lowers each layer's running length (a device tensor) so that the next forward writes over them. transformers
    5.25's `StaticCache.crop` does the same; earlier releases have none.
    """
    if count <= 0:  # crop(-0) is crop(0), which empties the cache on 5.13 (the length to keep, before 5.17)
        return
    if cache_kind(cache) == "dynamic":
        cache.crop(-count)
        return
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.cumulative_length.sub_(count)


def select_rows(cache, index) -> None:
    """
    Keeps the batch rows `index` of every layer, through each layer's `batch_select_indices` with the index on that
    layer's device: a model dispatched over devices (accelerate's `device_map`) keeps each layer's cache on the layer's
    device, and `Cache.batch_select_indices` hands every layer the index unmoved.
    """
    for layer in cache.layers:
        device = getattr(layer, "device", None)  # set when the layer is first written
        layer.batch_select_indices(index if device is None else index.to(device))


def can_gather_slots(cache) -> bool:
    """Whether `gather_slots` can move every layer's slots: plain dynamic layers, on the device, no sliding window."""
    return not getattr(cache, "offloading", False) and all(type(layer) is DynamicLayer for layer in cache.layers)


def gather_slots(cache, order) -> None:
    """
    Keeps, in every layer of a dynamic `cache`, the slots `order[b]` of row `b` (`order` is `(batch, slots)`), in
    that order: the cache's sequence axis becomes `order`'s. Every layer must hold the same slots (no sliding window).
    """
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or not getattr(layer, "is_initialized", True):
            continue  # a layer that shares another's cache, or was never written
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            index = order.to(tensor.device)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
            setattr(layer, name, tensor.gather(2, index))


def holds_every_token(cache) -> bool:
    """Whether no layer of `cache` has dropped a token (a sliding-window layer drops those that leave its window)."""
    length = cache.get_seq_length()
    keys = [getattr(layer, "keys", None) for layer in cache.layers]
    return not length or all(k is not None and k.shape[-2] == length for k in keys)


def every_slot_copy(cache) -> DynamicCache:
    """
    A `DynamicCache` of plain layers holding what a sliding-window `cache` that `holds_every_token` holds: decoding
    rewinds plain layers on every transformers release, and the model's own sliding mask still sees exactly its window
    over them.
    """
    return DynamicCache([(layer.keys, layer.values) for layer in cache.layers])
