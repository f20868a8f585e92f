"""Where a model's forward runs, for a model on one device and for one that accelerate dispatched over several."""

import torch


def forward_device(model) -> torch.device:
    """
    The device to time `model`'s forward on: the one whose work ends it. For a model accelerate dispatched over
    devices (`hf_device_map`, in forward order), the device that runs the last module of the map: a stream there is
    idle until the modules before it hand over their output, so its events span the whole forward. Modules mapped to
    the CPU or disk run on accelerate's main device: the first accelerator of the map unless the model's own hook names
    another (`dispatch_model(..., main_device="cpu")` runs them on the CPU). Otherwise, its parameters' device.
    """
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return next(model.parameters()).device
    last = list(device_map.values())[-1]
    if last not in ("cpu", "disk"):
        return _device(last)
    main = getattr(getattr(model, "_hf_hook", None), "execution_device", None)
    if main is None:
        accelerators = [entry for entry in device_map.values() if entry not in ("cpu", "disk")]
        main = accelerators[0] if accelerators else "cpu"
    return _device(main)


def _device(entry) -> torch.device:
    # accelerate names the default accelerator's devices by index alone.
    if isinstance(entry, int):
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type if accelerator is not None else "cuda", entry)
    return torch.device(entry)
