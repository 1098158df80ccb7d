"""The compression report: one row for the input model, then one after each pass.

Each row holds quality (validation loss, bits per byte with the number of held-out
tokens behind it, its change against the input, greedy-token agreement with the input
model), size (parameters, non-zero parameters, exact bytes of model.safetensors), CPU
latency (prefill of up to 128 tokens, one decode step with the KV cache; the median and the
min–max range of at most ``LATENCY_RUNS`` runs, fewer once they took ``LATENCY_SECONDS``, with a
difference whose ranges overlap the input row's marked as within noise) and the notes a
pass left (what it actually removed, say). Written as ``report.json``, ``report.md``
and ``report.png`` (the change in bits per byte against size; for unstructured pruning, against
the effective size of the non-zero weights).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
from safetensors.torch import save as safetensors_bytes

from prunus.models import KVCache, generate
from prunus.models.model_dir import state_dict_for_save
from prunus.models.quant_registry import count_params, quantized_modules

N_PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 32, 32
PREFILL_LEN, LATENCY_RUNS, LATENCY_MIN_RUNS, LATENCY_SECONDS = 128, 7, 3, 2.0


def bytes_on_disk(model) -> int:
    """The exact size model.safetensors will have (serialised the way save_model writes it)."""
    return len(safetensors_bytes(state_dict_for_save(model), metadata={"format": "pt"}))


def nonzero_params(model) -> int:
    n = sum(int(torch.count_nonzero(p)) for p in model.parameters())
    # dequantized: an int4 module packs two values per byte, and its zero is the zero point, not the value 0
    return n + sum(int(torch.count_nonzero(m.dequantize())) for m in quantized_modules(model).values())


def prompts_from(ctx, model) -> torch.Tensor:
    """N_PROMPTS held-out prompts of equal length, spread over the validation split."""
    length = min(PROMPT_LEN, model.config.max_seq_len - NEW_TOKENS)
    val = torch.from_numpy(ctx.val_tokens.astype("int64"))
    step = max(1, (len(val) - length) // N_PROMPTS)
    return torch.stack([val[i * step: i * step + length] for i in range(N_PROMPTS)])


def greedy(model, prompts: torch.Tensor) -> torch.Tensor:
    return generate(model, prompts, NEW_TOKENS, temperature=0.0)[:, prompts.shape[1]:]


@torch.inference_mode()
def latency_ms(model, ctx) -> dict:
    """Milliseconds of a prefill and of one decode step after it (batch 1): one warm-up run, then
    LATENCY_RUNS timed runs, or fewer (at least LATENCY_MIN_RUNS) once the timed runs took LATENCY_SECONDS.
    Returns the medians and the [min, max] range of the runs, so a reader can tell noise from a difference."""
    length = min(PREFILL_LEN, model.config.max_seq_len - 1, len(ctx.val_tokens))
    tokens = torch.from_numpy(ctx.val_tokens[:length].astype("int64"))[None]
    prefill, decode = [], []
    for i in range(LATENCY_RUNS + 1):
        if len(prefill) >= LATENCY_MIN_RUNS and (sum(prefill) + sum(decode)) / 1e3 > LATENCY_SECONDS:  # ms -> s
            break
        cache = KVCache.for_model(model, 1, max_len=length + 1)
        t0 = time.perf_counter()
        logits = model(tokens, cache=cache)
        t1 = time.perf_counter()
        model(logits[:, -1:].argmax(-1), cache=cache)
        t2 = time.perf_counter()
        if i:  # the first run warms up
            prefill.append(1e3 * (t1 - t0))
            decode.append(1e3 * (t2 - t1))
    return {"prefill_ms": statistics.median(prefill), "prefill_ms_range": [min(prefill), max(prefill)],
            "decode_ms": statistics.median(decode), "decode_ms_range": [min(decode), max(decode)],
            "prefill_tokens": length, "latency_runs": len(prefill)}


def within_noise(row: dict, base: dict, key: str) -> bool:
    """Whether ``row``'s runs of ``key`` (prefill_ms / decode_ms) overlap ``base``'s: a difference within noise."""
    if f"{key}_range" not in row or f"{key}_range" not in base:
        return False
    (lo, hi), (base_lo, base_hi) = row[f"{key}_range"], base[f"{key}_range"]
    return lo <= base_hi and base_lo <= hi


def latency_cell(row: dict, base: dict | None, key: str) -> str:
    """A latency cell: median, [min–max] of the runs, and "≈" when the range overlaps the input row's."""
    text = f"{row[key]:.2f}"
    if f"{key}_range" in row:
        lo, hi = row[f"{key}_range"]
        text += f" [{lo:.2f}–{hi:.2f}]"
    if base is not None and row is not base and within_noise(row, base, key):
        text = "≈ " + text
    return text


