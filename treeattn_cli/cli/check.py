"""``treeattn check``: prove, on this machine's devices and backend, every path it will take: the
kernels (``verify/kernels.py``, whose verdict ``generate`` consults), the merges and ring decode
across ranks and ``generate`` end to end (``verify/ranks.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..engine.job import plan_devices
from ..verify.kernels import kernel_checks, save_verdict, skipped
from ..verify.ranks import dist_rank, generate_checks


def check_command(*, nproc=None, device="auto", backend="auto", kernels_only=False,
                  on_progress=None) -> list[dict]:
    """Run every check for this machine (``kernels_only``: the kernel part, as ``generate`` does
    on first use); caches the kernel verdict; returns the records."""
    import tempfile

    from ..parallel.launch import run_local

    kind, be, n, devices = plan_devices(device, backend, nproc)
    dev = torch.device(devices[0])
    say = on_progress or (lambda what: None)
    say(f"kernels on {dev}")
    records = kernel_checks(dev, full=not kernels_only)
    save_verdict(dev, records)
    if kernels_only:
        return records
    say(f"merge schemes and ring decode on {n} {kind} rank(s) over {be}")
    try:
        records += run_local(dist_rank, n, 1234, backend=be, devices=devices, timeout_s=120)[0]
    except Exception as e:
        records.append({**skipped("merge/*", ""), "verdict": "FAIL", "note": str(e)[:200]})
    say("generate, tiny model, against transformers")
    with tempfile.TemporaryDirectory(prefix="treeattn-check-") as tmp:
        records += generate_checks(n, be, devices, Path(tmp))
    return records
