"""The devices' peak FLOP/s that MFU is taken against (``flaxformer_lite.train.metrics``)."""

import jax

from flaxformer_lite.train import metrics


def test_peak_flops_is_the_datasheet_on_accelerators_and_a_measured_matmul_on_cpu(monkeypatch):
    assert 0 < metrics.matmul_peak_flops(n=128, repeats=2) < float("inf")
    monkeypatch.setattr(metrics, "matmul_peak_flops", lambda: 7.0e9)
    assert metrics.peak_flops() == 7.0e9  # this host's CPU, measured
    chip = type("Device", (), {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"})
    monkeypatch.setattr(jax, "devices", lambda: [chip(), chip()])
    assert metrics.peak_flops() == 2 * 989e12
    chip.device_kind = "a chip not in the table"
    assert metrics.peak_flops() is None