def report_row(name: str, model, ctx, *, reference: torch.Tensor, prompts: torch.Tensor, base: dict | None = None,
               latency: bool = True, notes: list[str] | None = None) -> dict:
    """One row of the report; ``reference`` is the input model's greedy continuation of ``prompts``."""
    model.eval()
    t0 = time.perf_counter()
    quality = ctx.evaluate(model)
    t1 = time.perf_counter()
    tokens = greedy(model, prompts)
    t2 = time.perf_counter()
    row = {
        "pass": name,
        "val_loss": quality["val_loss"],
        "val_bpb": quality["val_bpb"],
        "val_tokens": quality["val_tokens"],
        "bpb_change": 0.0 if base is None else quality["val_bpb"] / base["val_bpb"] - 1,
        "agreement": float((tokens == reference).float().mean()),
        "params": count_params(model),
        "nonzero_params": nonzero_params(model),
        "bytes": bytes_on_disk(model),
    }
    t3 = time.perf_counter()
    if latency:
        row.update(latency_ms(model, ctx))
    row["seconds"] = {"eval": round(t1 - t0, 2), "greedy": round(t2 - t1, 2), "size": round(t3 - t2, 2),
                      "latency": round(time.perf_counter() - t3, 2)}
    if notes:
        row["notes"] = list(notes)
    return row


def render_markdown(report: dict) -> str:
    rows = report["rows"]
    has_latency = "prefill_ms" in rows[0]
    head = ["#", "pass", "val loss", "bits/byte", "Δ bpb", "greedy agree", "params", "non-zero", "MB on disk"]
    if has_latency:
        head += [f"prefill {rows[0]['prefill_tokens']} (ms)", "decode (ms)"]
    lines = [f"# Compression report: {report['source']}", "",
             f"eval: {rows[0]['val_tokens']:,} held-out tokens of {report.get('corpus', 'the corpus')} in windows of "
             f"{report.get('seq_len')} tokens; agreement: {N_PROMPTS} prompts x {NEW_TOKENS} greedy tokens; "
             f"latency: batch 1, median [min–max] of {rows[0].get('latency_runs', LATENCY_RUNS)} runs (up to {LATENCY_RUNS} "
             f"within {LATENCY_SECONDS:g} s; OMP_WAIT_POLICY={report.get('omp_wait_policy')}, {report.get('threads')} threads); "
             "≈: the runs overlap the input row's, a difference within noise", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows):
        cells = [str(i), r["pass"], f"{r['val_loss']:.4f}", f"{r['val_bpb']:.4f}", f"{100 * r['bpb_change']:+.2f}%",
                 f"{100 * r['agreement']:.1f}%", f"{r['params']:,}", f"{r['nonzero_params']:,}", f"{r['bytes'] / 1e6:.3f}"]
        if has_latency:
            cells += [latency_cell(r, rows[0], "prefill_ms"), latency_cell(r, rows[0], "decode_ms")]
        lines.append("| " + " | ".join(cells) + " |")
    if "seconds" in report:
        sec = report["seconds"]
        lines += ["", f"time before saving: {sec['before_save']:.1f} s: context {sec['context']:.1f} s, passes "
                      f"{sum(sec['passes']):.1f} s, report rows {sum(sum(r.get('seconds', {}).values()) for r in rows):.1f} s "
                      f"(evaluation {sum(r.get('seconds', {}).get('eval', 0) for r in rows):.1f} s)"]
    notes = [f"- row {i} ({r['pass']}): {line}" for i, r in enumerate(rows) for line in r.get("notes", [])]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def is_sparse(report: dict) -> bool:
    """Whether a pass of the report zeroes weights in place (unstructured or 2:4 pruning): the file does not
    shrink, the non-zero parameters do."""
    return any(r["pass"].startswith("prune(") for r in report["rows"])


def plot_size(report: dict) -> tuple[list[float], str]:
    """The x values of the report's plot and their label: MB on disk, or for a report with unstructured pruning
    the effective size (MB on disk x the non-zero share: what a format storing no zeros would take, before indices)."""
    rows = report["rows"]
    if is_sparse(report):
        return ([r["bytes"] * r["nonzero_params"] / r["params"] / 1e6 for r in rows],
                "effective size, MB (on disk × non-zero share)")
    return [r["bytes"] / 1e6 for r in rows], "model.safetensors (MB)"


MIN_SPAN_PERCENT = 1.0  # the y axis spans at least one percentage point of bits per byte


