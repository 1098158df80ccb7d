"""Learning rate: linear warmup, then cosine decay to ``min_lr`` at the last step.

A pure function of the step, so a resumed run needs no scheduler state.
"""

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The learning rate for optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps - 1))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
