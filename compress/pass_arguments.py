"""What each argument of a compression pass accepts, and when it applies.

:data:`VALUE_CHECKS` gives every argument's check and a description of a good value. Numbers follow
one rule (:class:`Span`): a finite int (or float where a fraction or a rate is meant; never a bool,
nan or inf) inside the argument's range, integers bounded above, so no size read from a recipe
allocates without limit. :data:`APPLIES` names the arguments that act only with some values of the
pass's others (``n_calib`` calibrates only a scheme or algorithm that calibrates): given where they
do nothing, they are refused rather than ignored. :func:`prunus.compress.recipe.check_pass` reads
both. No torch here.
"""

from __future__ import annotations

import dataclasses
import math

from prunus.models.schemes import GRANULARITIES, SCHEMES

from .options import (CALIBRATION_METHODS, INT4_ALGORITHMS, INT4_CLIPS, PRUNE_METHODS, PRUNE_SCOPES, STRUCTURED_TARGETS,
                      accepts, check_calibration)
from .student_spec import check_student

MAX_COUNT = 2**31 - 1  # steps, blocks, ... at most
MAX_ROWS = 1 << 16  # rows of a batch, calibration batches, processes at most
MAX_TOKENS = 1 << 20  # tokens of a window at most (a model config's max_seq_len bound)


@dataclasses.dataclass(frozen=True)
class Span:
    """The one rule of a numeric argument: a finite number (an int when ``integer``; never a bool) in
    [lo, hi], each end open when asked; None too when ``optional``."""

    lo: float
    hi: float
    integer: bool = False
    open_lo: bool = False
    open_hi: bool = False
    optional: bool = False

    def __call__(self, v) -> bool:
        if v is None:
            return self.optional
        if isinstance(v, bool) or not isinstance(v, int if self.integer else (int, float)):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        return (self.lo < v if self.open_lo else self.lo <= v) and (v < self.hi if self.open_hi else v <= self.hi)

    def describe(self) -> str:
        if self.integer:
            return f"an integer from {self.lo:,} to {self.hi:,}"
        if math.isinf(self.hi):
            return "a positive finite number" if self.open_lo and self.lo == 0 else f"a finite number of at least {self.lo:g}"
        return f"a number in {'(' if self.open_lo else '['}{self.lo:g}, {self.hi:g}{')' if self.open_hi else ']'}"


def span(lo, hi, **kw) -> tuple[Span, str]:
    """A VALUE_CHECKS entry for a number: (the check, its description)."""
    s = Span(lo, hi, **kw)
    return s, s.describe()


def _one_of(values) -> tuple:
    return (lambda v: isinstance(v, str) and v in values), f"one of {', '.join(values)}"


def _names(v):  # a module name or a list of them
    return isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v))


NAMES = (_names, "a module name or a list of them")
COUNT = span(1, MAX_COUNT, integer=True)
ROWS = span(1, MAX_ROWS, integer=True)
FRACTION = span(0, 1, open_hi=True)
UNIT = span(0, 1)
POSITIVE = span(0, math.inf, open_lo=True, open_hi=True)

# (pass, argument) -> (check, what a good value is). A check may raise ValueError saying why a value is wrong.
VALUE_CHECKS = {
    ("quantize", "scheme"): _one_of(SCHEMES),
    ("quantize", "granularity"): _one_of(GRANULARITIES),
    ("quantize", "group_size"): span(1, MAX_ROWS, integer=True, optional=True),
    ("quantize", "calibration"): (lambda v: accepts(check_calibration, v), " or ".join(CALIBRATION_METHODS)),
    ("quantize", "percentile"): span(0, 100, open_lo=True),
    ("quantize", "exclude"): NAMES,
    ("quantize", "int8"): NAMES,
    ("quantize", "algorithm"): _one_of(INT4_ALGORITHMS),
    ("quantize", "clip"): _one_of(INT4_CLIPS),
    ("quantize", "damp"): (Span(0, 1, open_lo=True, open_hi=True), "a number in (0, 1) (0.01 is usual)"),
    ("smoothquant", "alpha"): UNIT,
    ("prune", "method"): _one_of(PRUNE_METHODS),
    ("prune", "sparsity"): FRACTION,
    ("prune", "scope"): _one_of(PRUNE_SCOPES),
    ("prune", "exclude"): NAMES,
    ("prune_structured", "target"): _one_of(STRUCTURED_TARGETS),
    ("prune_structured", "amount"): (lambda v: Span(0, 1, open_lo=True, open_hi=True)(v) or COUNT[0](v),
                                     "a fraction in (0, 1) (or for blocks a count)"),
    ("distill", "steps"): COUNT,
    ("distill", "batch_size"): ROWS,
    ("distill", "nproc"): span(1, 1024, integer=True),
    ("distill", "seq_len"): span(1, MAX_TOKENS, integer=True, optional=True),
    ("distill", "lr"): POSITIVE,
    ("distill", "temperature"): POSITIVE,
    ("distill", "kd_weight"): UNIT,
    ("distill", "reverse_kl"): UNIT,
    ("distill", "hidden_weight"): span(0, math.inf, open_hi=True),
    ("distill", "seed"): span(0, 2**63 - 1, integer=True),
    ("distill", "student"): (check_student, "keep-every:K, depth:N, width:F, a preset name or a mapping of model fields"),
    ("prune_channels", "amount"): FRACTION,
    ("prune_channels", "by"): _one_of(("channels", "params", "flops")),
    ("prune_channels", "importance"): _one_of(("magnitude", "group_norm", "taylor")),
    ("prune_channels", "finetune_steps"): span(0, MAX_COUNT, integer=True),
    ("prune_channels", "lr"): POSITIVE,
    ("prune_channels", "batch_size"): ROWS,
    ("distill_module", "student"): (lambda v: isinstance(v, str) and ":" in v, "a factory spec package.module:callable"),
    ("distill_module", "steps"): COUNT,
    ("distill_module", "batch_size"): ROWS,
    ("distill_module", "lr"): POSITIVE,
    ("distill_module", "temperature"): POSITIVE,
    ("distill_module", "alpha"): UNIT,
}
for _p in ("quantize", "smoothquant", "prune", "prune_structured"):
    VALUE_CHECKS[(_p, "n_calib")] = span(1, 4096, integer=True)

