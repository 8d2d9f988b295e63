"""Presentation only: rich tables and JSON for records computed elsewhere."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager

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
        t.add_row(
            str(r["seq_len"]),
            r["method"],
            f"{r['time_us_median']:.1f}",
            f"{r['gbps']:.0f}",
            f"{100 * r['frac_copy_bw']:.0f}",
            ratio,
        )
    if records and "device" in records[0]:
        t.caption = f"{records[0]['device']}; copy bandwidth {records[0]['copy_gbps']:.0f} GB/s"
    _console(file).print(t)


class GenerateView:
    """Rank 0's events rendered for a person: prefill progress on stderr, tokens streamed to
    stdout as text, and the JSON summary. Keeps every token id it was sent, so nothing
    generated is lost whatever happens to the ranks."""

    def __init__(self, tokenizer, *, stream: bool = True, progress: bool = True, out=None, err=None):
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

    def begin_stream(self) -> None:
        """Start streaming to stdout now (what has come so far first): the answer whose turn it is
        when several decode together and print in question order."""
        self.stream = True
        self._flush_text()

    def _progress(self, done, total):
        if not self.want_progress:
            return
        if self._bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("prefill"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("tokens  {task.fields[rate]}"),
                TimeElapsedColumn(),
                console=Console(file=self.err),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("prefill", total=total, rate="")
            self._t0, self._done0 = time.perf_counter(), done
        self._bar.update(
            self._task, completed=done, rate=prefill_rate(done - self._done0, time.perf_counter() - self._t0)
        )

    def _close_bar(self):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    @property
    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def _flush_text(self, final: bool = False):
        text = self.text
        if text.endswith("\ufffd") and not final:  # maybe an incomplete UTF-8 sequence: wait
            return
        if text.startswith(self._shown):
            self.out.write(text[len(self._shown) :])
            self.out.flush()
        self._shown = text

    # -- the end ---------------------------------------------------------------------------
    def finish(self, stop_reason: str | None = None, as_json: bool = False) -> dict:
        """Close the stream; returns (and with ``as_json`` prints) the run's record."""
        self._close_bar()
        if self.stream:
            self._flush_text(final=True)
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


def prefill_rate(tokens: int, seconds: float) -> str:
    """The prefill bar's rate: tokens done since the bar's first event over the time since then
    (the first event already counts a segment done before it; divided by the microseconds since,
    it read 155,349,838 tok/s), shown once there is a fifth of a second to measure."""
    return f"{tokens / seconds:,.0f} tok/s" if seconds >= 0.2 and tokens > 0 else ""


def stats_line(rec: dict) -> str:
    """One line of an answer's numbers: prompt tokens, prefill rate, time to first token,
    decode rate (what is known; an interrupted run may lack some)."""
    parts = []
    if rec.get("prompt_tokens") is not None:
        ctx = rec.get("context_tokens")
        parts.append(
            f"{rec['prompt_tokens']:,} prompt tokens"
            + (f" ({ctx:,} in the cache)" if ctx and ctx != rec["prompt_tokens"] else "")
        )
    how = {
        "disk": "loaded from the cache directory",
        "host": "copied back from host memory",
        "pool": "found in the pool",
    }.get((rec.get("document") or {}).get("source"))
    if how:  # (a document not prefilled by this request)
        parts.append(f"document {how} in {rec['document']['seconds']:.2f} s")
    elif (rec.get("document") or {}).get("loaded"):  # its first segments from a longer one's saved copy
        d = rec["document"]
        parts.append(
            f"document's first {d['loaded']:,} tokens loaded from the cache directory, the rest prefilled in {d['seconds']:.2f} s"
        )
    if rec.get("prefill_tokens_per_s"):
        parts.append(f"prefill {rec['prefill_tokens_per_s']:,.0f} tok/s")
    if rec.get("ttft_s"):
        parts.append(f"first token {rec['ttft_s']:.2f} s")
    if rec.get("decode_tokens_per_s"):
        parts.append(f"decode {rec['decode_tokens_per_s']:,.1f} tok/s")
    parts.append(f"{rec.get('new_tokens', 0)} new tokens")
    spec = rec.get("speculation") or {}
    if spec.get("drafted"):
        parts.append(f"{spec['accepted']}/{spec['drafted']} drafts accepted ({spec['accepted'] / spec['drafted']:.0%})")
    if rec.get("stop_reason") in ("interrupted", "terminated", "error"):
        parts.append(rec["stop_reason"])
    if rec.get("stop_reason") == "no_room":
        parts.append("not answered: the KV pool has no room for it")
    return "[" + ", ".join(parts) + "]"


