"""Presentation only: rich tables and JSON for records computed elsewhere."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table


def print_kernel_records(records, as_json=False, file=None):
    """Kernel-bench records as a table (or JSON on stdout), one row per (N, method)."""
    file = file or sys.stdout
    if as_json:
        print(json.dumps(records, indent=1), file=file)
        return
    t = Table(title="partial attention, decode (Q = 1)")
    for col in ("N", "method", "median µs", "GB/s", "% copy BW", "vs treeattn"):
        t.add_column(col, justify="right")
    ours = {r["seq_len"]: r.get("time_us_median") for r in records if r["method"] == "treeattn"}
    for r in records:
        if "error" in r:
            t.add_row(str(r["seq_len"]), r["method"], "-", "-", "-", r["error"][:40])
            continue
        base = ours.get(r["seq_len"])
        ratio = f"{r['time_us_median'] / base:.2f}x" if base else "-"
        t.add_row(str(r["seq_len"]), r["method"], f"{r['time_us_median']:.1f}", f"{r['gbps']:.0f}",
                  f"{100 * r['frac_copy_bw']:.0f}", ratio)
    if records and "device" in records[0]:
        t.caption = f"{records[0]['device']}; copy bandwidth {records[0]['copy_gbps']:.0f} GB/s"
    Console(file=file).print(t)