def report_figure(report: dict):
    """The report's plot: change in bits per byte (%) against size, one numbered point per row, and a key of
    the rows beside it. Plain tick values, a minimum span, labels placed clear of each other."""
    import textwrap

    import matplotlib.pyplot as plt

    from prunus.train_parallel.plot import key_text, place_point_labels, plain_ticks, span_limits

    rows = report["rows"]
    xs, xlabel = plot_size(report)
    ys = [100 * r["bpb_change"] for r in rows]
    fig = plt.figure(figsize=(8.5, 4.5), dpi=110, layout="constrained")
    ax, key = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.1, 1]})
    ax.axhline(0, color="0.6", linewidth=0.8, linestyle="--")
    ax.plot(xs, ys, "-o", color="tab:blue")
    ax.set_xlim(*span_limits(xs, min_span=0.1 * max(xs)))
    ax.set_ylim(*span_limits(ys, min_span=MIN_SPAN_PERCENT))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("Δ bits per byte against the input (%)")
    ax.set_title("quality against size, pass by pass", fontsize=10)
    plain_ticks(ax)
    ax.grid(alpha=0.3)
    lines = [f"input: {rows[0]['val_bpb']:.4f} bits/byte", f"on {rows[0]['val_tokens']:,} held-out tokens", ""]
    for i, r in enumerate(rows):
        name = textwrap.wrap(f"{i}: {r['pass']}", 36, subsequent_indent="   ", break_on_hyphens=False,
                             break_long_words=False)
        lines += [*name, f"   {r['val_bpb']:.4f} ({100 * r['bpb_change']:+.2f}%), {xs[i]:.3f} MB"]
    key_text(fig, key, lines)  # a long recipe's key shrinks to stay inside the figure
    place_point_labels(fig, ax, xs, ys, [str(i) for i in range(len(rows))])
    return fig


def quality(row: dict) -> tuple[str, float]:
    """(label, value) of a row's quality: top-1 accuracy (%) where the task judges it, else the loss."""
    if "val_accuracy" in row:
        return "top-1 accuracy (%)", 100 * row["val_accuracy"]
    return "held-out loss", row["val_loss"]


def render_module_markdown(report: dict) -> str:
    rows = report["rows"]
    label = quality(rows[0])[0]
    head = ["#", "pass", "val loss", label, "params", "MB", *(["latency (ms)"] if "latency_ms" in rows[0] else [])]
    lines = [f"# Compression report: {report['source']}", "",
             f"task {report['task']}, held-out samples of {report['data']}: {rows[0]['val_samples']:,}; latency: "
             f"median CPU forward of one batch, {report.get('threads')} threads", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows):
        cells = [str(i), r["pass"], f"{r['val_loss']:.4f}", f"{quality(r)[1]:.2f}", f"{r['params']:,}",
                 f"{r['bytes'] / 1e6:.3f}", *([f"{r['latency_ms']:.2f}"] if "latency_ms" in r else [])]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- row {i} ({r['pass']}): {line}" for i, r in enumerate(rows) for line in r.get("notes", [])]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def module_figure(report: dict):
    """Quality against the weights' size, one numbered point per row."""
    import matplotlib.pyplot as plt

    from prunus.train_parallel.plot import place_point_labels, plain_ticks, span_limits

    rows = report["rows"]
    xs = [r["bytes"] / 1e6 for r in rows]
    ys = [quality(r)[1] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=110, layout="constrained")
    ax.plot(xs, ys, "-o", color="tab:blue")
    ax.set_xlim(*span_limits(xs, min_span=0.1 * max(xs)))
    ax.set_ylim(*span_limits(ys, min_span=1.0))
    ax.set_xlabel("weights (MB)")
    ax.set_ylabel(quality(rows[0])[0])
    ax.set_title("quality against size, pass by pass: " + ", ".join(f"{i} {r['pass']}" for i, r in enumerate(rows)),
                 fontsize=8, wrap=True)
    plain_ticks(ax)
    ax.grid(alpha=0.3)
    place_point_labels(fig, ax, xs, ys, [str(i) for i in range(len(rows))])
    return fig


def report_files(report: dict) -> dict[str, bytes]:
    """report.json, report.md and report.png of a compression report (a generic module's: its task's quality)."""
    from prunus.train_parallel.plot import figure_png

    markdown, figure = render_markdown, report_figure
    if report.get("kind") == "module":  # a generic module: accuracy / loss instead of bits per byte
        markdown, figure = render_module_markdown, module_figure
    return {"report.json": (json.dumps(report, indent=2) + "\n").encode(), "report.md": markdown(report).encode(),
            "report.png": figure_png(figure(report))}


def report_header(ctx) -> dict:
    return {"source": str(ctx.source), "eval_tokens": ctx.eval_tokens, "seq_len": ctx.seq_len,
            "corpus": ctx.corpus_name, "seed": ctx.seed,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "threads": torch.get_num_threads()}
