"""MFU's denominator (diffusion/callbacks/peak_flops.py): every GPU users train on now has a dense peak per
dtype, so its results line has an MFU; a GPU outside the table gives a null MFU, and no crash or warning."""

import types
import warnings

import pytest
import torch
from composer.core import Precision

from diffusion.callbacks import peak_flops as pf
from diffusion.callbacks.results_line import results_line

# torch.cuda.get_device_name() as these GPUs report it -> the dense bf16 peak of their datasheet (sparse / 2)
GPUS = {
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA H100 80GB HBM3": 989.5e12,
    "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H100 NVL": 835.5e12,
    "NVIDIA H200": 989.5e12,
    "NVIDIA H200 NVL": 835.5e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA GB200": 2500e12,
    "AMD Instinct MI300X": 1307.4e12,
}
UNKNOWN = ["NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", "NVIDIA GH200 480GB", "", None]


def line(peak):
    return results_line(
        images=1000.0,
        seconds=10.0,
        measured_batches=10,
        flops_per_sample={"total": 2.41e12, "denoiser": 2.41e12},
        peak_flops=peak,
        peak_memory_gib=1.0,
        microbatch=4,
        precision="amp_bf16",
        stopped_by=None,
        settings={},
        ranks=None,
        split="after_backward",
        straggler_threshold=0.1,
    )


def on_gpu(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)


@pytest.mark.parametrize("name", GPUS)
def test_each_gpu_users_have_gets_a_dense_peak_and_an_mfu(monkeypatch, name):
    on_gpu(monkeypatch, name)
    peak = pf.this_gpu_peak_flops("amp_bf16")
    assert peak == pytest.approx(GPUS[name])
    assert pf.this_gpu_peak_flops("amp_fp16") == peak
    assert line(peak)["mfu"] == pytest.approx(100 * 2.41e12 / GPUS[name])  # 100 images/s on one GPU
    # fp32: plain fp32 by default, the TF32 tensor cores' figure once float32 matmuls run on them
    fp32 = pf.this_gpu_peak_flops("fp32")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert 0 < fp32 < pf.this_gpu_peak_flops("fp32") < peak


@pytest.mark.parametrize("name", UNKNOWN)
def test_an_unknown_gpu_gets_a_null_mfu_without_a_word(monkeypatch, name):
    on_gpu(monkeypatch, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pf.this_gpu_peak_flops("amp_bf16") is None
        assert line(None)["mfu"] is None
        monitor = pf.PeakSpeedMonitor(window_size=2)
        monitor.init(types.SimpleNamespace(precision=Precision.AMP_BF16), None)
    assert monitor.gpu_flops_available == 0  # Composer's SpeedMonitor then logs no MFU


def test_composers_speed_monitor_gets_the_same_peak(monkeypatch):
    on_gpu(monkeypatch, "NVIDIA B200")
    monitor = pf.PeakSpeedMonitor(window_size=2)
    monitor.init(types.SimpleNamespace(precision=Precision.AMP_BF16), None)
    assert monitor.gpu_flops_available == pytest.approx(2.25e15)


def test_no_peak_on_cpu_or_for_a_precision_without_a_figure(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pf.this_gpu_peak_flops("amp_bf16") is None
    assert pf.peak_flops("NVIDIA H100 80GB HBM3", "amp_fp8") is None


def test_every_row_has_every_dtype_and_the_comment_above_it_names_its_source():
    lines = open(pf.__file__).read().splitlines()
    for row, figures in pf.PEAK_FLOPS.items():
        assert set(figures) == {"bf16", "fp16", "tf32", "fp32"}, row
        assert figures["bf16"] > figures["tf32"] > figures["fp32"] > 0, row
        at = next(i for i, text in enumerate(lines) if text.strip().startswith(f'"{row}": {{'))
        comment = []
        while lines[at - 1 - len(comment)].strip().startswith("#"):
            comment.append(lines[at - 1 - len(comment)])
        assert any(w in " ".join(comment) for w in ("datasheet", "specifications")), row
    assert {row for _, row in pf._NAMES} == set(pf.PEAK_FLOPS)
