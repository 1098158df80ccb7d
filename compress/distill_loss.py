"""The distillation loss: logits and hidden states of a student against a frozen teacher.

    loss = (1 - kd_weight) * CE(student, targets) + kd_weight * KD + hidden_weight * MSE

* KD = (1 - reverse_kl) * KL(p_t || p_s) + reverse_kl * KL(p_s || p_t), with p = softmax(logits / T),
  times T^2 (so gradients keep their size as T changes; Hinton et al. 2015), averaged over tokens.
* MSE: student block i's output against teacher block ``layer_map(...)[i]``'s (a uniform
  mapping: the last block of each of n_student equal groups of teacher blocks), through a
  learned linear projection where the widths differ, averaged over the mapped blocks.

``DistillObjective`` is the ``objective`` of ``prunus.train_parallel.train``: it runs the teacher
(no grad) on the same tokens, reads hidden states with forward hooks, and hands its projections
to the trainer as modules to train. ``close()`` removes every hook it placed.

Memory stays bounded at long contexts and large vocabularies: the cross-entropy and KD terms
are computed over chunks of positions (``LOGITS_BYTES`` of float32 logits each), each chunk
under activation checkpointing, so neither their softmaxes nor the teacher's logits exist for
all positions at once; the teacher's logits are computed chunk by chunk from its final hidden
states (``prunus.data.evaluate.final_hidden``) when its logits are its output head of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from prunus.data.evaluate import final_hidden, output_head, output_head_is_last

LOGITS_BYTES = 64 << 20  # float32 logits per chunk of positions


def _kd_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float, reverse_kl: float) -> torch.Tensor:
    """The KD term summed over the rows of (n, vocab) logits."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    loss = s.new_zeros(())
    if reverse_kl < 1:  # kl_div(a, b, log_target) = sum exp(b) (b - a): KL(b || a)
        loss = loss + (1 - reverse_kl) * F.kl_div(s, t, reduction="sum", log_target=True)
    if reverse_kl > 0:
        loss = loss + reverse_kl * F.kl_div(t, s, reduction="sum", log_target=True)
    return loss * temperature**2


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 2.0,
            reverse_kl: float = 0.0) -> torch.Tensor:
    """T^2 [(1 - reverse_kl) KL(p_t || p_s) + reverse_kl KL(p_s || p_t)], mean over tokens."""
    s, t = student_logits.flatten(0, -2), teacher_logits.flatten(0, -2)
    return _kd_sum(s, t, temperature, reverse_kl) / s.shape[0]


def _chunk_terms(s: torch.Tensor, y: torch.Tensor, teacher: torch.Tensor | None, head, temperature: float,
                 reverse_kl: float, ce: bool) -> torch.Tensor:
    """[summed cross-entropy, summed KD] of one chunk of positions; ``teacher`` holds the teacher's
    logits, or its final hidden states when ``head`` is its output head."""
    zero = s.new_zeros((), dtype=torch.float32)
    ce_sum = F.cross_entropy(s.float(), y, reduction="sum") if ce else zero
    if teacher is None:
        return torch.stack([ce_sum, zero])
    t = head(teacher) if head is not None else teacher
    return torch.stack([ce_sum, _kd_sum(s, t, temperature, reverse_kl)])


