"""Memory free on a device now: what a rank's block pool (``engine/pool_sizing.py``) and its
host tier (``storage/host_tier.py``) are sized from."""

from __future__ import annotations

import torch


def free_memory(device: torch.device, ranks: int = 1) -> int:
    """Bytes free for this rank's KV now: a GPU's free memory, or a CPU's available memory
    (``MemAvailable``) over the ``ranks`` that share it."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024 // max(1, ranks)
    except (OSError, StopIteration, ValueError):
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, ranks)
