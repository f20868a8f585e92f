"""Reading decoding state back to the host in one transfer per step.

On a GPU every read of a tensor's values on the host (`.tolist()`, `.item()`, `.cpu()`, `int(t)`, `bool(t)`) waits
for all queued work, and so does building a device tensor from host values: the queue drains and the next kernels
launch into an idle device. The decoding loop therefore keeps its tensors on the device and its bookkeeping in
Python, and moves what the host needs in one `to_host` call per step.
"""

import torch


def to_host(*tensors: torch.Tensor | None) -> list:
    """
    The values of `tensors` as nested lists (`None` stays `None`), in a single device-to-host copy. Integer and boolean
    tensors come back as `int`, floating ones as `float`.
    """
    present = [t for t in tensors if t is not None]
    if not present:
        return [None] * len(tensors)
    # float64 holds every token id, count and float32 confidence exactly.
    device = present[0].device  # (a speculator may live on another device than the verifier)
    flat = torch.cat([t.reshape(-1).to(device, torch.float64) for t in present]).tolist()
    out, start = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        values = flat[start : start + t.numel()]
        start += t.numel()
        if not t.is_floating_point():
            values = [int(v) for v in values]
        out.append(_unflatten(values, list(t.shape)))
    return out


def _unflatten(values: list, shape: list[int]):
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_unflatten(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
