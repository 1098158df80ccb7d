"""Logit knowledge distillation of a generic classifier into a smaller student (``distill_module`` pass).

The student is a factory spec (``student``, with JSON ``student_args``), imported only when trusted like the
teacher's. It trains with the generic trainer (:func:`prunus.train_parallel.module_trainer.train_module`) on
the task's training split under the loss

    ``alpha * T**2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * cross_entropy(student, y)``

(Hinton et al.: ``T**2`` keeps the soft term's gradients on the hard term's scale). The teacher's logits ride
in each sample's target (:class:`KDTargets`, computed once per sample as the trainer draws it), so the trainer
needs nothing but a loss: :func:`kd_loss` reads the temperature and alpha from the target as well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prunus.artifacts.errors import PrunusError

KD_LOSS = "prunus.compress.module_distill:kd_loss"


class KDTargets(torch.utils.data.Dataset):
    """``base``'s samples with targets ``[teacher logits..., label, temperature, alpha]`` (one float vector)."""

    def __init__(self, base, teacher: nn.Module, temperature: float, alpha: float):
        self.base, self.teacher, self.extra = base, teacher, torch.tensor([temperature, alpha])
        self.cache: dict[int, torch.Tensor] = {}

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        if i not in self.cache:
            with torch.no_grad():  # not inference_mode: the loss keeps these targets for backward
                logits = self.teacher(x.unsqueeze(0))[0].float()
            if logits.ndim != 1:
                raise PrunusError(f"distill_module: the teacher returns logits of shape {tuple(logits.shape)} per "
                                  "sample; logit distillation takes a classifier's (classes,) logits")
            self.cache[i] = torch.cat([logits, torch.as_tensor(y, dtype=torch.float32).reshape(1), self.extra])
        return x, self.cache[i]


def kd_loss(student: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The distillation loss of the module docstring; ``target`` packed by :class:`KDTargets`."""
    teacher, label = target[:, :-3], target[:, -3].long()
    t, alpha = float(target[0, -2]), float(target[0, -1])
    if student.shape != teacher.shape:
        raise PrunusError(f"distill_module: the student returns logits of shape {tuple(student.shape[1:])} where the "
                          f"teacher returns {tuple(teacher.shape[1:])}; the student must predict the same classes")
    soft = F.kl_div(F.log_softmax(student.float() / t, -1), F.log_softmax(teacher / t, -1), log_target=True,
                    reduction="batchmean") * t * t
    return alpha * soft + (1 - alpha) * F.cross_entropy(student.float(), label)


def distill_module_pass(model: nn.Module, ctx, student: str, student_args: dict | None = None, steps: int = 200,
                        lr: float = 2e-3, batch_size: int = 32, temperature: float = 4.0,
                        alpha: float = 0.9) -> nn.Module:
    """The ``distill_module`` pass (``ctx``: a ModuleContext): the trained student (``model`` teaches)."""
    import tempfile
    from pathlib import Path

    from prunus.models.module_factory import build_module, check_args, check_trusted
    from prunus.train_parallel.module_config import ModuleTrainConfig
    from prunus.train_parallel.module_trainer import train_module

    if ctx.task.name != "classification":
        raise PrunusError(f"distill_module: {ctx.source} is trained for {ctx.task.name}; logit distillation takes a "
                          "classification model")
    check_trusted(student, ctx.trust, "recipe: distill_module.student")
    torch.manual_seed(ctx.seed)
    pupil = build_module(student, check_args(student_args or {}, "distill_module.student_args"),
                         source="distill_module.student")
    teacher = model.eval()
    with tempfile.TemporaryDirectory(prefix="prunus-distill-") as tmp:
        cfg = ModuleTrainConfig(out=str(Path(tmp) / "run"), batch_size=batch_size, steps=steps, lr=lr,
                                min_lr=lr / 10, warmup_steps=min(10, steps // 10), ckpt_every=0, eval_every=steps,
                                seed=ctx.seed, device="cpu", progress=False)
        result = train_module(pupil, KDTargets(ctx.train, teacher, temperature, alpha), KD_LOSS, cfg)
    ctx.note(f"student {student} ({sum(p.numel() for p in pupil.parameters()):,} params) distilled {steps} steps "
             f"(T {temperature:g}, alpha {alpha:g}), last loss {result.losses[-1]:.4f}")
    return pupil.eval()