CALIBRATED_INT4 = ("gptq", "awq", "awq-gptq")  # compress/int4.py: the algorithms that read calibration data
HESSIAN_INT4 = ("gptq", "awq-gptq")  # the ones that run GPTQ (act_order, damp)


def _int4(a: dict) -> bool:
    return a.get("scheme") == "int4-weight-only"


# (pass, argument) -> (whether it acts, given every argument of the pass with its default; where it does)
APPLIES = {
    ("quantize", "calibration"): (lambda a: a.get("scheme") == "w8a8-static", "scheme w8a8-static"),
    ("quantize", "percentile"): (lambda a: a.get("scheme") == "w8a8-static" and a.get("calibration") == "percentile",
                                 "scheme w8a8-static with calibration: percentile"),
    ("quantize", "n_calib"): (lambda a: a.get("scheme") == "w8a8-static" or (_int4(a) and a.get("algorithm") in CALIBRATED_INT4),
                              f"scheme w8a8-static and int4 algorithms {', '.join(CALIBRATED_INT4)} (the calibrated ones)"),
    ("quantize", "group_size"): (lambda a: _int4(a) or a.get("granularity") == "per_group",
                                 "granularity per_group (and int4-weight-only)"),
    ("quantize", "act_order"): (lambda a: a.get("algorithm") in HESSIAN_INT4, f"algorithm {' or '.join(HESSIAN_INT4)}"),
    ("quantize", "damp"): (lambda a: a.get("algorithm") in HESSIAN_INT4, f"algorithm {' or '.join(HESSIAN_INT4)}"),
    ("quantize", "float_zero"): (lambda a: a.get("symmetric") is False, "symmetric: false (an asymmetric grid)"),
    ("quantize", "gguf_scales"): (lambda a: not str(a.get("scheme")).startswith("fp8"),
                                  "the int8 and int4 schemes (GGUF has no fp8 block)"),
    ("quantize", "clip"): (lambda a: a.get("algorithm") != "hqq", "algorithms rtn, gptq, awq and awq-gptq (hqq fits its own grid)"),
    ("prune", "n_calib"): (lambda a: a.get("method") in ("wanda", "2:4"), "methods wanda and 2:4 (the calibrated ones)"),
    ("prune", "scope"): (lambda a: not str(a.get("method")).startswith("2:4"),
                         "methods magnitude and wanda (2:4 keeps 2 of every 4 weights of each row)"),
    ("prune", "sparsity"): (lambda a: not str(a.get("method")).startswith("2:4"),
                            "methods magnitude and wanda (2:4 is 50% sparse by construction)"),
    ("distill", "temperature"): (lambda a: a.get("kd_weight") != 0, "a kd_weight above 0 (the KD term)"),
    ("distill", "reverse_kl"): (lambda a: a.get("kd_weight") != 0, "a kd_weight above 0 (the KD term)"),
    ("prune_channels", "lr"): (lambda a: a.get("finetune_steps") != 0, "finetune_steps above 0 (the fine-tune)"),
    ("prune_channels", "batch_size"): (lambda a: a.get("finetune_steps") != 0, "finetune_steps above 0 (the fine-tune)"),
}


def overlapping_lists(name: str, args: dict) -> list[str]:
    """Module names a quantize pass lists both in ``int8`` and in ``exclude``: two explicit wishes that conflict."""
    if name != "quantize" or "int8" not in args or "exclude" not in args:
        return []
    as_list = (lambda v: [v] if isinstance(v, str) else list(v or ()))
    return sorted(set(as_list(args["int8"])) & set(as_list(args["exclude"])))
