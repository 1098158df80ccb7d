"""The dry run's memory plans as tables for the terminal: the transformer's (:func:`.dry_run.memory_plan`, one rank) and a
generic module's (:func:`.dry_run.module_memory_plan`, every rank)."""

from __future__ import annotations

def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


ROWS = (
    ("params", "parameters (persistent, local shards)"),
    ("params_peak", "parameters at peak (+ gathered / cast copies)"),
    ("grads", "gradients (fp32)"),
    ("optimizer", "optimizer state (AdamW)"),
    ("ddp_buckets", "DDP all-reduce buckets"),
    ("buffers", "buffers (rotary tables)"),
    ("activations", "activations (estimate)"),
    ("model_state", "model state (params + grads + optimizer)"),
    ("host", "held in host memory (--cpu-offload, --offload)"),
    ("total_peak", "peak total on the device (upper bound)"),
)


def render_plan(plan: dict):
    """The plan as one rich Table: layout in the title, one row per figure (bytes and GiB/MiB)."""
    from rich.table import Table

    lay = plan["layout"]
    title = (f"dry run: rank {plan['rank']:,} of {plan['world_size']:,} ranks, dp_replicate={lay['dp_replicate']} "
             f"dp_shard={lay['dp_shard']} tp={lay['tp']}"
             + (f" ({lay['tp_mode']}" + (f", depth {lay['tp_depth']}" if lay.get("tp_depth", 1) > 1 else "") + ")"
                if lay.get("tp_mode", "1d") != "1d" else "") + f" pp={lay['pp']}" + (f" ep={lay['ep']}" if lay.get("ep", 1) > 1 else "")
             + (f" cp={lay['cp']} ({lay['cp_impl']})" if lay.get("cp", 1) > 1 else "") + f" zero={lay['zero']}"
             + (f" {lay['pp_schedule']} x{lay['microbatches']}" if lay["pp"] > 1 else "")
             + (f", AC {lay['activation_checkpointing']}" if lay["activation_checkpointing"] != "none" else "")
             + (", bf16" if lay["bf16"] else "") + (", cpu offload" if lay["cpu_offload"] or lay.get("offload") else ""))
    caption = (f"{plan['model_params']:,} model parameters, {plan['local_params']:,} on this rank "
               f"(stages {plan['stage_ids']}, {plan['blocks']} blocks); activations for micro-batch "
               f"{plan['micro_batch']} x {plan['local_seq_len']} tokens, {plan['in_flight']} in flight")
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    table.add_column("per rank")
    table.add_column("bytes", justify="right")
    table.add_column("size", justify="right")
    for key, label in ROWS:
        value = plan["bytes"][key]
        if key in ("ddp_buckets", "host") and not value:
            continue
        style = "bold" if key in ("model_state", "total_peak") else None
        table.add_row(label, f"{value:,}", _gib(value), style=style)
    comm = plan.get("tp_comm") or {}
    if comm:  # tensor-parallel bytes this rank sends per micro-step, forward + backward (tp_nd/comm_plan.py)
        block = comm.get("layers.0", 0)
        table.add_row("tp traffic sent per micro-step (one block)", f"{block:,}", _gib(block))
        table.add_row("tp traffic sent per micro-step (all layers)", f"{sum(comm.values()):,}", _gib(sum(comm.values())))
    return table


MODULE_COLUMNS = ("params", "gathered", "grads", "ddp_buckets", "optimizer", "buffers", "total_peak")


def render_module_plan(plan: dict):
    """A generic module's plan (:func:`~.dry_run.module_memory_plan`) as one rich Table: a row a rank."""
    from rich.table import Table

    table = Table(title=f"dry run: {plan['layout']}, {plan['world_size']} rank(s), {plan['params_total']:,} parameters "
                        f"({plan['param_bytes_total']:,} bytes); bytes per rank, activations not counted",
                  title_justify="left")
    for name in ("rank", *MODULE_COLUMNS):
        table.add_column(name, justify="right")
    for row in plan["ranks"]:
        table.add_row(str(row["rank"]), *(f"{row[c]:,}" for c in MODULE_COLUMNS))
    return table
