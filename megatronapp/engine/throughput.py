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


def compute_run_throughput(history: list[dict], log_interval: int) -> tuple[float, float]:
    """(mean step seconds, tokens/s) of a run's metrics rows, its first log interval left out
    (compilation and warm-up) when there is more than one.

    tokens/s is the tokens of the steps over their summed time, not the mean of the rows'
    rates (a mean of rates overweights fast intervals).
    """
    steady = [m for m in history if m["iteration"] > log_interval] or history
    seconds = sum(m["step_time_s"] for m in steady)
    tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in steady)
    return seconds / len(steady), tokens / seconds
