"""prunus train: train a model from a preset on a corpus (the built-in one by default)."""

from __future__ import annotations

import click
from click.core import ParameterSource

from prunus.train_parallel import TrainConfig, resume_config, train

D = TrainConfig()


@click.command("train")
@click.option("--out", "out", default=D.out, show_default=True, help="Run dir (checkpoints, metrics, model/).")
@click.option("--preset", default=D.preset, show_default=True, help="Model preset: tiny, small, base, llama-1b, llama-8b.")
@click.option("--data", default=None, help="Text file, dir of text files, or .bin tokens. Default: the built-in corpus.")
@click.option("--tokenizer", default=None, help="Dir holding a Hugging Face tokenizer.json. Default: bytes.")
@click.option("--max-corpus-bytes", type=int, default=D.max_corpus_bytes, show_default=True)
@click.option("--seq-len", type=int, default=None, help="Default: the model's max_seq_len.")
@click.option("--batch-size", type=int, default=D.batch_size, show_default=True, help="Sequences per micro-batch.")
@click.option("--grad-accum", type=int, default=D.grad_accum, show_default=True)
@click.option("--steps", type=int, default=D.steps, show_default=True)
@click.option("--stop-at", type=int, default=None, help="End this invocation after this step (checkpointed); continue with --resume.")
@click.option("--lr", type=float, default=D.lr, show_default=True)
@click.option("--min-lr", type=float, default=D.min_lr, show_default=True)
@click.option("--warmup-steps", type=int, default=D.warmup_steps, show_default=True)
@click.option("--weight-decay", type=float, default=D.weight_decay, show_default=True)
@click.option("--grad-clip", type=float, default=D.grad_clip, show_default=True, help="0 disables clipping.")
@click.option("--bf16/--no-bf16", default=D.bf16, show_default=True, help="bf16 autocast.")
@click.option("--eval-every", type=int, default=D.eval_every, show_default=True)
@click.option("--eval-tokens", type=int, default=D.eval_tokens, show_default=True)
@click.option("--ckpt-every", type=int, default=D.ckpt_every, show_default=True, help="0: only when stopping early.")
@click.option("--keep-checkpoints", type=int, default=D.keep_checkpoints, show_default=True)
@click.option("--log-every", type=int, default=D.log_every, show_default=True)
@click.option("--seed", type=int, default=D.seed, show_default=True)
@click.option("--device", default=D.device, show_default=True, help="auto, cpu or cuda.")
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option("--resume", is_flag=True, help="Continue the run in --out from its last checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace whatever --out holds.")
@click.pass_context
def command(ctx: click.Context, resume: bool, overwrite: bool, **options):
    """Train a model; the final model dir is OUT/model."""
    if resume:
        given = {k: v for k, v in options.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
        cfg = resume_config(options["out"], **given)
    else:
        cfg = TrainConfig(**options)
    result = train(cfg, resume=resume, overwrite=overwrite)
    if result.model_dir is not None:
        click.echo(f"run dir:   {result.run_dir}\nmodel dir: {result.model_dir}\nloss plot: {result.run_dir / 'loss.png'}")
