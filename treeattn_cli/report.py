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


class GenerateView:
    """Rank 0's events rendered for a person: prefill progress on stderr, tokens streamed to
    stdout as text, and the JSON summary. Keeps every token id it was sent, so nothing
    generated is lost whatever happens to the ranks."""

    def __init__(self, tokenizer, *, stream: bool = True, progress: bool = True,
                 out=None, err=None):
        self.tok = tokenizer
        self.stream, self.want_progress = stream, progress
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.ids: list[int] = []
        self.summary: dict = {}
        self._shown = ""  # text already written to stdout
        self._bar = None

    # -- events from rank 0 -----------------------------------------------------------
    def on_event(self, rank, kind, payload):
        if kind == "prefill":
            self._progress(*payload)
        elif kind == "token":
            self._close_bar()
            self.ids.append(int(payload))
            if self.stream:
                self._flush_text()
        elif kind == "done":
            self.summary = dict(payload)

    def _progress(self, done, total):
        if not self.want_progress:
            return
        if self._bar is None:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)

            self._bar = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("tokens  {task.fields[rate]}"), TimeElapsedColumn(),
                                 console=Console(file=self.err), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("prefill", total=total, rate="")
            self._t0 = __import__("time").perf_counter()
        dt = __import__("time").perf_counter() - self._t0
        self._bar.update(self._task, completed=done, rate=f"{done / dt:,.0f} tok/s" if dt > 0 else "")

    def _close_bar(self):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    @property
    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def _flush_text(self):
        text = self.text
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        if text.startswith(self._shown):
            self.out.write(text[len(self._shown):])
            self.out.flush()
        self._shown = text

    # -- the end ---------------------------------------------------------------------------
    def finish(self, stop_reason: str | None = None, as_json: bool = False) -> dict:
        """Close the stream; returns (and with ``as_json`` prints) the run's record."""
        self._close_bar()
        if self.stream:
            self._flush_text()
            if self._shown and not self._shown.endswith("\n"):
                self.out.write("\n")
            self.out.flush()
        record = {"text": self.text, "token_ids": list(self.ids), **self.summary}
        record["new_tokens"] = len(self.ids)
        if stop_reason is not None:
            record["stop_reason"] = stop_reason
        if as_json:
            print(json.dumps(record), file=self.out, flush=True)
        return record


def write_atomic(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    import os
    import tempfile

    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".treeattn-", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def print_topology(rec: dict, as_json: bool = False, file=None) -> None:
    """``treeattn topo``: the link matrix and the chosen layout (or the record as JSON)."""
    file = file or sys.stdout
    if as_json:
        print(json.dumps(rec), file=file)
        return
    con = Console(file=file)
    gpus = rec["gpus"]
    if gpus:
        t = Table(title=f"interconnect ({rec['source']})")
        t.add_column("")
        for g in gpus:
            t.add_column(f"GPU{g['index']}", justify="center")
        t.add_column("NUMA", justify="right")
        t.add_column("name / bus")
        for g, row in zip(gpus, rec["links"]):
            cells = []
            for j, c in enumerate(row):
                nv = rec["nvlinks"][g["index"]][j] if rec.get("nvlinks") else 0
                p2p = rec["p2p"][g["index"]][j] if rec.get("p2p") else None
                cells.append(c + (f"×{nv}" if nv and c.startswith("NV") else "") + (" (no P2P)" if p2p is False else ""))
            t.add_row(f"GPU{g['index']}", *cells, "" if g["numa"] is None else str(g["numa"]),
                      " ".join(x for x in (g["name"], g["bus_id"]) if x))
        con.print(t)
    else:
        con.print(f"no GPU found: {rec['cpu_ranks']} CPU ranks over gloo on loopback (one flat level)")
    for n in rec["notes"]:
        con.print(f"  note: {n}", style="dim")
    lay = rec["layout"]
    how = rec["scheme"] if rec["scheme"] != "hierarchical" else f"hierarchical (inside groups: {lay['inner']}, across leaders: {lay['outer']})"
    con.print(f"layout: groups {rec['groups']}  scheme {how}")
    s = rec["shape"]
    con.print(f"predicted merge time per decode step: {lay['predicted_step_us']:.1f} µs "
              f"({s['layers']} layers × {lay['predicted_layer_us']:.2f} µs; B={s['batch']}, H={s['heads']}, "
              f"d={s['head_dim']}; profile {rec['profile']})")
    cands = sorted(lay["candidates_us"].items(), key=lambda kv: kv[1])[:6]
    con.print("  per layer: " + ", ".join(f"{k} {v:.2f} µs" for k, v in cands), style="dim")
    if "measured" in rec:
        m = rec["measured"]
        con.print("measured all_reduce of one merge: " + ", ".join(
            f"[{k}] {v:.1f} µs" for k, v in m["allreduce_us"].items() if v is not None))
        for k, v in sorted(m["pairs"].items()):
            con.print(f"  pair {k}: α {v['alpha_us']:.1f} µs, {v['bandwidth_gbps']:.2f} GB/s", style="dim")
        if "saved" in rec:
            con.print(f"profile saved to {rec['saved']} (use: generate --layout {rec['saved']})")