def chunked_ce_kd(logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None, head=None, *,
                  temperature: float = 2.0, reverse_kl: float = 0.0, ce: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, mean KD) over all positions, computed over chunks of positions under
    activation checkpointing (see the module docstring); a term not asked for is zero."""
    s, y = logits.flatten(0, -2), targets.flatten()
    t = teacher.flatten(0, -2) if teacher is not None else None
    step = max(1, LOGITS_BYTES // (4 * s.shape[-1]))
    total = s.new_zeros(2, dtype=torch.float32)
    for i in range(0, s.shape[0], step):
        part = (s[i:i + step], y[i:i + step], None if t is None else t[i:i + step], head, temperature, reverse_kl, ce)
        if s.requires_grad and s.shape[0] > step:
            total = total + checkpoint(_chunk_terms, *part, use_reentrant=False)
        else:
            total = total + _chunk_terms(*part)
    return total[0] / s.shape[0], total[1] / s.shape[0]


def layer_map(n_student: int, n_teacher: int) -> list[int]:
    """The teacher block whose output student block i learns: the last of the i-th of n_student equal groups."""
    return [(i + 1) * n_teacher // n_student - 1 for i in range(n_student)]


def _capture(blocks, store: dict) -> list:
    return [block.register_forward_hook(lambda m, args, out, i=i: store.__setitem__(i, out))
            for i, block in enumerate(blocks)]


class DistillObjective:
    """``objective(student_logits, tokens, targets) -> loss`` for ``train(..., objective=...)``.

    ``channels``: for a student narrowed from the teacher, which teacher channel each student
    channel holds; the projections start as that selection. ``keep_zeros``: gradients of the
    student's matrices are masked where the weights are exactly zero, so pruned weights stay
    pruned (one process or DDP).
    """

    def __init__(self, teacher: nn.Module, student: nn.Module, *, temperature: float = 2.0, kd_weight: float = 0.9,
                 reverse_kl: float = 0.0, hidden_weight: float = 0.0, channels: torch.Tensor | None = None,
                 keep_zeros: bool = False, seed: int = 0):
        self.teacher = teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.temperature, self.kd_weight, self.reverse_kl, self.hidden_weight = temperature, kd_weight, reverse_kl, hidden_weight
        self.history: list[dict] = []  # per call: the loss and its parts, as floats
        self._hooks, self._s_hidden, self._t_hidden = [], {}, {}
        self.proj = None
        self._head_last = None  # whether the teacher's logits are its output head of its final hidden states
        if hidden_weight > 0:
            t_blocks, s_blocks = list(teacher.layers.values()), list(student.layers.values())
            self.map = layer_map(len(s_blocks), len(t_blocks))
            self._hooks += _capture(s_blocks, self._s_hidden) + _capture(t_blocks, self._t_hidden)
            d_s, d_t = student.config.dim, teacher.config.dim
            if d_s != d_t:
                torch.manual_seed(seed)
                self.proj = nn.ModuleList(nn.Linear(d_s, d_t, bias=False) for _ in s_blocks)
                if channels is not None:
                    with torch.no_grad():
                        for lin in self.proj:
                            lin.weight.zero_()
                            lin.weight[channels, torch.arange(d_s)] = 1.0
                self.proj.to(next(student.parameters()).device)
        if keep_zeros:
            for name, p in student.named_parameters():
                if p.ndim >= 2 and not name.startswith("tok_embeddings") and bool((p == 0).any()):
                    mask = (p != 0).to(p.dtype)
                    self._hooks.append(p.register_hook(lambda g, mask=mask: g * mask))

    def modules(self) -> dict[str, nn.Module]:
        """Trainable modules of the loss itself (the hidden-state projections), for the trainer."""
        return {"distill_proj": self.proj} if self.proj is not None else {}

    def hidden_loss(self) -> torch.Tensor:
        terms = []
        for i, j in enumerate(self.map):
            h = self._s_hidden[i].float()
            if self.proj is not None:
                h = self.proj[i](h)
            terms.append(F.mse_loss(h, self._t_hidden[j].float()))
        return torch.stack(terms).mean()

    def _teacher(self, tokens: torch.Tensor):
        """(the teacher's final hidden states, its output head) or (its logits, None); no grad."""
        with torch.no_grad():
            if self._head_last is None:
                self._head_last = output_head_is_last(self.teacher, tokens)
                self._t_hidden.clear()
            if self._head_last:
                return final_hidden(self.teacher, tokens), output_head(self.teacher)
            return self.teacher(tokens), None

    def __call__(self, logits: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = logits.new_zeros((), dtype=torch.float32)
        parts = {}
        teacher, head = self._teacher(tokens) if self.kd_weight > 0 or self.hidden_weight > 0 else (None, None)
        ce, kd = chunked_ce_kd(logits, targets, teacher if self.kd_weight > 0 else None, head,
                               temperature=self.temperature, reverse_kl=self.reverse_kl, ce=self.kd_weight < 1)
        if self.kd_weight < 1:
            loss = loss + (1 - self.kd_weight) * ce
            parts["ce"] = ce
        if self.kd_weight > 0:
            loss = loss + self.kd_weight * kd
            parts["kd"] = kd
        if self.hidden_weight > 0:
            mse = self.hidden_loss()
            loss = loss + self.hidden_weight * mse
            parts["hidden"] = mse
        self._s_hidden.clear()
        self._t_hidden.clear()
        self.history.append({"loss": float(loss.detach()), **{k: float(v.detach()) for k, v in parts.items()}})
        return loss

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
