"""One GPU's peak FLOP/s by model and dtype: the denominator of MFU (the results line's ``mfu`` and Composer's
``throughput/device/mfu``), owned here because Composer 0.32.1's table stops at the H200 (a B200 or GB200 run had
no MFU at all) and knows no AMD GPU.

Every figure is **dense**. NVIDIA's datasheets print tensor-core figures with 2:4 structured sparsity (marked
"with sparsity"); training runs dense, so those are halved here. AMD's MI300X datasheet prints dense figures (and
the sparse ones beside them). Per GPU: a superchip or an 8-GPU board's figure is divided by its GPU count.

The dtype is the precision's: amp_bf16 -> bf16, amp_fp16 -> fp16; fp32 -> tf32 when PyTorch runs float32
matmuls on TF32 tensor cores (``torch.set_float32_matmul_precision("high")``), else plain fp32 (PyTorch's
default). A GPU not in the table, or a precision it has no figure for, gives None: MFU is null, the run goes on.
"""

from __future__ import annotations

import re

import torch
from composer.callbacks import SpeedMonitor

T = 1e12
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe, 40 and 80 GB alike): TF32 156 (312 sparse),
    # BF16/FP16 312 (624 sparse), FP32 19.5 TFLOPS.
    "A100": {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T},
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16/FP16 1,979, TF32 989 TFLOPS with sparsity; FP32 67.
    "H100 SXM": {"bf16": 1979 / 2 * T, "fp16": 1979 / 2 * T, "tf32": 989 / 2 * T, "fp32": 67 * T},
    # Same datasheet, H100 PCIe: BF16/FP16 1,513, TF32 756 with sparsity; FP32 51.
    "H100 PCIe": {"bf16": 1513 / 2 * T, "fp16": 1513 / 2 * T, "tf32": 756 / 2 * T, "fp32": 51 * T},
    # Same datasheet, H100 NVL: BF16/FP16 1,671, TF32 835 with sparsity; FP32 60 (per GPU).
    "H100 NVL": {"bf16": 1671 / 2 * T, "fp16": 1671 / 2 * T, "tf32": 835 / 2 * T, "fp32": 60 * T},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16/FP16 1,979, TF32 989 with sparsity; FP32 67.
    "H200 SXM": {"bf16": 1979 / 2 * T, "fp16": 1979 / 2 * T, "tf32": 989 / 2 * T, "fp32": 67 * T},
    # Same datasheet, H200 NVL: BF16/FP16 1,671, TF32 835 with sparsity; FP32 60.
    "H200 NVL": {"bf16": 1671 / 2 * T, "fp16": 1671 / 2 * T, "tf32": 835 / 2 * T, "fp32": 60 * T},
    # NVIDIA HGX B200 specifications (8 GPUs): FP16/BF16 36 PFLOPS, TF32 18 PFLOPS with sparsity; FP32 600 TFLOPS.
    "B200": {"bf16": 36_000 / 8 / 2 * T, "fp16": 36_000 / 8 / 2 * T, "tf32": 18_000 / 8 / 2 * T, "fp32": 600 / 8 * T},
    # NVIDIA GB200 NVL72 specifications, GB200 superchip (2 GPUs): FP16/BF16 10 PFLOPS, TF32 5 PFLOPS with sparsity;
    # FP32 160 TFLOPS.
    "GB200": {"bf16": 10_000 / 2 / 2 * T, "fp16": 10_000 / 2 / 2 * T, "tf32": 5_000 / 2 / 2 * T, "fp32": 160 / 2 * T},
    # AMD Instinct MI300X accelerator datasheet (dense): BF16/FP16 1,307.4, TF32 653.7, FP32 (matrix) 163.4 TFLOPS.
    "MI300X": {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "tf32": 653.7 * T, "fp32": 163.4 * T},
}

# torch.cuda.get_device_name() -> table row, first match wins (lower case; GB200 before B200, NVL/PCIe before SXM):
# 'NVIDIA A100-SXM4-80GB', 'NVIDIA A100 80GB PCIe', 'NVIDIA H100 80GB HBM3', 'NVIDIA H100 PCIe', 'NVIDIA H100 NVL',
# 'NVIDIA H200', 'NVIDIA H200 NVL', 'NVIDIA B200', 'NVIDIA GB200', 'AMD Instinct MI300X' (ROCm).
_NAMES = (
    (r"(?<![a-z])gb200", "GB200"),
    (r"(?<![a-z])b200", "B200"),
    (r"(?<![a-z])h200\b.*\bnvl", "H200 NVL"),
    (r"(?<![a-z])h200", "H200 SXM"),
    (r"(?<![a-z])h100\b.*\bnvl", "H100 NVL"),
    (r"(?<![a-z])h100\b.*\b(pcie|hbm2e)", "H100 PCIe"),
    (r"(?<![a-z])h100", "H100 SXM"),
    (r"(?<![a-z])a100", "A100"),
    (r"(?<![a-z])mi300x", "MI300X"),
)
_DTYPE = {"amp_bf16": "bf16", "amp_fp16": "fp16", "fp32": "fp32"}


def gpu_model(device_name: str | None) -> str | None:
    """The table's row for a device name (None: not in the table)."""
    name = (device_name or "").lower()
    return next((row for pattern, row in _NAMES if re.search(pattern, name)), None)


def peak_flops(device_name: str | None, precision: str, tf32: bool = False) -> float | None:
    """One GPU's dense peak FLOP/s for a Composer precision (fp32, amp_bf16, amp_fp16); ``tf32``: float32
    matmuls run on TF32 tensor cores. None for a GPU or precision the table does not hold."""
    row = gpu_model(device_name)
    dtype = "tf32" if precision == "fp32" and tf32 else _DTYPE.get(precision)
    return PEAK_FLOPS[row].get(dtype) if row and dtype else None


def this_gpu_peak_flops(precision: str) -> float | None:
    """``peak_flops`` of this process's CUDA (or ROCm) device; None on CPU."""
    if not torch.cuda.is_available():
        return None
    tf32 = torch.get_float32_matmul_precision() != "highest"
    return peak_flops(torch.cuda.get_device_name(), precision, tf32)


class PeakSpeedMonitor(SpeedMonitor):
    """Composer's SpeedMonitor with its MFU against this table (an unknown GPU: no MFU and no warning)."""

    def init(self, state, logger) -> None:
        if self.gpu_flops_available is None:
            self.gpu_flops_available = this_gpu_peak_flops(state.precision.value) or 0  # 0: Composer logs no MFU
