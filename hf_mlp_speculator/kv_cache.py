"""The KV cache under both of its names (transformers 5.24 and later pass it as `cache`, earlier releases as
`past_key_values`: in model forwards, in their outputs and in the `model_kwargs` that `generate()` prepares), and what
the decoding loop does to its slots."""

import inspect


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


def can_gather_slots(cache) -> bool:
    """Whether `gather_slots` can move every layer's slots: plain dynamic layers, on the device, no sliding window."""
    from transformers.cache_utils import DynamicLayer

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


def cache_kind(cache) -> str | None:
    """
    "dynamic" for a `DynamicCache` (slots appended, cropped, gathered), "static" for a cache whose every layer is a
    plain static one (slots written at a running length on the device, rewound by lowering it; `torch.compile`'s
    kind), None for any other (offloaded, quantized, sliding static, ...), which the decoding loop cannot rewind.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import StaticLayer

    if type(cache) is DynamicCache:
        return "dynamic"
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is StaticLayer for layer in layers) and not getattr(cache, "offloading", False):
        return "static"
    return None


def holds_every_token(cache) -> bool:
    """Whether no layer of `cache` has dropped a token (a sliding-window layer drops those that leave its window)."""
    length = cache.get_seq_length()
    keys = [getattr(layer, "keys", None) for layer in cache.layers]
    return not length or all(k is not None and k.shape[-2] == length for k in keys)


def every_slot_copy(cache):
    """
    A `DynamicCache` of plain layers holding what a sliding-window `cache` that `holds_every_token` holds: decoding
    rewinds plain layers on every transformers release, and the model's own sliding mask still sees exactly its window
    over them.
    """
    from transformers import DynamicCache

    return DynamicCache([(layer.keys, layer.values) for layer in cache.layers])


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
