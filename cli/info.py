"""prunus info: a model dir's config and manifest, or a run dir's settings, model, data and progress, as tables."""

from __future__ import annotations

import json
from pathlib import Path

import click

from prunus.artifacts.errors import PrunusError

# ModelConfig fields that describe a mixture of experts: shown only for a model that has experts
MOE_FIELDS = ("n_experts", "top_k", "capacity_factor", "moe_aux_loss_coef", "n_shared_experts", "moe_ffn_dim",
              "moe_norm_topk")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _table(title: str, rows: dict):
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows.items():
        table.add_row(k, _fmt(v))
    return table


def architecture(fields: dict) -> dict:
    """A model config's fields to show: the mixture-of-experts ones only when the model has experts."""
    if fields.get("n_experts"):
        return dict(fields)
    return {k: v for k, v in fields.items() if k not in MOE_FIELDS}


def model_tables(path: Path) -> list:
    from prunus.models import read_manifest
    from prunus.models.spec import TRANSFORMER, dir_kind
    from prunus.train_parallel.held_out_eval import is_module_export

    if is_module_export(path):
        return module_export_tables(path)
    if (dir_kind(path) or TRANSFORMER) != TRANSFORMER:
        return module_tables(path)
    from prunus.models.model_dir import read_config

    manifest = read_manifest(path)
    cfg, config = read_config(path)
    model_rows = {**architecture(cfg.to_dict()), "head_dim": cfg.head_dim, "tokenizer": config.get("tokenizer")}
    parent = manifest.get("parent") or {}
    about = {"stage": manifest.get("stage"), "created": manifest.get("created"),
             "parent": f"{parent.get('path')} ({parent.get('hash', '')[:12]})" if parent else "none",
             "command": manifest.get("command"), **manifest.get("versions", {})}
    files = {name: digest[:16] for name, digest in manifest.get("files", {}).items()}
    return [_table(f"model {path}", model_rows), _table("manifest", about), _table("metrics", manifest.get("metrics", {})),
            _table("files (sha256)", files), *parity_tables(path), *native_tables(path)]


def module_tables(path: Path) -> list:
    """A generic module dir (config.json kind "module"): its factory, task, input and lineage; nothing imported."""
    from prunus.models.module_summary import input_text, module_summary

    s = module_summary(path)
    model_rows = {"factory": s["factory"], "args": json.dumps(s["args"]), "task": s["task"],
                  "input": input_text(s["input"]), "parameters": s["params"], "stored tensors": s["stored_tensors"]}
    if s["pruned_shapes"]:
        model_rows["pruned shapes"] = s["pruned_shapes"]
    lineage = {f"{i}: {e['stage']}": f"{e['path']}" + (f" ({e['hash']})" if e.get("hash") else "")
               + (f"  <- {e['command']}" if e.get("command") else "") for i, e in enumerate(s["lineage"])}
    manifest = s["manifest"]
    files = {name: digest[:16] for name, digest in manifest.get("files", {}).items()}
    return [_table(f"module {path}", model_rows), _table("lineage (newest first)", lineage),
            _table("metrics", manifest.get("metrics", {})), _table("files (sha256)", files)]


def module_export_tables(path: Path) -> list:
    """A generic module's export dir: its config (factory, task, input, format), its parity report and its
    manifest, every file checked against the manifest first; nothing imported, the graph not loaded."""
    from prunus.artifacts.validate import read_dir_json
    from prunus.models.module_summary import input_text
    from prunus.train_parallel.held_out_eval import read_module_export

    config, manifest, graph = read_module_export(path)
    export = config["export"]
    model_rows = {"factory": config.get("factory"), "args": json.dumps(config.get("args") or {}),
                  "task": config.get("task"), "input": input_text(config.get("input")),
                  "format": f"{export.get('format')} {export.get('precision')}, opset {export.get('opset')}",
                  "graph": f"{graph.name} ({graph.stat().st_size:,} bytes)"}
    parity = read_dir_json(path, "parity.json", no_dir="no such directory", no_file="no parity.json; re-create the "
                           "export dir with prunus export", bad_json="re-create the export dir with prunus export")
    parent = manifest.get("parent") or {}
    about = {"stage": manifest.get("stage"), "created": manifest.get("created"),
             "parent": f"{parent.get('path')} ({str(parent.get('hash', ''))[:12]})" if parent else "none",
             "command": manifest.get("command"), **manifest.get("versions", {})}
    files = {name: str(digest)[:16] for name, digest in manifest.get("files", {}).items()}
    return [_table(f"module export {path}", model_rows), _table("parity against PyTorch (parity.json)", parity),
            _table("manifest", about), _table("metrics", manifest.get("metrics", {})), _table("files (sha256)", files)]


PARITY_ROWS = (("top-1 agreement", "top1_agreement", ".4f"), ("decode agreement", "decode_agreement", ".4f"),
               ("greedy agreement", "greedy_agreement", ".4f"), ("bits/byte increase", "bpb_increase", "+.5f"),
               ("max |Δlogits|", "max_abs_logits", ".3g"))


