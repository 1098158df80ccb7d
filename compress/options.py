"""The values compression passes accept, in one place: the passes, the recipe schema and the CLI
shortcuts all read these lists and call these checks (no torch here, so listing them is cheap).
"""

from __future__ import annotations

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

PRUNE_METHODS = ("magnitude", "wanda", "2:4", "2:4-magnitude")
PRUNE_SCOPES = ("layer", "row", "global")  # see compress/prune.py for what each ranks together
STRUCTURED_TARGETS = ("heads", "channels", "blocks")
CALIBRATION_METHODS = ("minmax", "percentile")
INT4_ALGORITHMS = ("rtn", "gptq", "awq", "hqq", "awq-gptq")
INT4_CLIPS = ("none", "mse")  # see compress/int4_clip.py


def check_calibration(method: str, percentile: float = 99.99) -> None:
    """The one check of a static-quantization calibration method and percentile (the quantize pass,
    the recipe schema and ``calibrate.input_absmax`` call it): one PrunusError line naming what is wrong."""
    if method not in CALIBRATION_METHODS:
        raise PrunusError(f"quantize: unknown calibration {short(method)}; choose one of: {', '.join(CALIBRATION_METHODS)}")
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
        raise PrunusError(f"quantize: percentile {short(percentile)} must be a number in (0, 100]")


def accepts(check, *args) -> bool:
    """Whether ``check(*args)`` (one of the checks above) lets the value through."""
    try:
        check(*args)
    except PrunusError:
        return False
    return True