def batch_line(info: dict) -> str:
    """The numbers of a batch of answers: how many, their tokens, wall time, aggregate rate."""
    secs = info["seconds"]
    return (
        f"[batch of {info['answers']} answers, {info['slots']} at a time: {info['new_tokens']:,} new tokens "
        f"in {secs:.2f} s, {info['new_tokens'] / secs if secs else 0:,.1f} tok/s aggregate]"
    )


def stdout_closed() -> int:
    """Standard output's reader went away (``| head``): point stdout at /dev/null, so nothing
    else fails on it (nor does the interpreter's last flush), and return the exit status of a
    command that SIGPIPE ended (141). No message: a closed pipe is how a reader says "enough"."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real descriptor (a test's captured stdout)
        pass
    finally:
        os.close(devnull)
    return 141


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
                cells.append(
                    c + (f"×{nv}" if nv and c.startswith("NV") else "") + (" (no P2P)" if p2p is False else "")
                )
            t.add_row(
                f"GPU{g['index']}",
                *cells,
                "" if g["numa"] is None else str(g["numa"]),
                " ".join(x for x in (g["name"], g["bus_id"]) if x),
            )
        con.print(t)
    else:
        con.print(f"no GPU found: {rec['cpu_ranks']} CPU ranks over gloo on loopback (one flat level)")
    for n in rec["notes"]:
        con.print(f"  note: {n}", style="dim")
    lay = rec["layout"]
    how = (
        rec["scheme"]
        if rec["scheme"] != "hierarchical"
        else f"hierarchical (inside groups: {lay['inner']}, across leaders: {lay['outer']})"
    )
    if rec.get("tp", 1) > 1:
        con.print(
            f"tensor parallel: --tp {rec['tp']}, tp groups {rec['tp_groups']} (each holds 1/{rec['tp']} of "
            f"the weights); the merge runs over each of the cp groups {rec['cp_groups']}; "
            f"below, ranks are indices within a cp group"
        )
    con.print(f"layout: groups {rec['groups']}  scheme {how}")
    s = rec["shape"]
    con.print(
        f"predicted merge time per decode step: {lay['predicted_step_us']:.1f} µs "
        f"({s['layers']} layers × {lay['predicted_layer_us']:.2f} µs; B={s['batch']}, H={s['heads']}, "
        f"d={s['head_dim']}; profile {rec['profile']})"
    )
    cands = sorted(lay["candidates_us"].items(), key=lambda kv: kv[1])[:6]
    con.print("  per layer: " + ", ".join(f"{k} {v:.2f} µs" for k, v in cands), style="dim")
    if "measured" in rec:
        m = rec["measured"]
        con.print(
            "measured all_reduce of one merge: "
            + ", ".join(f"[{k}] {v:.1f} µs" for k, v in m["allreduce_us"].items() if v is not None)
        )
        for k, v in sorted(m["pairs"].items()):
            con.print(f"  pair {k}: α {v['alpha_us']:.1f} µs, {v['bandwidth_gbps']:.2f} GB/s", style="dim")
        if "saved" in rec:
            con.print(f"profile saved to {rec['saved']} (use: generate --layout {rec['saved']})")


BENCH_FIELDS = [
    "method",
    "scheme",
    "nproc",
    "seq_len",
    "batch",
    "shared",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
    "layers",
    "step_ms_median",
    "step_ms_p10",
    "step_ms_p90",
    "bytes_per_step",
    "collectives_per_step",
    "peak_mem_bytes",
    "simulated",
    "device",
]


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def print_bench(records, as_json=False, file=None) -> None:
    """Bench records as a table with the ring/tree ratio per (N, p), or as JSON."""
    file = file or sys.stdout
    if as_json:
        print(json.dumps(records), file=file)
        return
    sim = bool(records and records[0].get("simulated"))
    shared = bool(records and records[0].get("shared"))
    t = Table(
        title="decode step: tree vs ring vs single"
        + (", B sequences over one shared document" if shared else "")
        + (" (simulated)" if sim else "")
    )
    for c in ("N", "B", "p", "method", "scheme", "ms", "p10–p90", "bytes", "coll", "mem", "ring ÷", "tok/s"):
        t.add_column(c, justify="right")
    ring = {(r["seq_len"], r["nproc"], r["batch"]): r["step_ms_median"] for r in records if r["method"] == "ring"}
    widest = {}  # (N, B) -> the ring over the most ranks: what a one-device row compares with
    for (n, p, b), ms in sorted(ring.items()):
        widest[n, b] = (p, ms)
    for r in records:
        spread = f"{r['step_ms_p10']:.2f}–{r['step_ms_p90']:.2f}" if "step_ms_p10" in r else ""
        base, vs = ring.get((r["seq_len"], r["nproc"], r["batch"])), ""
        if base is None and (r["seq_len"], r["batch"]) in widest:  # `single` runs on one rank
            p_ring, base = widest[r["seq_len"], r["batch"]]
            vs = f" (p={p_ring})"
        ratio = (
            f"×{base / r['step_ms_median']:.1f}{vs}"
            if base and r["method"] != "ring" and r["step_ms_median"] > 0
            else ""
        )
        rate = f"{r['batch'] * 1e3 / r['step_ms_median']:,.0f}" if r["step_ms_median"] else ""
        t.add_row(
            _fmt_tokens(r["seq_len"]),
            str(r["batch"]),
            str(r["nproc"]),
            r["method"],
            str(r.get("scheme", "")),
            f"{r['step_ms_median']:.3f}",
            spread,
            _fmt_bytes(r.get("bytes_per_step", 0)),
            str(r.get("collectives_per_step", "")),
            _fmt_bytes(r.get("peak_mem_bytes", 0)),
            ratio,
            rate,
        )
    if records:
        t.caption = (
            records[0].get("device", "")
            + (
                "; mem = KV per rank"
                if sim
                else "; ring ÷ = ring's step time / this row's (a one-rank row: "
                "against the ring over the most ranks, named)"
            )
            + "; tok/s = B / step time (attention only)"
        )
    _console(file).print(t)


def _fmt_tokens(n: int) -> str:
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % (div // 1024 if div > 1024 else 1) == 0:
            v = n / div
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.2f}{unit}"
    return str(n)


def _fmt_count(n: int) -> str:
    """A token count as 3.39M / 512K / 900 (binary units, like --seq-len's 1M)."""
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f}M"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.0f}K"
    return str(n)


