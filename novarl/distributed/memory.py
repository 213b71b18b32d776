"""What a rank's process holds in memory: measured, for benchmarks and reports.

On CPU there is no allocator to ask, so two measures stand in for "GPU memory":
the peak resident set over a baseline (everything: model states, activations,
allocator slack) and the bytes of live torch tensors (model states at rest,
counted once per storage: views and tied weights once).

Linux: resident sizes come from /proc/self/status (VmRSS, VmHWM), and the peak
can be reset (`reset_peak`) so that a loading transient does not mask the
training peak. Elsewhere the peak is ru_maxrss and cannot be reset.
"""

from __future__ import annotations

import gc
import resource
import sys
import warnings
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    rss = _status_bytes("VmRSS")
    return rss if rss is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's peak resident set since start or the last `reset_peak`."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def reset_peak() -> bool:
    """Start the peak over from the current resident set (Linux); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of the distinct storages behind every live torch tensor on `device_type`."""
    import torch

    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.is_meta:
                continue
            tensor = getattr(obj, "_local_tensor", obj)  # a DTensor: its shard holds the storage
            if tensor.device.type != device_type:
                continue
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        except Exception:  # objects mid-teardown, tensor subclasses without storage
            continue
    return sum(seen.values())


def memory_report() -> dict[str, float]:
    """Bytes now: `rss` (resident set), `tensors` (live CPU tensors); on GPU also
    `cuda_peak` (the allocator's peak) and `cuda_tensors`."""
    import torch

    report = {"rss": float(current_rss_bytes()), "tensors": float(live_tensor_bytes("cpu"))}
    if torch.cuda.is_available():
        report["cuda_peak"] = float(torch.cuda.max_memory_allocated())
        report["cuda_tensors"] = float(live_tensor_bytes("cuda"))
    return report
