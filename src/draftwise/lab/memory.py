"""Peak memory of this process: RSS high-water mark (resettable on Linux) and CUDA max allocated."""
from __future__ import annotations

import resource
import sys


def reset_peak() -> None:
    """Reset the RSS high-water mark (Linux: write 5 to /proc/self/clear_refs) and CUDA's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory() -> dict:
    import torch

    out = {"peak_rss_mib": peak_rss_bytes() / 2**20, "cuda_max_allocated_mib": None}
    if torch.cuda.is_available():
        out["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out
