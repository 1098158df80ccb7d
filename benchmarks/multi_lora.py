"""Many LoRA adapters over one base: decode throughput of a batch whose rows use different adapters, beside the
same batch on a model with one adapter merged into its weights (what serving one fine-tune costs) and on the base.

``--adapters`` (4) random PEFT-format adapters of rank ``--rank`` (8) on every projection of SmolLM2-135M
(``/tmp/smol/model-dir`` or ``--model``; else a random model of the ``base`` preset) are written to a temp dir.
``--requests`` (8) requests, spread round-robin over the adapters, run together on an Engine of that many rows serving all the
adapters (per-row deltas, no merging); the same requests run on an Engine over the model with adapter 0 merged in
(prunus's own weights, W + scale B A) and on the base. Prints output tokens/s of each (median and range over
alternating rounds), the ratios, and checks that the merged model's greedy tokens equal the adapter rows' for
adapter 0. Timings never fail the run.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.multi_lora [--model DIR] [--requests 8] [--tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

TARGETS = {"attention.wq": "q_proj", "attention.wk": "k_proj", "attention.wv": "v_proj", "attention.wo": "o_proj",
           "feed_forward.w1": "gate_proj", "feed_forward.w2": "down_proj", "feed_forward.w3": "up_proj"}
PARENT = {"attention": "self_attn", "feed_forward": "mlp"}


def write_adapter(model, out: Path, rank: int, alpha: float, seed: int) -> dict:
    """A PEFT-format adapter dir of random weights over every projection; returns {module name: (A, B)}."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors, weights = {}, {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) != 4 or f"{parts[2]}.{parts[3]}" not in TARGETS:
            continue
        a = torch.randn(rank, module.in_features, generator=g) / module.in_features ** 0.5
        b = torch.randn(module.out_features, rank, generator=g) * 0.3
        hf = f"base_model.model.model.layers.{parts[1]}.{PARENT[parts[2]]}.{TARGETS[parts[2] + '.' + parts[3]]}"
        tensors[f"{hf}.lora_A.weight"], tensors[f"{hf}.lora_B.weight"] = a, b
        weights[name] = (a, b)
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(TARGETS.values()),
        "bias": "none", "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None}))
    save_file(tensors, out / "adapter_model.safetensors")
    return weights


def model_dir(args, tmp: Path) -> Path:
    from prunus.models import Transformer, get_preset, save_model

    if args.model.is_dir():
        return args.model
    print(f"{args.model} is absent: a random model of the base preset", flush=True)
    model = Transformer(get_preset("base"))
    model.init_weights()
    return save_model(model.eval(), tmp / "base", stage="benchmark")


def merged_dir(base: Path, weights: dict, scale: float, out: Path) -> Path:
    import torch

    from prunus.models import load_model, save_model
    from prunus.models.model_dir import load_model_tokenizer

    model = load_model(base)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (a, b) in weights.items():
            modules[name].weight += scale * b @ a
    return save_model(model.eval(), out, tokenizer=load_model_tokenizer(base), stage="benchmark")


def run(engine, prompts: list[str], adapters: list, tokens: int) -> tuple[float, list]:
    """Output tokens/s of the requests submitted together, and their token ids."""
    t0 = time.perf_counter()
    reqs = [engine.submit(p, max_new_tokens=tokens, ignore_eos=True, adapter=a) for p, a in zip(prompts, adapters)]
    results = [engine.wait(r) for r in reqs]
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0), [r.token_ids for r in results]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/smol/model-dir"))
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args()


def main() -> None:
    from benchmarks.harness import alternating_rounds, machine_line, median_range, median_ratio
    from prunus.models import load_model
    from prunus.serve import Engine

    args = parse()
    print(machine_line())
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    prompts = [f"def function_{i}(values):\n    \"\"\"Return the" for i in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="prunus-multi-lora-") as tmp:
        tmp = Path(tmp)
        base = model_dir(args, tmp)
        model = load_model(base)
        weights = [write_adapter(model, tmp / f"a{i}", args.rank, 2.0 * args.rank, i) for i in range(args.adapters)]
        del model
        merged = merged_dir(base, weights[0], 2.0, tmp / "merged")
        names = [f"a{i % args.adapters}" for i in range(args.requests)]
        kw = dict(max_batch=args.requests, threads=args.threads)
        with Engine.load(base, lora={f"a{i}": tmp / f"a{i}" for i in range(args.adapters)}, **kw) as lora, \
                Engine.load(merged, **kw) as one, Engine.load(base, **kw) as plain:
            for e in (lora, one, plain):
                run(e, prompts[:1], [None], 4)  # warm
            _, with_adapters = run(lora, prompts, ["a0"] * len(prompts), args.tokens)
            _, folded = run(one, prompts, [None] * len(prompts), args.tokens)
            _, plain_tokens = run(plain, prompts, [None] * len(prompts), args.tokens)
            same, moved = with_adapters == folded, with_adapters != plain_tokens
            print(f"greedy tokens, adapter a0 rows / the merged model: {'equal' if same else 'DIFFERENT'}; "
                  f"/ the base: {'different (the adapter acts)' if moved else 'EQUAL (the adapter does nothing)'}")
            samples = alternating_rounds({
                f"{args.adapters} adapters, mixed batch": lambda: run(lora, prompts, names, args.tokens)[0],
                "one adapter merged": lambda: run(one, prompts, [None] * len(prompts), args.tokens)[0],
                "base, no adapter": lambda: run(plain, prompts, [None] * len(prompts), args.tokens)[0],
            }, args.rounds)
    for label, values in samples.items():
        print(f"  {label}: {median_range(values)} output tokens/s ({args.requests} requests x {args.tokens} tokens)")
    mixed, one_, base_ = samples.values()
    print(f"mixed adapters / merged: {median_ratio(mixed, one_)}; merged / base: {median_ratio(one_, base_)}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
