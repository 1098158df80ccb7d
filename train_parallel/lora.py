"""Low-rank adapters (LoRA) on a frozen base, applied to the unmodified model like any parallelism.

A target module (``wq``, ``w1``, ... : an ``nn.Linear``, or a weight-only quantized ``QuantizedLinear`` /
``Int4Linear`` for QLoRA) keeps its weight and its forward; it gains a child ``lora`` holding ``A`` (rank, in)
and ``B`` (out, rank), and a forward hook that adds ``alpha / rank * B A dropout(x)`` to its output. Every
other parameter of the model is frozen, so the optimizer holds the adapters alone. ``B`` starts at zero: at
step 0 the model computes exactly what the base computes. ``A`` is drawn as PEFT draws it (Kaiming uniform,
a = sqrt 5) from a generator seeded by the run's seed and the module's name, so every layout (pipeline stages
included) starts from the same adapters.

Layouts (:func:`apply_lora` runs after tensor parallelism, before FSDP, in ``parallelize``):

* tensor parallel: the adapters follow their base weight's plan. A column-parallel base (weight ``Shard(0)``)
  gets ``B`` sharded on its output rows and ``A`` replicated; a row-parallel base (``Shard(1)``) gets ``A``
  sharded on its input columns and ``B`` replicated. The hook runs before the plan's output hook, on
  DTensors: a column-parallel delta is sharded like the base output, a row-parallel one is a partial sum
  reduced by the same reduce-scatter as the base output, so adapters add no collective of their own.
* FSDP: the adapters are parameters of their block, sharded and gathered with it (their frozen base too),
  so they cost no separate all-gather and their optimizer states are sharded like everything else.
* checkpoints hold them as they hold any parameter (DCP), so LoRA runs resume bit-exactly under any layout.

:func:`merge_lora` folds the adapters into the base weights (``W + alpha / rank * B A``) and removes them,
leaving a plain model: the run's model dir holds that merged model, which every later stage reads as it
reads any other. A quantized base becomes a float Linear holding its dequantized weight plus the delta.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from prunus.artifacts.errors import PrunusError
from prunus.models.compression_state import compression_state
from prunus.models.hf_families import LAYER
from prunus.models.quant_registry import HANDLERS, handler_of, is_quantized

WEIGHT_ONLY = tuple(s for s, h in HANDLERS.items() if h.weight_only)  # bases LoRA can train over


def parse_targets(targets: str) -> list[str]:
    return [t.strip() for t in targets.split(",") if t.strip()]


def target_modules(model: nn.Module, targets: list[str]) -> dict[str, nn.Module]:
    """The modules of ``model``'s blocks named by ``targets`` (the last part of their name), by full name."""
    found = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets and (isinstance(module, nn.Linear) or is_quantized(module)):
            found[name] = module
    return found


def check_lora(model: nn.Module, cfg) -> dict[str, nn.Module]:
    """The modules ``cfg``'s LoRA settings wrap in ``model`` (the whole, unparallelized model), or one line
    saying why they cannot: targets that name no module, a base LoRA cannot train over, nothing to train."""
    targets = parse_targets(cfg.lora_targets)
    if not targets:
        raise PrunusError("--lora-targets is empty: name the modules that get adapters (e.g. wq,wk,wv,wo,w1,w2,w3)")
    found = target_modules(model, targets)
    names = {n.rsplit(".", 1)[-1] for n in found}
    missing = [t for t in targets if t not in names]
    if missing:
        known = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if (isinstance(m, nn.Linear) or is_quantized(m)) and n.startswith("layers.")})
        hf = {theirs.split(".")[1]: ours.split(".")[1] for theirs, ours in LAYER.items() if theirs.endswith("proj.weight")}
        hint = "".join(f" ({t} is Hugging Face's name of {hf[t]})" for t in missing if t in hf)
        raise PrunusError(f"--lora-targets {','.join(missing)} names no module of this model{hint}; "
                          f"choose among {','.join(known)}")
    for name, module in found.items():
        if is_quantized(module) and not handler_of(module).weight_only:
            raise PrunusError(f"--lora-rank: module {name} is quantized {module.scheme}, whose rounded activations pass "
                              f"no gradient; fine-tune a weight-only quantized ({', '.join(WEIGHT_ONLY)}) or float model")
        if cfg.lora_rank > min(module.in_features, module.out_features):
            raise PrunusError(f"--lora-rank {cfg.lora_rank} exceeds module {name}'s smaller dimension "
                              f"{min(module.in_features, module.out_features)}; lower it")
    return found