def _console(file):
    """A console for ``file``: a terminal's own width, 140 columns when redirected."""
    return Console(file=file, width=None if getattr(file, "isatty", lambda: False)() else 140)


def write_csv(records, path) -> None:
    import csv
    import io

    buf = io.StringIO()
    keys = BENCH_FIELDS + sorted({k for r in records for k in r} - set(BENCH_FIELDS))
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
    w.writeheader()
    for r in records:
        w.writerow(r)
    from .paths import write_atomic

    write_atomic(path, buf.getvalue())


def write_plot(records, path) -> None:
    """Step time vs sequence length, one line per (method, scheme, p). Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'treeattn[plot]'") from None
    import os

    lines: dict = {}
    for r in records:
        key = f"{r['method']}" + (f" {r['scheme']}" if r["method"] == "tree" else "") + f" p={r['nproc']}"
        lines.setdefault(key, []).append((r["seq_len"], r["step_ms_median"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=key)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title("treeattn bench" + (f" — {records[0].get('device', '')}" if records else ""), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    from .paths import temp_beside

    tmp = temp_beside(path, ".png")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def print_check(records, as_json=False, file=None) -> None:
    """``treeattn check`` records: one row per (path, case), failures first in the summary."""
    file = file or sys.stdout
    if as_json:
        print(json.dumps(records, indent=1), file=file)
        return
    t = Table(title="treeattn check")
    for col, just in (
        ("path", "left"),
        ("case", "left"),
        ("max error", "right"),
        ("tolerance", "right"),
        ("ms", "right"),
        ("verdict", "left"),
        ("note", "left"),
    ):
        t.add_column(col, justify=just)
    for r in records:
        err = "-" if r["max_err"] is None else f"{r['max_err']:.2e}"
        tol = "-" if r["tol"] is None else f"{r['tol']:.0e}"
        style = {"FAIL": "bold red", "skipped": "dim"}.get(r["verdict"])
        t.add_row(r["path"], r["case"], err, tol, f"{1e3 * r['seconds']:.1f}", r["verdict"], r["note"], style=style)
    bad = sorted({r["path"] for r in records if r["verdict"] == "FAIL"})
    skipped = sorted({f"{r['path']}: {r['note']}" for r in records if r["verdict"] == "skipped"})
    t.caption = (f"FAILED: {', '.join(bad)}" if bad else "every path passed") + (
        f"; skipped: {'; '.join(skipped)}" if skipped else ""
    )
    t.caption_justify = "left"  # a verdict that wraps reads as a paragraph, not a centred block
    _console(file).print(t)


def print_fidelity(rec: dict, as_json=False, file=None) -> None:
    """``check --kv-dtype``: agreement of the lossy cache with the model's own dtype, and a verdict."""
    file = file or sys.stdout
    if as_json:
        print(json.dumps(rec, indent=1), file=file)
        return
    th = rec["thresholds"]
    t = Table(
        title=f"KV fidelity: {rec['kv_dtype']} against {rec['reference']}, {rec['tokens']} tokens of "
        f"{rec['document']} ({rec['device']})"
    )
    for col, just in (("measure", "left"), ("value", "right"), ("threshold", "right")):
        t.add_column(col, justify=just)
    t.add_row("top-1 agreement over the document", f"{rec['top1_agreement']:.4f}", f">= {th['top1_agreement']}")
    t.add_row("mean KL (nats)", f"{rec['kl_mean']:.5f}", f"<= {th['kl_mean']}")
    t.add_row(f"greedy agreement, {rec['greedy_tokens']} tokens", f"{rec['greedy_agreement']:.3f}", "-")
    t.add_row("greedy tokens equal before the first difference", str(rec["greedy_prefix"]), "-")
    b = rec["kv_bytes_per_token"]
    t.add_row(
        "KV bytes per token (one rank holds all)",
        f"{b['test']} vs {b['reference']} ({b['test'] / b['reference']:.3f}x)",
        "-",
    )
    t.caption = (
        f"within the thresholds: {rec['kv_dtype']} KV is fit for this model on documents like this one"
        if rec["ok"]
        else f"drifts beyond the thresholds: prefer --kv-dtype {rec['reference']} for this model"
    )
    t.caption_justify = "left"
    _console(file).print(t)


