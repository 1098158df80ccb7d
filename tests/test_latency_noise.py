"""Latency columns repeat the measurement, give its spread and mark a difference within noise."""

import numpy as np
import torch

from prunus.compress.report import LATENCY_MIN_RUNS, LATENCY_RUNS, latency_cell, latency_ms, render_markdown, within_noise
from prunus.models import Transformer, get_preset


class Ctx:
    val_tokens = np.arange(200, dtype=np.uint16) % 256


def test_latency_has_median_and_range():
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny")).eval()
    lat = latency_ms(model, Ctx())
    assert lat["prefill_tokens"] == 127
    # a tiny model takes milliseconds: every run fits the time budget
    assert lat["latency_runs"] == LATENCY_RUNS > LATENCY_MIN_RUNS
    for key in ("prefill_ms", "decode_ms"):
        lo, hi = lat[f"{key}_range"]
        assert 0 < lo <= lat[key] <= hi


def row(name, prefill, decode):
    return {"pass": name, "val_loss": 1.0, "val_bpb": 2.0, "val_tokens": 4096, "bpb_change": 0.0, "agreement": 1.0,
            "params": 10, "nonzero_params": 10, "bytes": 40, "prefill_tokens": 128, "latency_runs": 5,
            "prefill_ms": sum(prefill) / 2, "prefill_ms_range": list(prefill),
            "decode_ms": sum(decode) / 2, "decode_ms_range": list(decode)}


def test_overlapping_runs_are_marked_within_noise():
    base, same, faster = row("input", (9.0, 38.0), (0.8, 1.2)), row("a", (10.0, 12.0), (0.9, 1.0)), \
        row("b", (2.0, 3.0), (0.3, 0.4))
    assert within_noise(same, base, "prefill_ms") and not within_noise(faster, base, "prefill_ms")
    assert latency_cell(same, base, "prefill_ms") == "≈ 11.00 [10.00–12.00]"
    assert latency_cell(faster, base, "decode_ms") == "0.35 [0.30–0.40]"
    assert latency_cell(base, base, "decode_ms") == "1.00 [0.80–1.20]"
    md = render_markdown({"source": "m", "rows": [base, same, faster], "seq_len": 128})
    assert "≈ 11.00 [10.00–12.00]" in md and "| 2.50 [2.00–3.00] |" in md and "within noise" in md


def test_rows_without_ranges_still_render():
    old = {k: v for k, v in row("input", (1.0, 2.0), (1.0, 2.0)).items() if not k.endswith("_range")}
    assert latency_cell(old, old, "decode_ms") == "1.50"
    assert "1.50" in render_markdown({"source": "m", "rows": [old], "seq_len": 128})
