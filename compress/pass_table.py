"""The arguments of a compression pass as a Markdown table, built from what the recipe check reads.

:func:`markdown_table` lists every argument :func:`prunus.compress.recipe.pass_parameters` finds on the pass
function, with the values :data:`~.pass_arguments.VALUE_CHECKS` accepts, the default the function declares
(:data:`DEFAULTS` says what a ``None`` default means) and, from :data:`~.pass_arguments.APPLIES`, where it acts.
docs/compression.md holds its output between ``<!-- pass-table NAME -->`` markers; a test compares the two, so
the documented arguments cannot drift from the checked ones.
"""

from __future__ import annotations

import inspect

from .pass_arguments import APPLIES, VALUE_CHECKS

# (pass, argument) -> what it does
MEANINGS = {
    ("distill", "student"): "the student: derived from the model (`keep-every:K`, `depth:N`, `width:F`, several "
                            "joined by commas), a preset name or a mapping of model config fields",
    ("distill", "steps"): "optimizer steps (AdamW, warmup a tenth of them, cosine down to lr / 10)",
    ("distill", "batch_size"): "sequences per step, all ranks together; a multiple of `nproc`",
    ("distill", "seq_len"): "tokens per sequence; above the evaluation window or a model's `max_seq_len` it is "
                            "refused",
    ("distill", "lr"): "peak learning rate",
    ("distill", "temperature"): "softmax temperature T of the KD term (scaled by T²)",
    ("distill", "kd_weight"): "loss = (1 − kd_weight)·cross-entropy + kd_weight·KD + hidden_weight·MSE",
    ("distill", "reverse_kl"): "share of the KD term taken as KL(student‖teacher) (0: forward KL only)",
    ("distill", "hidden_weight"): "weight of the hidden-state MSE (student blocks against teacher blocks through "
                                  "learned projections); 0: off",
    ("distill", "nproc"): "processes training data-parallel (more than 1: under torchrun)",
    ("distill", "seed"): "seed of a fresh student's weights and of the training run",
    ("distill_module", "student"): "the student's factory, `package.module:callable` (trusted like the model's)",
    ("distill_module", "student_args"): "JSON arguments of the student's factory",
    ("distill_module", "steps"): "optimizer steps of the generic trainer",
    ("distill_module", "lr"): "learning rate",
    ("distill_module", "batch_size"): "samples per step",
    ("distill_module", "temperature"): "softmax temperature T of the KD term (scaled by T²)",
    ("distill_module", "alpha"): "loss = alpha·KD + (1 − alpha)·cross-entropy",
}

# (pass, argument) -> what its None default means
DEFAULTS = {
    ("distill", "student"): "none: the model itself is trained (recovery after pruning)",
    ("distill", "steps"): "scaled to the model: 20 to 200, as many as a 2·10¹³ FLOP budget fits",
    ("distill", "batch_size"): "scaled to the model: up to 16, as many as keep the student's logits within 1 GiB",
    ("distill", "seq_len"): "512, or the evaluation window or a model's `max_seq_len` when shorter",
    ("distill_module", "student_args"): "none: the factory's own defaults",
}


def _default(name: str, key: str, param: inspect.Parameter) -> str:
    if param.default is inspect.Parameter.empty:
        return "required"
    if param.default is None:
        return DEFAULTS[(name, key)]
    return f"`{param.default}`"


def _accepts(name: str, key: str, param: inspect.Parameter) -> str:
    check = VALUE_CHECKS.get((name, key))
    text = check[1] if check else f"`{str(param.annotation).strip(chr(39)).replace(' | ', ' or ')}`"
    rule = APPLIES.get((name, key))
    return text if rule is None else f"{text}; acts only with {rule[1]}"


def argument_rows(name: str) -> list[tuple[str, str, str, str]]:
    """(argument, what it accepts, its default, what it does) for every argument pass ``name`` takes."""
    from .recipe import pass_parameters

    params, _ = pass_parameters(name, {})
    return [(key, _accepts(name, key, p), _default(name, key, p), MEANINGS[(name, key)]) for key, p in params.items()]


def markdown_table(name: str) -> str:
    """The Markdown table of pass ``name``'s arguments (as docs/compression.md holds it)."""
    lines = ["| argument | accepts | default | what it does |", "|---|---|---|---|"]
    lines += [f"| `{key}` | {accepts} | {default} | {meaning} |" for key, accepts, default, meaning in argument_rows(name)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m prunus.compress.pass_table distill: print the table for the docs
    import sys

    print(markdown_table(sys.argv[1] if len(sys.argv) > 1 else "distill"), end="")