def print_prefill(records, as_json=False, file=None) -> None:
    """``bench --prefill`` (measured: per sharding, the slowest rank's time and the FLOP balance)
    or ``--prefill --simulate`` (a whole model's prefill time and parallel efficiency)."""
    file = file or sys.stdout
    if as_json:
        print(json.dumps(records, indent=1), file=file)
        return
    if records and records[0].get("simulated"):
        r0 = records[0]
        t = Table(title=f"prefill of {r0['model']} (simulated, {r0['profile']}, tp {r0['tp']}, MFU {r0['mfu']:.0%})")
        for col in (
            "GPUs",
            "tokens",
            "cp",
            "sharding",
            "prefill s",
            "ideal s",
            "efficiency",
            "attention s",
            "linear s",
            "TP all-reduce s",
            "exposed KV s",
        ):
            t.add_column(col, justify="right")
        for r in records:
            t.add_row(
                str(r["nproc"]),
                _fmt_tokens(r["seq_len"]),
                str(r["cp"]),
                r["method"],
                f"{r['prefill_s']:.1f}",
                f"{r['ideal_s']:.1f}",
                f"{r['efficiency']:.0%}",
                f"{r['attention_s']:.1f}",
                f"{r['linear_s']:.1f}",
                f"{r['tp_allreduce_s']:.2f}",
                f"{r['exposed_kv_s']:.2f}",
            )
        _console(file).print(t)
        return
    t = Table(title="prefill attention: balanced vs contiguous vs one rank")
    for col in (
        "tokens",
        "ranks",
        "sharding",
        "median ms",
        "p10–p90 ms",
        "FLOPs max/mean",
        "MB sent (max rank)",
        "vs contiguous",
    ):
        t.add_column(col, justify="right")
    cont = {(r["seq_len"], r["nproc"]): r["step_ms_median"] for r in records if r["method"] == "contiguous"}
    for r in records:
        base = (
            cont.get((r["seq_len"], r["nproc"]))
            if r["method"] != "single"
            else next((v for (n, p), v in cont.items() if n == r["seq_len"]), None)
        )
        t.add_row(
            _fmt_tokens(r["seq_len"]),
            str(r["nproc"]),
            r["method"],
            f"{r['step_ms_median']:.1f}",
            f"{r['step_ms_p10']:.1f}–{r['step_ms_p90']:.1f}",
            f"{r['flops_max_over_mean']:.2f}",
            f"{max(r['bytes_per_rank']) / 1e6:.1f}",
            f"{base / r['step_ms_median']:.2f}x" if base else "-",
        )
    if records:
        r0 = records[0]
        t.caption = (
            f"{r0['device']}; B={r0['batch']}, H={r0['heads']}, H_kv={r0['kv_heads']}, d={r0['head_dim']}, "
            f"{r0['dtype']}, {r0['layers']} layer(s) per timed step"
        )
    _console(file).print(t)


