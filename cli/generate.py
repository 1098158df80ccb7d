"""prunus generate: sample a continuation of a prompt, with the KV cache."""

from __future__ import annotations

import sys
import time

import click
import torch

from prunus.models import PrunusError, load_model, load_model_tokenizer, stream_tokens


@click.command("generate")
@click.argument("model_dir", type=click.Path())
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.8, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=0, show_default=True)
def command(model_dir, prompt, max_new_tokens, temperature, top_k, top_p, seed):
    """Continue PROMPT with the model in MODEL_DIR."""
    if max_new_tokens < 1:
        raise PrunusError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    model = load_model(model_dir)
    tokenizer = load_model_tokenizer(model_dir)
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    t0 = time.perf_counter()
    new = [int(t[0]) for t in stream_tokens(model, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                                            top_p=top_p, seed=seed, eos_id=tokenizer.eos_id)]
    dt = time.perf_counter() - t0
    click.echo(prompt + tokenizer.decode(new))
    click.echo(f"[{len(new)} tokens in {dt:.2f} s, {len(new) / dt:.1f} tokens/s]", err=True)
    sys.stdout.flush()
