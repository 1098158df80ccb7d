"""LoRA adapters in Hugging Face PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT (``PeftModel.from_pretrained(base, dir)``) loads them onto the base as ``prunus convert --to-hf``
writes it: module names go through the same family tables (``models/hf_families.py``: ``layers.3.attention.wq``
becomes ``model.layers.3.self_attn.q_proj``), keys are PEFT's
(``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``, shape (rank, in); ``lora_B`` (out, rank)),
and ``r``, ``lora_alpha`` and ``target_modules`` (Hugging Face names) give PEFT's scale ``lora_alpha / r``, the
one prunus trains with. Families whose projections are fused on import (Phi-3) have no per-projection module
to put an adapter on, and are refused.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from prunus.artifacts.atomic import atomic_dir, atomic_write_json
from prunus.artifacts.errors import PrunusError
from prunus.models.hf_convert import pick_family

from ..lora import adapter_weights

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def hf_module_names(model, names) -> dict[str, str]:
    """prunus module name (``layers.N.attention.wq``) -> the Hugging Face family's (``model.layers.N.self_attn.q_proj``)."""
    fam = pick_family(model.config, None, getattr(model, "hf_origin", None), "--save-adapter")
    if fam.fused:
        raise PrunusError(f"--save-adapter: {fam.model_type} fuses q/k/v and gate/up projections, where PEFT adapters "
                          "of prunus's separate projections do not fit; save the merged model instead")
    inverse = {ours.removesuffix(".weight"): theirs.removesuffix(".weight") for theirs, ours in fam.layer.items()}
    out = {}
    for name in names:
        _, index, rest = name.split(".", 2)
        if rest not in inverse:
            raise PrunusError(f"--save-adapter: module {name} has no {fam.model_type} equivalent; adapt other modules")
        out[name] = f"model.layers.{index}.{inverse[rest]}"
    return out


def adapter_config(cfg, hf_names) -> dict:
    """PEFT's LoraConfig fields for ``cfg``'s adapters (``hf_names``: the adapted modules' Hugging Face names)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout, "target_modules": sorted({n.rsplit(".", 1)[-1] for n in hf_names}),
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "base_model_name_or_path": None, "inference_mode": True,
    }


def save_adapter(model, cfg, out: str | Path) -> Path:
    """Write ``model``'s adapters (an unparallelized model, adapters not yet merged) at ``out``, atomically."""
    weights = adapter_weights(model)
    names = hf_module_names(model, weights)
    tensors: dict[str, torch.Tensor] = {}
    for name, (A, B) in weights.items():
        tensors[f"base_model.model.{names[name]}.lora_A.weight"] = A.contiguous()
        tensors[f"base_model.model.{names[name]}.lora_B.weight"] = B.contiguous()
    with atomic_dir(Path(out), overwrite=True) as tmp:
        atomic_write_json(tmp / ADAPTER_CONFIG, adapter_config(cfg, names.values()))
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return Path(out)
