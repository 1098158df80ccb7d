"""prunus generate: sample a continuation of a prompt, with the KV cache, on the serving Engine.

With ``--chat`` the prompt is a user message (after an optional ``--system`` one) rendered
with the model's chat template, and the answer ends at the model's end of turn."""

from __future__ import annotations

import sys

import click

from prunus.artifacts.errors import PrunusError

from .options import backend_option, compile_option, device_option, kv_dtype_option, native_option, prefill_chunk_option, prompt_graph_option, resolve_device, \
    serving_feature_options


def check_sampling(**params) -> None:
    """The library's sampling checks (SamplingParams), before the model loads, naming generate's flags."""
    from prunus.serve import SamplingParams

    try:
        SamplingParams(**params).check()
    except PrunusError as e:
        message = str(e)
        for name in params:
            message = message.replace(f"{name}=", f"--{name.replace('_', '-')} ")
        raise PrunusError(message) from None


@click.command("generate")
@click.argument("model_dir", type=click.Path())
@click.option("--prompt", required=True, help="Text to continue (with --chat: the user's message).")
@click.option("--chat", is_flag=True, help="Render PROMPT as a user turn with the model's chat template; print the answer.")
@click.option("--system", default=None, help="With --chat: a system message before the user's.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Tokens to generate at most.")
@click.option("--temperature", type=float, default=0.8, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=None, help="Sample among the k most likely tokens. Default: all.")
@click.option("--top-p", type=float, default=None, help="Sample among the most likely tokens whose probabilities sum to p. Default: no cut-off.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampling.")
@backend_option
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel worker processes (torch backend).")
@device_option
@compile_option
@prefill_chunk_option
@prompt_graph_option
@native_option
@kv_dtype_option
@serving_feature_options
def command(model_dir, prompt, chat, system, max_new_tokens, temperature, top_k, top_p, seed, backend, tp, device,
            compile_, prefill_chunk, prompt_graph, native, kv_dtype, prefix_cache_mb, draft, draft_tokens):
    """Continue PROMPT with the model in MODEL_DIR (or an export dir), or answer it with --chat."""
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if system is not None and not chat:
        raise PrunusError("--system applies to --chat; add --chat or drop --system")
    from prunus.serve import Engine

    with Engine.load(model_dir, backend, tp=tp, max_batch=1, device=resolve_device(device),
                     compile="auto" if compile_ is None else compile_,
                     prefill_chunk="auto" if prefill_chunk is None else (prefill_chunk or None), prompt_graph=prompt_graph,
                     native="auto" if native is None else native,
                     kv_dtype=kv_dtype, prefix_cache_mb=prefix_cache_mb, draft=draft,
                     draft_tokens=draft_tokens) as engine:
        text = prompt
        if chat:
            messages = ([{"role": "system", "content": system}] if system is not None else []) + [
                {"role": "user", "content": prompt}]
            try:
                text = engine.chat_prompt(messages)
            except PrunusError as e:
                raise PrunusError(f"{model_dir}: {e}") from None
        r = engine.generate(text, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed)
    click.echo(r.text if chat else prompt + r.text)
    n = len(r.token_ids)
    click.echo(f"[{n} tokens in {r.total_s:.2f} s, {n / r.total_s if r.total_s else 0:.1f} tokens/s; first token "
               f"{r.time_to_first_token_s * 1000:.0f} ms, then {r.decode_tokens_per_s:.1f} tokens/s; "
               f"{'end of turn' if chat and r.finish_reason == 'stop' else r.finish_reason}]", err=True)
    sys.stdout.flush()