class LoRAAdapter(nn.Module):
    """``A`` (rank, in) and ``B`` (out, rank) of one target module; ``forward(x)`` is its output's delta."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, scale: float, dropout: float):
        super().__init__()
        self.A, self.B = nn.Parameter(A), nn.Parameter(B)
        self.scale, self.dropout = scale, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        return F.linear(F.linear(x, self.A.to(x.dtype)), self.B.to(x.dtype)) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """``scale * B A`` (out, in), plain tensors (call on an unparallelized model)."""
        return (self.B.detach().float() @ self.A.detach().float()) * self.scale


def _add_delta(module: nn.Module, args, output):
    return output + module.lora(args[0])


def _initial_A(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """PEFT's initialisation of A (Kaiming uniform, a = sqrt 5), drawn from the seed and the module's name."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = math.sqrt(6 / ((1 + 5) * in_features))  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), fan_in
    return (torch.rand(rank, in_features, generator=gen) * 2 - 1) * bound


def _adapter_placements(weight) -> tuple[list, list] | None:
    """(A's, B's) DTensor placements following a tensor-parallel base weight; None for a plain weight."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(weight, DTensor):
        return None
    placement = weight.placements[0]
    if placement == Shard(0):  # column-parallel: output rows split
        return [Replicate()], [Shard(0)]
    if placement == Shard(1):  # row-parallel: input columns split
        return [Shard(1)], [Replicate()]
    return [Replicate()], [Replicate()]


def apply_lora(model: nn.Module, cfg) -> list[str]:
    """Freeze ``model`` (a whole model or a pipeline stage, tensor-parallel or not) and give every target module
    an adapter (see the module docstring); returns the wrapped modules' names."""
    from torch.distributed.tensor import distribute_tensor

    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in target_modules(model, parse_targets(cfg.lora_targets)).items():
        weight = module.weight
        device = weight.device
        rank, fin, fout = cfg.lora_rank, module.in_features, module.out_features
        if device.type == "meta":
            A, B = torch.empty(rank, fin, device=device), torch.empty(fout, rank, device=device)
        else:
            A = _initial_A(name, rank, fin, cfg.seed).to(device)
            B = torch.zeros(fout, rank, device=device)
        placements = _adapter_placements(weight)
        if placements is not None:
            A = distribute_tensor(A, weight.device_mesh, placements[0])
            B = distribute_tensor(B, weight.device_mesh, placements[1])
        module.lora = LoRAAdapter(A, B, cfg.lora_alpha / rank, cfg.lora_dropout)
        # before a tensor-parallel plan's output hook: the delta joins the output while both are DTensors
        module._lora_hook = module.register_forward_hook(_add_delta, prepend=True)
        wrapped.append(name)
    return wrapped


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module of every module carrying an adapter."""
    return {n: m for n, m in model.named_modules() if isinstance(getattr(m, "lora", None), LoRAAdapter)}


def adapter_weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (A, B) of every adapter of an unparallelized model, as plain float32 tensors."""
    return {n: (m.lora.A.detach().float().clone(), m.lora.B.detach().float().clone()) for n, m in lora_modules(model).items()}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and remove it (in place; an unparallelized model); a quantized base
    becomes an ``nn.Linear`` of its dequantized weight plus the delta. Returns ``model``, with nothing frozen."""
    state = compression_state(model)
    for name, module in lora_modules(model).items():
        delta = module.lora.delta_weight()
        module._lora_hook.remove()
        del module._lora_hook, module.lora
        if is_quantized(module):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               device=module.weight.device)
            with torch.no_grad():
                linear.weight.copy_(module.dequantize() + delta.to(module.weight.device))
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            model.set_submodule(name, linear)
            state.quantized_modules.pop(name, None)
        else:
            with torch.no_grad():
                module.weight.add_(delta.to(module.weight.device, module.weight.dtype))
    if state.quantization is not None and not state.quantized_modules:
        state.quantization = None
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def frozen_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers outside its adapters (the frozen base's memory)."""
    adapters = {id(p) for m in lora_modules(model).values() for p in m.lora.parameters()}
    return (sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in adapters)
            + sum(b.numel() * b.element_size() for b in model.buffers()))
