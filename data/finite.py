"""No NaN or infinity enters training from data: :func:`check_finite` on a decoded sample (the readers of
:mod:`.image_decode`), :func:`check_samples_finite` on the batches of a dataset prunus did not read itself
(the Python API's own ``Dataset``), naming the sample. Integer and boolean tensors are finite by nature."""

from __future__ import annotations

import torch

from prunus.artifacts.errors import PrunusError


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield "", obj
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from ((f"[{i}]{k}", t) for k, t in _tensors(item))
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from ((f"[{key!r}]{k}", t) for k, t in _tensors(item))


def check_finite(tensor: torch.Tensor, where: str) -> None:
    """One line naming ``where`` unless every value of ``tensor`` is finite."""
    if not tensor.is_floating_point() and not tensor.is_complex():
        return
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    what = " and ".join(p for p in (f"{nan:,} NaN" if nan else "", f"{inf:,} infinite" if inf else "") if p)
    raise PrunusError(f"{where}: {what} among its {tensor.numel():,} values; fix or remove the sample (a model "
                      "trained on them is NaN)")


def all_finite(obj) -> bool:
    """Whether every float tensor in ``obj`` (a tensor, or a tuple / list / dict of them) is finite."""
    return all(bool(torch.isfinite(t).all()) for _, t in _tensors(obj) if t.is_floating_point() or t.is_complex())


def check_samples_finite(dataset, indices: list[int], batch) -> None:
    """One line naming the first sample of ``indices`` with a NaN or infinity, when ``batch`` (theirs, collated)
    holds one; nothing for datasets whose readers check at decode (``finite_checked``)."""
    if getattr(dataset, "finite_checked", False) or all_finite(batch):
        return
    for i in indices:
        sample = dataset[i]
        for key, tensor in _tensors(sample):
            part = {"[0]": " (input)", "[1]": " (target)"}.get(key[:3], "")
            check_finite(tensor, f"dataset[{i}]{key}{part}")
