"""Throughput in the one convention we report everywhere (see ModelConfig.flops_per_token).

MFU = model FLOPs per second per GPU / the GPU's dense bf16 peak. Model FLOPs: 6 * N per
token, N excluding the input embedding (the output layer counts), + 12 * L * H * S for
attention. Recompute does not count: MFU measures useful work.
"""

from __future__ import annotations

# Dense bf16 peak FLOP/s by device-name fragment (vendor datasheets).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops_for(device_name: str) -> float | None:
    for fragment, peak in PEAK_BF16_FLOPS.items():
        if fragment in device_name:
            return peak
    return None


def compute_tflops_per_device(flops_per_token: float, tokens_per_s: float, num_devices: int) -> float:
    return flops_per_token * tokens_per_s / num_devices / 1e12


def compute_mfu(tflops_per_device: float, peak_flops: float | None) -> float | None:
    return None if not peak_flops else tflops_per_device * 1e12 / peak_flops
