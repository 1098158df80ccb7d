"""The architectures the side-by-side benchmarks define themselves (no torchvision): their layouts are the
standard ones (parameter counts of the published models), and the throughput arithmetic they report."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def benchmarks(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))


def test_resnet18_cifar_stem_is_resnet18(benchmarks):
    from benchmarks.resnet_digits import resnet18

    full = resnet18(width=64, channels=3, classes=10)  # the CIFAR ResNet-18: 11,173,962 parameters
    assert sum(p.numel() for p in full.parameters()) == 11_173_962
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in full.modules())
    small = resnet18(width=8).eval()
    assert small(torch.zeros(2, 1, 32, 32)).shape == (2, 10)


def test_resnet50_has_torchvisions_parameter_count(benchmarks):
    from benchmarks.resnet50_cpu import resnet50

    with torch.device("meta"):
        model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's resnet50()
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]


def test_throughput_and_percentile_arithmetic(benchmarks):
    from benchmarks.ddp_vs_handwritten import rate
    from benchmarks.oip_load import pct

    # 5 steps ending at 0, 1, 2, 3, 4 s; one left out: 3 steps of 64 samples in 3 s
    assert rate([0.0, 1.0, 2.0, 3.0, 4.0], 1, 64) == pytest.approx(64.0)
    assert pct(list(range(100)), 0.5) == 50 and pct(list(range(100)), 0.99) == 99 and pct([7.0], 0.99) == 7.0
