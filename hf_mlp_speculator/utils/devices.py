"""Where a model's forward runs, for a model on one device and for one that accelerate dispatched over several."""

import torch


def forward_device(model) -> torch.device:
    """
    The device to time `model`'s forward on: the one whose work ends it. For a model accelerate dispatched over
    devices (`hf_device_map`), the last accelerator its modules sit on: a stream there is idle until the layers before
    it hand over their output, so its events span the whole forward (modules offloaded to the CPU or disk run on the
    main device). Otherwise, its parameters' device.
    """
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        devices = [_device(d) for d in device_map.values() if d != "disk"]
        accelerators = [d for d in devices if d.type not in ("cpu", "meta")]
        return accelerators[-1] if accelerators else torch.device("cpu")
    return next(model.parameters()).device


def _device(entry) -> torch.device:
    # accelerate names the default accelerator's devices by index alone.
    if isinstance(entry, int):
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type if accelerator is not None else "cuda", entry)
    return torch.device(entry)
