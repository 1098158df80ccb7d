"""prunus convert: Hugging Face checkpoints and llama.cpp GGUF files to and from model dirs."""

from __future__ import annotations

import click

from prunus.artifacts.errors import PrunusError


@click.command("convert")
@click.option("--from-hf", "from_hf_dir", type=click.Path(), default=None, help="A Hugging Face checkpoint dir to read (safetensors, sharded or not).")
@click.option("--to-hf", "to_hf_dir", type=click.Path(), default=None, help="A prunus model dir to write as Hugging Face.")
@click.option("--from-gguf", "from_gguf_file", type=click.Path(), default=None,
              help="A llama.cpp GGUF file (Llama architecture) to read; quantized tensors are dequantized.")
@click.option("--to-gguf", "to_gguf_dir", type=click.Path(), default=None,
              help="A prunus model dir to write as a GGUF file (stored int8 / int4 weights in the block type that "
                   "holds them exactly, else F32).")
@click.option("--out", required=True, type=click.Path(), help="The dir (or, with --to-gguf, the .gguf file) to write.")
@click.option("--type", "gguf_type", type=click.Choice(["f32", "f16", "q8_0", "q4_0", "q4_1"]), default="f32", show_default=True,
              help="With --to-gguf: how a float model's 2-D weights are stored (norms stay f32; with q4_0 / q4_1 the "
                   "output head is q8_0). A compressed dir keeps its stored weights exact and its float ones f32.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="With --from-gguf: the dtype of the weights written.")
@click.option("--family", default=None,
              help="With --to-hf: the Hugging Face model_type to write (default: the family the model came from, "
                   "else the first that expresses it).")
@click.option("--max-shard-size", default=None,
              help="With --to-hf: write sharded safetensors of at most this size (bytes, or e.g. 2GB) with an index.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists.")
def command(from_hf_dir, to_hf_dir, from_gguf_file, to_gguf_dir, out, gguf_type, dtype, family, max_shard_size,
            overwrite):
    """Convert between a Hugging Face checkpoint (llama, qwen2, qwen3, mistral, phi3, gemma2, mixtral, qwen3_moe)
    or a llama.cpp GGUF file and a prunus model dir."""
    sources = {"--from-hf": from_hf_dir, "--to-hf": to_hf_dir, "--from-gguf": from_gguf_file, "--to-gguf": to_gguf_dir}
    given = [flag for flag, value in sources.items() if value is not None]
    if len(given) != 1:
        raise PrunusError("convert: give exactly one of --from-hf HF_DIR, --to-hf MODEL_DIR, --from-gguf FILE "
                          "or --to-gguf MODEL_DIR")
    if gguf_type != "f32" and not to_gguf_dir:
        raise PrunusError("convert: --type applies to --to-gguf only")
    if dtype != "float32" and not from_gguf_file:
        raise PrunusError("convert: --dtype applies to --from-gguf only")
    if (family or max_shard_size) and not to_hf_dir:
        raise PrunusError("convert: --family and --max-shard-size apply to --to-hf only")
    if from_hf_dir or to_hf_dir:
        from prunus.models.hf_convert import from_hf, to_hf

        if from_hf_dir:
            path = from_hf(from_hf_dir, out, overwrite=overwrite)
        else:
            path = to_hf(to_hf_dir, out, overwrite=overwrite, family=family, max_shard_size=max_shard_size)
    elif from_gguf_file:
        from prunus.models.gguf_read import from_gguf

        path = from_gguf(from_gguf_file, out, dtype=dtype, overwrite=overwrite)
    else:
        from prunus.models.gguf_write import to_gguf

        path = to_gguf(to_gguf_dir, out, type=gguf_type, overwrite=overwrite)
        click.echo(f"wrote {path}: tensors {tensor_types(path)}")
        return
    click.echo(f"wrote {path}")


def tensor_types(path) -> str:
    """The written GGUF file's tensors counted by type, read back from it: "Q4_0 x 14, F32 x 7"."""
    from collections import Counter

    import gguf

    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return ", ".join(f"{name} x {n}" for name, n in counts.most_common())
