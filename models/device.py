"""``--device``: a device name checked against what torch can run on here, before anything is loaded.

``auto`` and ``cpu`` always pass (torch is not imported for them). Anything else must be a device string
torch parses (``cuda``, ``cuda:1``, ``mps``, ...) of this machine's accelerator (``torch.accelerator``),
with an index below its device count. A name torch cannot use here (``cuda`` on a machine without a GPU,
an unknown type such as ``tpu:9``, ``cuda:3`` with one GPU, ``cpu:1``) is one PrunusError line naming
the flag and the devices this machine has.
"""

from __future__ import annotations

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short


def _accelerator() -> tuple[str | None, int]:
    """(this machine's accelerator type, e.g. "cuda", or None; how many of it torch sees)."""
    import torch

    accel = getattr(torch, "accelerator", None)
    if accel is None:  # an older torch: CUDA alone
        return ("cuda", torch.cuda.device_count()) if torch.cuda.is_available() else (None, 0)
    if not accel.is_available():
        return None, 0
    return accel.current_accelerator().type, accel.device_count()


def usable_devices() -> list[str]:
    """The device names ``--device`` takes on this machine: auto, cpu and each accelerator device."""
    kind, count = _accelerator()
    if kind is None:
        return ["auto", "cpu"]
    return ["auto", "cpu", kind, *(f"{kind}:{i}" for i in range(count))]


def check_device(name, flag: str = "--device") -> str:
    """``name`` when torch can run on it on this machine, else one PrunusError line saying what to use."""
    if name in ("auto", "cpu"):
        return name
    import torch

    def refuse(why: str):
        choices = usable_devices()
        return PrunusError(f"{flag} {short(name)}: {why}; use {', '.join(choices[:-1])} or {choices[-1]}")

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise refuse("not a valid device") from None
    kind, count = _accelerator()
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise refuse("the CPU is one device (cpu)")
        return name
    if device.type != kind:
        what = "not a device prunus runs on" if device.type in ("meta", "mkldnn") else "not available on this machine"
        raise refuse(f"{device.type} is {what}" + (" (torch sees no GPU)" if device.type == "cuda" else ""))
    if device.index is not None and device.index >= count:
        raise refuse(f"this machine has {count} {kind} device{'s' if count != 1 else ''}")
    return name
