"""prunus convert: Hugging Face Llama checkpoints to and from model dirs."""

from __future__ import annotations

import click

from prunus.models import PrunusError


@click.command("convert")
@click.option("--from-hf", "from_hf_dir", type=click.Path(), default=None, help="A Hugging Face Llama dir to read.")
@click.option("--to-hf", "to_hf_dir", type=click.Path(), default=None, help="A prunus model dir to write as Hugging Face.")
@click.option("--out", required=True, type=click.Path(), help="The dir to write.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists.")
def command(from_hf_dir, to_hf_dir, out, overwrite):
    """Convert between a Hugging Face Llama checkpoint and a prunus model dir."""
    from prunus.models.hf_convert import from_hf, to_hf

    if (from_hf_dir is None) == (to_hf_dir is None):
        raise PrunusError("convert: give exactly one of --from-hf HF_DIR or --to-hf MODEL_DIR")
    path = from_hf(from_hf_dir, out, overwrite=overwrite) if from_hf_dir else to_hf(to_hf_dir, out, overwrite=overwrite)
    click.echo(f"wrote {path}")