def parity_tables(path: Path) -> list:
    """For an export dir: each runtime that may serve it beside the PyTorch model (its parity.json), one column a
    runtime, with the kernel path and activation handling the native kernels were checked with."""
    from rich.table import Table

    from prunus.runtime.native_parity import runtime_parity

    runtimes = runtime_parity(path)
    if not runtimes:
        return []
    table = Table(title="parity against PyTorch, per runtime (parity.json)", title_justify="left")
    table.add_column("")
    for name in runtimes:
        table.add_column(name)
    cells = lambda f: [f(r) if r.get("checked") else "-" for r in runtimes.values()]  # noqa: E731
    for label, key, spec in PARITY_ROWS:
        table.add_row(label, *cells(lambda r: "n/a" if r.get(key) is None else format(r[key], spec)))
    table.add_row("kernel path", *cells(lambda r: r.get("isa", "-")))
    table.add_row("activations", *cells(lambda r: r.get("activations", "-")))
    table.add_row("verdict", *[("passed" if r.get("passed") else "FAILED: " + ", ".join(r.get("failed") or []))
                               if r.get("checked") else f"not checked: {r.get('why')}" for r in runtimes.values()])
    return [table]


def native_tables(path: Path) -> list:
    """For an export dir with native weights: the kernel path it runs on by default on this CPU, or why it cannot
    (it then runs in ONNX Runtime)."""
    from prunus.artifacts.native_layout import NATIVE_WEIGHTS

    if not (path / NATIVE_WEIGHTS).is_file():
        return []
    from prunus.native.build import ISA_ENV, isa, supported_isas, unavailable

    why = unavailable()
    rows = {"kernel path": why} if why else {"kernel path": isa(), "paths this CPU runs": ", ".join(supported_isas()),
                                             "override": f"{ISA_ENV}=<path>"}
    return [_table("native decoding on this machine (default)", rows)]


def checkpoint_steps(steps: list[int]) -> str:
    """The steps the run dir holds checkpoints of, read as steps (not a count): "step 20", "steps 10, 20"."""
    if not steps:
        return "none"
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(f"{s:,}" for s in steps)


def run_tables(path: Path) -> list:
    from prunus.artifacts.validate import read_json_object
    from prunus.train_parallel import list_checkpoints, read_metrics
    from prunus.train_parallel.run_dir import RUN_CONFIG, read_run_config

    run = read_json_object(path / RUN_CONFIG, fix="re-create the run (prunus train --overwrite)")
    if run.get("kind") == "module":
        return module_run_tables(path)
    settings = read_run_config(path).to_dict()  # the settings, their types checked
    records = read_metrics(path)
    last = records[-1] if records else {}
    evals = [r for r in records if isinstance(r, dict) and "val_loss" in r]
    progress = {"steps done": last.get("step", 0), "steps planned": settings["steps"],
                "checkpoints": checkpoint_steps([s for s, _ in list_checkpoints(path)]),
                "last loss": last.get("loss", "-"), "last val loss": evals[-1]["val_loss"] if evals else "-",
                "last val bits/byte": evals[-1]["val_bpb"] if evals else "-"}
    overrides = settings.pop("model")
    settings["preset"] = f"{settings['preset']}" + (f" with {json.dumps(overrides)}" if overrides else "")
    settings["data"] = run.get("corpus") or settings["data"]
    tables = [_table(f"run {path}", progress), _table("settings", settings)]
    if (path / "model" / "prunus.json").is_file():
        return tables + model_tables(path / "model")
    model = run.get("model")
    return tables + ([_table("model (being trained)", architecture(model))] if isinstance(model, dict) else [])


def module_run_tables(path: Path) -> list:
    """A generic module's run dir: its progress (with the best checkpoint), settings, model and data; the model
    dir's tables once written. Nothing imported."""
    from prunus.train_parallel import list_checkpoints, read_metrics
    from prunus.train_parallel.checkpoint.best import read_best
    from prunus.train_parallel.run_dir import read_run_config

    settings = read_run_config(path).to_dict()
    records = [r for r in read_metrics(path) if isinstance(r, dict)]
    last = records[-1] if records else {}
    evals = [r for r in records if "val_loss" in r]
    best = read_best(path)
    progress = {"steps done": last.get("step", 0), "steps planned": settings["steps"],
                "checkpoints": checkpoint_steps([s for s, _ in list_checkpoints(path)]),
                "best": f"step {best['step']:,} ({best['metric']} {best['value']:.6g}, checkpoints/best)" if best
                else "none yet", "last loss": last.get("loss", "-")}
    for key in ("val_loss", "val_accuracy"):
        if evals and key in evals[-1]:
            progress[f"last {key.replace('_', ' ')}"] = evals[-1][key]
    model = {"factory": settings.pop("model"), "args": json.dumps(settings.pop("model_args")),
             "task": settings.pop("task")}
    data = {k: settings.pop(k) for k in ("data", "test_data", "val_fraction", "data_workers", "shuffle_buffer")}
    tables = [_table(f"run {path} (generic module)", progress), _table("model", model), _table("data", data),
              _table("settings", settings)]
    if (path / "model" / "prunus.json").is_file():
        return tables + model_tables(path / "model")
    return tables


@click.command("info")
@click.argument("path", type=click.Path())
def command(path: str):
    """Show what PATH (a model dir, a generic module dir, an export dir or a run dir) holds."""
    from rich.console import Console

    from prunus.train_parallel.run_dir import RUN_CONFIG

    p = Path(path)
    if (p / "prunus.json").is_file():
        tables = model_tables(p)
    elif (p / RUN_CONFIG).is_file():
        tables = run_tables(p)
    else:
        raise PrunusError(f"{p}: neither a model dir (prunus.json) nor a run dir ({RUN_CONFIG}); give a dir written by prunus")
    console = Console()
    for t in tables:
        console.print(t)
