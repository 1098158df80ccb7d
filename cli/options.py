"""Options several verbs share, each defined once: the device and the serving backend; and the HTTP
server's access options, one per field of :class:`~prunus.serve.http_access.ServeAccess`."""

from __future__ import annotations

import dataclasses

import click

from prunus.runtime.load_options import ServingFeatures
from prunus.runtime.registry import BACKENDS
from prunus.serve.http_access import ServeAccess
from prunus.train_parallel.config import TrainConfig

_DEVICE = next(f for f in dataclasses.fields(TrainConfig) if f.name == "device")


def _usable_device(ctx, param, value: str) -> str:
    """--device checked as it is parsed: one line for a device torch cannot use here, before anything loads."""
    from prunus.models.device import check_device

    return check_device(value)


device_option = click.option("--device", default=_DEVICE.default, show_default=True, help=_DEVICE.metadata["help"],
                             callback=_usable_device)
backend_option = click.option("--backend", type=click.Choice(BACKENDS), default=None,
                              help="Default: torch for a model dir, the export's runtime for an export dir.")


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; any other name as given."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"

# the torch backend's Engine.load(compile=..., prefill_chunk=...): neither flag means compile="auto"
compile_option = click.option(
    "--compile/--no-compile", "compile_", default=None,
    help="Decode through torch.compile (torch backend, tp=1), or not. Default: auto, by the model's size "
         "(prunus.runtime.compiled_decode.choose_compile); eager with a warning where torch.compile cannot run.")
prompt_graph_option = click.option(
    "--prompt-graph", is_flag=True, default=False,
    help="Genai export of int8 / int4 weights: long prompts through a twin graph with float activations "
         "(faster first token, a second copy of the weights in memory).")
native_option = click.option(
    "--native/--no-native", default=None,
    help="A model dir or genai export: run it in prunus's own CPU kernels (AVX2 up to AVX-512 VNNI and AMX, by the CPU; "
         "compiled with the machine's C compiler on first use; a model dir's weights packed at load), or in ONNX "
         "Runtime (an export; a model dir's prepared export) or torch. Default: the kernels wherever they run "
         "(x86-64 with AVX2), else ONNX Runtime / torch; `prunus info EXPORT_DIR` says which.")
prepare_option = click.option(
    "--prepare/--no-prepare", default=True, show_default=True,
    help="A model dir on a CPU that the native kernels do not serve (--no-native, --prompt-graph): serve its ONNX "
         "Runtime genai export, made once (parity-checked) and cached in PRUNUS_CACHE_DIR (default ~/.cache/prunus), "
         "instead of the slower torch Engine; --no-prepare or --backend torch keeps the torch Engine.")
kv_dtype_option = click.option(
    "--kv-dtype", type=click.Choice(["f32", "f16"]), default="f32", show_default=True,
    help="The native kernels' KV cache element type (a genai export); f16 halves its memory and bandwidth at long "
         "contexts.")
prefill_chunk_option = click.option(
    "--prefill-chunk", type=click.IntRange(min=0), default=None,
    help="Prompt tokens per row per prefill pass; longer prompts go through the cache in chunks, between other "
         "requests' decode steps. 0: whole prompts. Default: 256 on the torch backend, 64 on a genai export.")


def access_options(command):
    """``prunus serve``'s --api-key / --allowed-hosts / --allowed-origins: one option per ServeAccess field
    (a tuple field repeats and takes comma-separated lists; ``metadata["envvar"]`` names its variable)."""
    for f in reversed(dataclasses.fields(ServeAccess)):
        many = f.default == ()
        envvar = f.metadata.get("envvar")
        command = click.option("--" + f.name.replace("_", "-"), f.name, multiple=many, default=None,
                               envvar=envvar, show_envvar=envvar is not None, metavar="LIST" if many else "KEY",
                               help=f.metadata["help"])(command)
    return command


def serving_feature_options(command):
    """--prefix-cache-mb / --speculative / --draft-tokens: one option per ServingFeatures field, named by its
    ``metadata["flag"]``, passed to the command under the field's name (an ``Engine.load`` keyword)."""
    for f in reversed(dataclasses.fields(ServingFeatures)):
        m = f.metadata
        command = click.option(m["flag"], f.name, type=m["type"], default=f.default, metavar=m.get("metavar"),
                               show_default=f.default is not None, help=m["help"])(command)
    return command
