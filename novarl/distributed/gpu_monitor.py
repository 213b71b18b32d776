"""GPU memory and utilisation of the training ranks, per step (`logger.monitor_gpus`).

Each rank reads its own device: memory allocated now, the peak since the previous reading
(the step's peak: torch's counter is reset after each reading), memory reserved by the caching
allocator, and utilisation from NVML where it answers; the maximum over the ranks is logged
(`gpu_memory_peak_gb`: the rank closest to running out). Without CUDA there is nothing to
read and nothing is logged.
"""

from __future__ import annotations

GB = 1e9


def gpu_stats() -> dict[str, float]:
    """This rank's readings, maxed over the default process group (a collective: every
    training rank calls it). {} without CUDA."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return {}
    readings = torch.tensor([torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
                             torch.cuda.memory_reserved(), _utilization()], dtype=torch.float64, device="cuda")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(readings, op=dist.ReduceOp.MAX)
    torch.cuda.reset_peak_memory_stats()
    allocated, peak, reserved, utilization = readings.tolist()
    stats = {"gpu_memory_allocated_gb": allocated / GB, "gpu_memory_peak_gb": peak / GB,
             "gpu_memory_reserved_gb": reserved / GB}
    if utilization >= 0:
        stats["gpu_utilization_pct"] = utilization
    return stats


def _utilization() -> float:
    """The device's utilisation (%) over the last sample period from NVML, or -1 where NVML
    (the pynvml package, or the driver's library) is not there."""
    import torch

    try:
        return float(torch.cuda.utilization())
    except Exception:  # ModuleNotFoundError (pynvml), NVML errors
        return -1.0