def print_mesh_projection(records, as_json=False, file=None) -> None:
    """``bench --simulate --model-shape``: one row per (GPUs, tokens, tp), the fastest fitting
    (tp, cp) of each (GPUs, tokens) marked."""
    file = file or sys.stdout
    if as_json:
        print(json.dumps(records, indent=1), file=file)
        return
    first = records[0] if records else {}
    shared = " sharing one document" if first.get("shared") else ""
    t = Table(
        title=f"decode step of {first.get('model', '?')} on a (cp x tp) mesh (simulated, "
        f"{first.get('profile', '?')}, B sequences{shared}, {first.get('dtype', '')})"
    )
    spec = "acceptance" in first
    cols = [
        "GPUs",
        "tokens",
        "B",
        "tp",
        "cp",
        "merge",
        "step ms",
        "tok/s",
        "weights ms",
        "KV ms",
        "TP all-reduce ms",
        "merge ms",
        "GB/GPU",
        "fits",
        "best",
    ]
    if spec:
        cols[8:8] = ["verify ms", "tok/s spec.", "× spec."]
    for col in cols:
        t.add_column(col, justify="right")
    for r in records:
        cells = [
            str(r["nproc"]),
            _fmt_tokens(r["seq_len"]),
            str(r["batch"]),
            str(r["tp"]),
            str(r["cp"]),
            r["scheme"],
            f"{r['step_ms_median']:.2f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['weights_ms']:.2f}",
            f"{r['kv_ms']:.2f}",
            f"{r['tp_allreduce_ms']:.2f}",
            f"{r['merge_ms']:.2f}",
            f"{r['mem_per_gpu_gb']:.1f}",
            "yes" if r["fits"] else "no",
            "*" if r.get("best") else "",
        ]
        if spec:
            cells[8:8] = [f"{r['verify_ms']:.2f}", f"{r['spec_tokens_per_s']:,.0f}", f"×{r['spec_gain']:.2f}"]
        t.add_row(*cells, style=None if r["fits"] else "dim")
    if spec:
        t.caption = (
            f"speculation: {first['draft_k']} drafts per step, each kept with probability {first['acceptance']}; "
            "a verify reads what a step reads and computes draft_k + 1 rows"
        )
    _console(file).print(t)


def print_census(records, as_json=False, file=None) -> None:
    """``bench --census``: the decode step's operations per layer and per step (one record)."""
    file = file or sys.stdout
    r = records[0]
    if as_json:
        print(json.dumps(r), file=file)
        return
    top = ", ".join(f"{k} {v}" for k, v in list(r["layer_ops"].items())[:8])
    print(
        f"{r['model_shape']}: {r['kernels_per_layer']} operations a layer"
        + (f" ({r['triton_per_layer']} of them Triton launches)" if r.get("triton_per_layer") else "")
        + f", {r['kernels_per_step']:,} a step ({r['layers']} layers + {r['model_level']} outside them); "
        f"a layer's most: {top}\n"
        f"[{r['counted_on']}]",
        file=file,
    )


def print_max_context(records, as_json=False, file=None) -> None:
    """``bench --simulate --max-context``: the longest context that fits, per model, GPUs, KV dtype, tp."""
    file = file or sys.stdout
    if as_json:
        print(json.dumps(records, indent=1), file=file)
        return
    first = records[0] if records else {}
    t = Table(
        title=f"longest context that fits (simulated, {first.get('profile', '?')}, weights "
        f"{first.get('dtype', '?')}, {first.get('reserve_gb', 0):.0f} GB per GPU kept for the rest)"
    )
    for col in (
        "model",
        "GPUs",
        "KV",
        "bytes/token",
        "tp",
        "cp",
        "weights GB/GPU",
        "KV room GB/GPU",
        "max context",
        "best",
    ):
        t.add_column(col, justify="left" if col in ("model", "KV") else "right")
    for r in records:
        t.add_row(
            r["model"],
            str(r["nproc"]),
            r["kv_dtype"],
            f"{r['kv_bytes_per_token']:,}",
            str(r["tp"]),
            str(r["cp"]),
            f"{r['weights_gb_per_gpu']:.1f}",
            f"{r['kv_room_gb_per_gpu']:.1f}",
            _fmt_count(r["max_context"]),
            "*" if r.get("best") else "",
            style=None if r.get("best") else "dim",
        )
    _console(file).print(t)


def print_model_records(records, as_json=False, file=None) -> None:
    file = file or sys.stdout
    if as_json:
        print(json.dumps(records), file=file)
        return
    t = Table(title="generate: decode per token by method")
    for c in ("prompt", "method", "p", "prefill s", "decode ms/token"):
        t.add_column(c, justify="right")
    for r in records:
        t.add_row(
            str(r["seq_len"]),
            r["method"],
            str(r.get("nproc", "")),
            f"{r['prefill_s']:.2f}",
            f"{r['decode_ms_per_token']:.1f}" if r.get("decode_ms_per_token") else "-",
        )
    _console(file).print(t)


@contextmanager
def sweep_progress(enabled: bool, file=None):
    """A progress bar on stderr over a sweep; yields ``update(done, total)`` (None if off)."""
    if not enabled:
        yield None
        return
    from rich.progress import Progress

    bar = Progress(console=Console(file=file or sys.stderr), transient=True)
    task = bar.add_task("bench", total=None)
    bar.start()
    try:
        yield lambda done, total: bar.update(task, completed=done, total=total)
    finally:
        bar.stop()
