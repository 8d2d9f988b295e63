"""Every GPU measurement the project owes, in one command, into one report.

    python -m treeattn_cli.bench.gpu_report --out DIR --run 1      # then --run 2: 6 minutes each
    python -m treeattn_cli.bench.gpu_report --out DIR [--budget-s 540] [--only a,b]
    python -m treeattn_cli.bench.gpu_report --preflight

``--run 1`` and ``--run 2`` are the two measurement commands of at most 6 minutes (:data:`RUNS`),
the most valuable numbers first: the split kernel's levers and the whole decode step with its
kernel census (``gpu-kernels``, ``gpu-step``); then the batched step eager against captured and
the device tests (``batch-graphs``, ``pytest-gpu``). The steps' limits add up to more than one
10-minute call: run them in the calls of :data:`CALLS` into the same ``--out`` (the two runs,
then ``--steps check,check-ranks``, ``--steps kernel,decode,prefill,batch,batch-fp8``, ``--steps
model,speculate,serve`` and ``--steps kernel-tune``; each call's limits fit the budget); each
call merges into the report already there. Measuring steps print each record as it is
measured, so a step stopped at its limit keeps what it printed.

``--preflight`` runs nothing: it says whether every step could run here (the imports each step
needs, the GPU tools, the GPUs seen), a table of steps "ready" or "needs X", and exits 0 when
everything imports (also without a GPU: then there is nothing to measure), else 1 naming what
is missing. When ``treeattn_kernels`` is not installed but the checkout's ``kernels/`` is there
(a copy of the tree on a machine without network), the report makes it importable itself.

On whatever GPUs the machine has, one subprocess per step, each under its own time limit so the
whole run fits the budget (540 s: inside 10 minutes on one H100), and a failure or a timeout is
recorded and the next step runs:

- ``devices``: the GPUs, their memory, the CUDA/HIP runtime and driver;
- ``gpu-kernels``: the split kernel at Llama-8B's decode shape from graph replays: bf16, fp8 and
  its levers, paged against dense, rows over a document, a verify (``bench/gpu_kernels.py``);
- ``gpu-step``: the Llama-3.1-8B-shaped step through the engine's batch loop, bf16 and fp8, at
  32K and 128K against the memory floor, its kernel census and each GEMV (``bench/gpu_step.py``);
- ``check``: ``treeattn check --json`` on one GPU (kernels, merges, ``generate`` eager and with
  the CUDA graph against transformers);
- ``check-ranks``: with two or more GPUs, ``treeattn check --nproc N`` (merges and CUDA-graph
  decode across N ranks over NCCL);
- ``pytest-gpu``: ``pytest -m gpu tests`` (no ``-x``; the JUnit XML counted);
- ``kernel``: the decode kernel against SDPA and flex_attention, and its fraction of the
  measured copy bandwidth (``bench/kernel.py``);
- ``decode``: Llama-3.1-8B-shaped decode ms/token (random weights, CUDA graph) against the
  memory floor and transformers' eager step, and the time to first token (``gpu_decode.py``);
- ``prefill``: ``treeattn bench --prefill`` over every GPU;
- ``batch``: ``chat --batch``'s step, B = 1, 8, 64 questions over one 32K-token document
  (``treeattn bench --shared``), and ``batch-fp8`` the same over an fp8 cache at B = 1, 8, 32;
- ``batch-graphs``: the whole batched step of a random Llama-3.2-1B-shaped model through the
  engine, eager against replayed from CUDA graphs, B = 1, 8, 32, the document and the questions'
  tails in the block pool, read through block tables (``bench/host_step.py --cache pool``);
- ``kernel-tune``: the launch-parameter sweep (``--tune``): the best configuration per length
  and the runtime's own, with registers, spills, shared memory, tiles in flight, CTAs per SM;
- ``model``: ``generate`` end to end in bf16 with a bf16 and an fp8 cache against transformers
  on the same GPU (``bench/model.py``), ``speculate``: ``--speculate off/auto/ngram:10`` against
  transformers' prompt lookup (``bench/speculate.py``), ``serve``: first-token times of a
  document's first and later questions through ``treeattn serve`` (``bench/serve.py``); these
  three on a random-weight model of SmolLM2-135M's shape (``random_model.py``: the machine holds
  no weights), so their answers are a random model's, their times and equalities real.

A step whose imports are missing is skipped ("needs X"), not failed.
Writes ``DIR/report.json``, ``DIR/report.md`` and every step's output under ``DIR/logs/``.
Without a GPU it says so in the report, marks every GPU step skipped and exits 0 within
seconds. Exit status: 1 if a step failed or timed out, else 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

DEFAULT_BUDGET_S = 540.0
ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/ lives here in a checkout)
_PY = sys.executable
_CLI = [_PY, "-m", "treeattn_cli.main"]

_DEVICES_SNIPPET = r"""
import json, torch
out = {"available": torch.cuda.is_available(), "count": 0, "gpus": [],
       "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
if out["available"]:
    out["count"] = torch.cuda.device_count()
    for i in range(out["count"]):
        p = torch.cuda.get_device_properties(i)
        out["gpus"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                            "sms": p.multi_processor_count,
                            "capability": getattr(p, "gcnArchName", None) or f"{p.major}.{p.minor}"})
try:
    out["driver"] = open("/proc/driver/nvidia/version").read().splitlines()[0]
except OSError:
    out["driver"] = None
print(json.dumps(out))
"""


@dataclass
class Step:
    """One measurement: a command, its time limit (``cap_s``; never less than ``floor_s`` or
    it is skipped for want of budget), how many GPUs it needs, and a parser of its output
    into the report's key numbers (``parse(stdout, out_dir) -> dict``)."""

    name: str
    what: str
    argv: list
    cap_s: float
    floor_s: float = 20.0
    min_gpus: int = 1
    parse: Optional[Callable] = None
    env: dict = field(default_factory=dict)
    unavailable: str = ""  # why this step cannot run here at all (e.g. no tests/ folder)
    needs: tuple = ()  # modules the step imports (checked first: missing ones skip it, named)


# What the steps import: the engine's stack, and the test runner's.
ENGINE = ("torch", "triton", "treeattn_kernels", "typer", "rich", "yaml", "safetensors", "transformers")
KERNEL = ("torch", "triton", "treeattn_kernels")
TESTS = ENGINE + ("pytest", "hypothesis")
OPTIONAL = ("fastapi", "uvicorn", "openai", "httpx", "gguf")  # the serve tests skip without them
SERVE = ("fastapi", "uvicorn", "httpx")  # the serve step's server and client
RANDOM_SHAPE = "smollm2-135m"  # the model-level steps' random-weight model (random_model.py)


# ------------------------------------------------------------------ output parsers


def _json_values(text: str) -> list:
    """Every JSON value printed on stdout: the whole text, or JSON lines, or a JSON document
    starting at the first line that opens one (warnings may come first)."""
    text = text.strip()
    if not text:
        return []
    try:
        return [json.loads(text)]
    except ValueError:
        pass
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("[", "{")):
            try:
                return [json.loads("\n".join(lines[i:]))]
            except ValueError:
                break
    vals = []
    for line in lines:
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                vals.append(json.loads(line))
            except ValueError:
                pass
    return vals


def _records(text: str) -> list[dict]:
    out = []
    for v in _json_values(text):
        out += v if isinstance(v, list) else [v]
    return [r for r in out if isinstance(r, dict)]


def parse_devices(text: str, out_dir: Path) -> dict:
    vals = _json_values(text)
    return vals[0] if vals and isinstance(vals[0], dict) else {}


def parse_check(text: str, out_dir: Path) -> dict:
    recs = _records(text)
    verdicts = {}
    for r in recs:
        verdicts[r.get("verdict", "?")] = verdicts.get(r.get("verdict", "?"), 0) + 1
    return {
        "records": len(recs),
        "verdicts": verdicts,
        "failed": sorted({r["path"] for r in recs if r.get("verdict") == "FAIL"}),
        "graph": [
            f"{r['path']}: {r['verdict']}" + (f" ({r['note']})" if r.get("note") else "")
            for r in recs
            if "graph" in r.get("path", "")
        ],
    }


def parse_junit(text: str, out_dir: Path) -> dict:
    """pytest's JUnit XML; for a run stopped at its limit (no XML yet), its ``-v`` lines."""
    path = out_dir / "logs" / "pytest-gpu.xml"
    if not path.exists():
        results = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", text, re.M)
        count = {k: sum(1 for _, v in results if v == k) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
        return {
            "tests": len(results),
            "passed": count["PASSED"],
            "failures": count["FAILED"],
            "errors": count["ERROR"],
            "skipped": count["SKIPPED"],
            "complete": False,
            "failed_tests": [t for t, v in results if v in ("FAILED", "ERROR")][:20],
        }
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    count["passed"] = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    count["complete"] = True
    count["failed_tests"] = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in root.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ][:20]
    return count


def parse_kernel(text: str, out_dir: Path) -> dict:
    rows = {}
    for r in _records(text):
        if "time_us_median" in r:
            rows.setdefault(r["seq_len"], {})[r["method"]] = {
                "us": round(r["time_us_median"], 1),
                "gbps": round(r["gbps"], 1),
                "frac_copy_bw": round(r["frac_copy_bw"], 3),
            }
    return {"by_seq_len": rows}


def parse_tune(text: str, out_dir: Path) -> dict:
    recs = [r for r in _records(text) if "seq_len" in r]
    out = {}
    for n in sorted({r["seq_len"] for r in recs}):
        mine = [r for r in recs if r["seq_len"] == n]
        best = next((r for r in mine if r.get("best")), None)
        default = next((r for r in mine if r.get("default")), None)
        keep = (
            "block_n",
            "num_warps",
            "num_stages",
            "splits",
            "time_us",
            "frac_copy_bw",
            "regs",
            "spill_bytes",
            "shared_bytes",
            "tiles_in_flight",
            "ctas_per_sm",
        )
        out[n] = {
            "configs": len(mine),
            "errors": sum("error" in r for r in mine),
            "best": {k: best.get(k) for k in keep} if best else None,
            "default": {k: default.get(k) for k in keep} if default else None,
        }
    return {"by_seq_len": out}


def parse_decode(text: str, out_dir: Path) -> dict:
    rows, ttft = [], None
    for r in _records(text):
        if "context" in r:
            rows.append(
                {
                    k: r.get(k)
                    for k in (
                        "context",
                        "treeattn_ms",
                        "floor_ms",
                        "fraction_of_floor",
                        "transformers_ms",
                        "compiled_static_ms",
                        "cuda_graph",
                        "note",
                    )
                }
            )
        elif "ttft_prompt" in r:
            ttft = r
    return {"decode": rows, "ttft": ttft}


def parse_gpu_kernels(text: str, out_dir: Path) -> dict:
    """Per key count: each record's microseconds and fraction of the copy bandwidth by kind (a
    kind measured at several settings keeps them all), fp8's time against bf16's and the paged
    kernel's against the dense one's (issue 51's goals: <= 0.65 and within 5 %)."""
    out: dict = {}
    for r in _records(text):
        if "us" not in r or "N" not in r:
            continue
        row = out.setdefault(r["N"], {"records": {}})
        keep = {k: v for k, v in r.items() if k not in ("kind", "N", "t_s", "gbps")}
        row["records"].setdefault(r["kind"], []).append(keep)
    for row in out.values():
        first = {k: v[0]["us"] for k, v in row["records"].items()}
        if "bf16" in first and "fp8" in first:
            row["fp8_vs_bf16"] = round(first["fp8"] / first["bf16"], 3)
        if "bf16" in first and "paged-bf16" in first:
            row["paged_vs_dense"] = round(first["paged-bf16"] / first["bf16"], 3)
    return {"by_keys": out}


def parse_gpu_step(text: str, out_dir: Path) -> dict:
    """The step records (with their fraction of the floor), the censuses and the GEMVs."""
    recs = _records(text)
    steps = []
    for r in recs:
        if r.get("kind") == "step":
            ms = r.get("replay_ms") or r.get("overlapped_ms")
            floor = r.get("floor_ms")
            steps.append({**r, "of_floor": round(floor / ms, 3) if ms and floor else None})
    return {
        "device": next((r for r in recs if r.get("kind") == "device"), None),
        "steps": steps,
        "census": [r for r in recs if r.get("kind") == "census"],
        "gemv": [r for r in recs if r.get("kind") == "gemv"],
        "errors": [r for r in recs if "error" in r],
    }


def parse_prefill(text: str, out_dir: Path) -> dict:
    return {
        "cases": [
            {k: r.get(k) for k in ("method", "nproc", "seq_len", "step_ms_median", "flops_max_over_mean")}
            for r in _records(text)
            if "step_ms_median" in r
        ]
    }


def parse_batch(text: str, out_dir: Path) -> dict:
    """``bench --shared --batch``: step time per batch size, and against batch 1."""
    rows = {r["batch"]: r["step_ms_median"] for r in _records(text) if "step_ms_median" in r and "batch" in r}
    one = rows.get(1)
    return {
        "by_batch": {
            b: {"step_ms": round(ms, 3), "vs_batch_1": round(ms / one, 2) if one else None}
            for b, ms in sorted(rows.items())
        }
    }


def parse_batch_graphs(text: str, out_dir: Path) -> dict:
    """``bench.host_step``: ms per batched step by batch size, eager and captured, and the ratio."""
    rows: dict = {}
    for r in _records(text):
        if "ms_per_step" in r and "graphs" in r:
            rows.setdefault(r["batch"], {})["captured" if r["graphs"] else "eager"] = {
                "ms": round(r["ms_per_step"], 3),
                "replays": r.get("graph_replays"),
            }
    out = {}
    for b, m in sorted(rows.items()):
        e, c = (m.get(k, {}).get("ms") for k in ("eager", "captured"))
        out[b] = {
            "eager_ms": e,
            "captured_ms": c,
            "replays": m.get("captured", {}).get("replays"),
            "speedup": round(e / c, 2) if e and c else None,
        }
    return {"by_batch": out}


def parse_model(text: str, out_dir: Path) -> dict:
    """``bench.model``: decode ms/token and prefill s per method and cache storage, same tokens."""
    return {
        "rows": [
            {
                k: r.get(k)
                for k in (
                    "prompt_tokens",
                    "method",
                    "kv_dtype",
                    "prefill_s",
                    "decode_ms_per_token",
                    "same_tokens_as_transformers",
                    "device",
                    "dtype",
                )
            }
            for r in _records(text)
            if "decode_ms_per_token" in r
        ]
    }


def parse_speculate(text: str, out_dir: Path) -> dict:
    """``bench.speculate``: per request and method, ms/token, x off, drafts kept, same tokens."""
    rows = []
    for r in _records(text):
        if "speedup_vs_off" not in r:
            continue
        sp = r.get("speculation") or {}
        rows.append(
            {
                "request": r["request"],
                "method": r["method"],
                "ms": r["decode_ms_per_token"],
                "x_off": r["speedup_vs_off"],
                "accepted": sp.get("accepted"),
                "drafted": sp.get("drafted"),
                "same_tokens_as_off": r.get("same_tokens_as_off"),
            }
        )
    return {"rows": rows}


def parse_serve(text: str, out_dir: Path) -> dict:
    """``bench.serve``: first-token and whole-answer seconds per request, cached tokens."""
    return {
        "requests": [
            {k: r.get(k) for k in ("request", "prompt_tokens", "cached_tokens", "ttft_s", "total_s")}
            for r in _records(text)
            if "ttft_s" in r
        ]
    }


# ------------------------------------------------------------------ the steps


def default_steps(n_gpus: int, out_dir: Path) -> list[Step]:
    """The owed measurements, in the order they run (correctness first, then speed; the long
    tuning sweep last), with time limits meant to fit one H100 in :data:`DEFAULT_BUDGET_S`."""
    junit = out_dir / "logs" / "pytest-gpu.xml"
    steps = [
        Step(
            "gpu-kernels",
            "the split kernel at Llama-8B's decode shape, 32K then 128K then 8K keys: bf16, fp8 and its "
            "levers (splits, warps, tiles), paged against dense, rows over a document, a verify of 17",
            [_PY, "-m", "treeattn_cli.bench.gpu_kernels", "--keys", "32768,131072,8192"],
            cap_s=170,
            parse=parse_gpu_kernels,
            needs=KERNEL,
        ),
        Step(
            "gpu-step",
            "Llama-3.1-8B-shaped decode step through the engine's batch loop, bf16 and fp8 at 32K and 128K: "
            "synced, overlapped and replayed ms against the memory floor, its kernel census, each GEMV's bandwidth",
            [_PY, "-m", "treeattn_cli.bench.gpu_step", "--contexts", "32768,131072"],
            cap_s=170,
            parse=parse_gpu_step,
            needs=ENGINE,
        ),
        Step(
            "check",
            "treeattn check on one GPU: kernels, merges, generate eager and CUDA graph vs transformers",
            # progress lines (to the step's .err, each with its start time): on an H100 the check
            # did not finish within 81 s, and --quiet left nothing to say where the time went
            [*_CLI, "check", "--nproc", "1", "--json"],
            cap_s=150,
            parse=parse_check,
            needs=ENGINE,
        ),
        Step(
            "check-ranks",
            "treeattn check over every GPU as ranks: merges and CUDA-graph decode with NCCL",
            [*_CLI, "check", "--nproc", str(max(2, n_gpus)), "--json"],
            cap_s=150,
            min_gpus=2,
            parse=parse_check,
            needs=ENGINE,
        ),
        Step(
            "pytest-gpu",
            "pytest -m gpu tests (every device test, no -x; check ran above)",
            [
                _PY,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-v",
                "--durations=10",
                "-p",
                "no:cacheprovider",
                "--continue-on-collection-errors",  # a module that cannot import costs its tests only
                # a node id relative to the rootdir (the step runs in ROOT): pytest matches an
                # absolute path against none, and the check ran a second time (seen on an H100)
                "--deselect",
                "tests/test_gpu.py::test_check_passes_on_this_gpu",
                "--deselect",  # a minute of compiles; the kernel-tune step sweeps the same
                "tests/test_gpu.py::test_tune_sweep_reports_resources",
                f"--junitxml={junit}",
                str(ROOT / "tests"),
            ],
            cap_s=200,
            parse=parse_junit,
            needs=TESTS,
            unavailable="" if (ROOT / "tests").is_dir() else f"no tests/ folder beside the package ({ROOT})",
        ),
        Step(
            "kernel",
            "decode kernel (bf16 and fp8 KV) vs SDPA / flex_attention, fraction of copy bandwidth (Llama-8B shape)",
            [_PY, "-m", "treeattn_cli.bench.kernel", "--seq-len", "8192,32768,131072", "--kv-dtype", "fp8", "--json"],
            cap_s=120,
            parse=parse_kernel,
            needs=KERNEL,
        ),  # flex_attention compiles once per length
        Step(
            "decode",
            "Llama-3.1-8B-shaped decode ms/token (CUDA graph) vs memory floor and transformers; TTFT",
            [
                _PY,
                "-m",
                "treeattn_cli.bench.gpu_decode",
                "--contexts",
                "32768,131072",
                "--steps",
                "20",
                "--ttft",
                "32768",
                "--skip-compiled",
            ],
            cap_s=150,
            parse=parse_decode,
            needs=ENGINE,
        ),
        Step(
            "prefill",
            "causal prefill attention per sharding over every GPU (treeattn bench --prefill)",
            [*_CLI, "bench", "--prefill", "--seq-len", "16384,65536", "--json"],
            cap_s=90,
            parse=parse_prefill,
            needs=ENGINE,
        ),
        Step(
            "batch",
            "chat --batch's step: B questions over one 32K-token document on one GPU, B = 1, 8, 64 (bench --shared)",
            [
                *_CLI,
                "bench",
                "--shared",
                "--batch",
                "1,8,64",
                "--seq-len",
                "32768",
                "--nproc",
                "1",
                "--methods",
                "tree",
                "--json",
            ],
            cap_s=90,
            parse=parse_batch,
            needs=ENGINE,
        ),
        Step(
            "batch-fp8",
            "the same step over an fp8 cache, B = 1, 8, 32: one read of each K/V tile for every "
            "question's rows (issue 38), against bf16's above",
            [
                *_CLI,
                "bench",
                "--shared",
                "--batch",
                "1,8,32",
                "--seq-len",
                "32768",
                "--nproc",
                "1",
                "--methods",
                "tree",
                "--kv-dtype",
                "fp8",
                "--json",
            ],
            cap_s=90,
            parse=parse_batch,
            needs=ENGINE,
        ),
        Step(
            "batch-graphs",
            "the engine's batched step, eager vs replayed from CUDA graphs, B = 1, 8, 32 over an "
            "8K-token document in the block pool, each question's tail too, both read through "
            "block tables (random Llama-3.2-1B shape; issue 38: captured >= 2x faster at B 1-8)",
            [
                _PY,
                "-m",
                "treeattn_cli.bench.host_step",
                "--device",
                "cuda",
                "--random",
                "llama-1b",
                "--nproc",
                "1",
                "--batch",
                "1,8,32",
                "--graphs",
                "off,on",
                "--tokens",
                "40",
                "--repeats",
                "3",
                "--doc-tokens",
                "8192",
                "--cache",
                "pool",
            ],
            cap_s=150,
            parse=parse_batch_graphs,
            needs=ENGINE,
        ),
        Step(
            "kernel-tune",
            "launch-parameter sweep of the split kernel (block, warps, stages, splits)",
            [
                _PY,
                "-m",
                "treeattn_cli.bench.kernel",
                "--tune",
                "--seq-len",
                "32768,131072",
                "--iters",
                "10",
                "--warmup",
                "3",
                "--json",
            ],
            cap_s=150,
            parse=parse_tune,
            needs=KERNEL,
        ),
        Step(
            "model",
            "generate end to end in bf16, bf16 and fp8 KV, against transformers on the same GPU "
            f"(random weights, {RANDOM_SHAPE}'s shape)",
            [
                _PY,
                "-m",
                "treeattn_cli.bench.model",
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
                "--random",
                RANDOM_SHAPE,
                "--prompt-tokens",
                "8192,32768",
                "--nproc",
                "1",
                "--new-tokens",
                "64",
                "--kv-dtypes",
                "auto,fp8",
                "--json",
            ],
            cap_s=120,
            parse=parse_model,
            needs=ENGINE,
        ),
        Step(
            "speculate",
            "--speculate off / auto / ngram:10 against transformers' prompt lookup, bf16 on the GPU (random weights)",
            [
                _PY,
                "-m",
                "treeattn_cli.bench.speculate",
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
                "--random",
                RANDOM_SHAPE,
                "--doc-tokens",
                "4000",
                "--new-tokens",
                "128",
                "--json",
            ],
            cap_s=150,
            parse=parse_speculate,
            needs=ENGINE,
        ),
        Step(
            "serve",
            "treeattn serve: first token of a document's first and later questions (random weights)",
            [
                _PY,
                "-m",
                "treeattn_cli.bench.serve",
                "--random",
                RANDOM_SHAPE,
                "--nproc",
                str(max(1, min(2, n_gpus))),
                "--doc-tokens",
                "8000",
                "--questions",
                "3",
                "--new-tokens",
                "32",
                "--json",
            ],
            cap_s=120,
            parse=parse_serve,
            needs=ENGINE + SERVE,
        ),
    ]
    return steps


# Issue 51's two measurement commands, the most valuable numbers first, each at most 6 minutes
# (``--run 1``, ``--run 2``): the kernels and the whole step; the batched step eager against
# captured, then the device tests.
RUNS = {"1": "gpu-kernels,gpu-step", "2": "batch-graphs,pytest-gpu"}
RUN_BUDGET_S = 360.0

# The calls that cover every step within one 10-minute call each (caps: 340, 350, 150, 540, 390
# and 150 s; on a machine with 2+ GPUs check-ranks adds 150 s to the third): ``--steps`` of each.
CALLS = (
    RUNS["1"],
    RUNS["2"],
    "check,check-ranks",
    "kernel,decode,prefill,batch,batch-fp8",
    "model,speculate,serve",
    "kernel-tune",
)


# Oldest versions the steps work with (pyproject's floors; Triton's: the kernels use
# do_not_specialize_on_alignment, from 3.2): an older one counts as missing, named with both.
FLOORS = {"transformers": "5.23", "triton": "3.2", "torch": "2.5"}

_IMPORTS_SNIPPET = r"""
import importlib, json, sys
from importlib import metadata
floors = json.loads(sys.argv[1])
dists = {"yaml": "PyYAML", "treeattn_kernels": "treeattn"}
def key(v):
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return out
out = {}
for name in sys.argv[2:]:
    try:
        m = importlib.import_module(name)
        v = getattr(m, "__version__", None)
        if not isinstance(v, str):
            try:
                v = metadata.version(dists.get(name, name))
            except Exception:
                v = None
        r = {"ok": True, "version": v, "file": getattr(m, "__file__", None)}
        if name in floors and v and key(v) < key(floors[name]):
            r.update(ok=False, error=f"{v} is older than {floors[name]}")
        out[name] = r
    except Exception as e:  # ImportError, or a broken install
        out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
print(json.dumps(out))
"""


def probe_imports(names, env: dict) -> dict:
    """``{module: {"ok", "version" | "error"}}``, imported in a child process (this one stays
    light and never holds a GPU context), with ``env`` (its PYTHONPATH) as the steps get it."""
    r = subprocess.run(
        [_PY, "-c", _IMPORTS_SNIPPET, json.dumps(FLOORS), *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT) if (ROOT / "pyproject.toml").exists() else None,
    )
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {n: {"ok": False, "error": (r.stderr or "the import probe failed").strip()[-200:]} for n in names}


def kernels_shim(env: dict, where: Path) -> str | None:
    """When ``treeattn_kernels`` is not installed but the checkout's ``kernels/`` is there (a copy
    of the tree, not installed: pip needs the network for that), put a link named
    ``treeattn_kernels`` on the steps' ``PYTHONPATH``; returns what was done, or None."""
    import importlib.util

    if importlib.util.find_spec("treeattn_kernels") is not None:  # installed (found, not imported: cheap)
        return None
    src = ROOT / "kernels"
    if not (src / "__init__.py").exists():
        return None
    shim = where / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "treeattn_kernels"
    if not link.exists():
        link.symlink_to(src, target_is_directory=True)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), str(ROOT), env.get("PYTHONPATH", "")) if p)
    return f"treeattn_kernels is not installed: the checkout's {src} is used (through {link})"


def _step_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the real GPU
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


def _missing(st: Step, imports: dict) -> list[str]:
    return [n for n in st.needs if not imports.get(n, {}).get("ok")]


def preflight(out_dir=None) -> tuple[int, str]:
    """Whether every step could run here: ``(exit status, the text to print)``."""
    import shutil
    import tempfile

    where = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="treeattn-preflight-"))
    env = _step_env()
    shim = kernels_shim(env, where)
    names = list(dict.fromkeys(ENGINE + TESTS + OPTIONAL))
    imports = probe_imports(names, env)
    rc, text, _ = (
        _run([_PY, "-c", _DEVICES_SNIPPET], 60.0, _logs(where) / "devices", env)
        if imports.get("torch", {}).get("ok")
        else (1, "", 0.0)
    )
    devices = parse_devices(text, where) if rc == 0 else {}
    n_gpus = int(devices.get("count") or 0)
    lines = ["treeattn gpu_report preflight", ""]
    if shim:
        lines += [f"note: {shim}", ""]
    lines.append("imports:")
    for n in names:
        r = imports.get(n, {})
        state = (
            f"ok {r.get('version') or ''}".rstrip()
            if r.get("ok")
            else f"{'TOO OLD' if 'older than' in r.get('error', '') else 'MISSING'} ({r.get('error', '?')})"
        )
        lines.append(
            f"  {n:18} {state}"
            + ("   (optional: the serve tests skip without it)" if n in OPTIONAL and not r.get("ok") else "")
        )
    tools = {t: shutil.which(t) for t in ("nvidia-smi", "rocm-smi")}
    lines += [
        "",
        "tools: " + ", ".join(f"{t} {'at ' + p if p else 'not found'}" for t, p in tools.items()),
        "GPUs: "
        + (
            "; ".join(f"{g['name']} ({g['memory_gib']} GiB, {g['capability']})" for g in devices.get("gpus", []))
            or "none seen"
        ),
        "",
        "steps:",
    ]
    needed = set()
    for st in default_steps(max(n_gpus, 1), where):
        miss = _missing(st, imports)
        needed |= set(miss)
        if miss:
            state = "needs " + ", ".join(miss)
        elif st.unavailable:
            state = st.unavailable
        elif n_gpus < st.min_gpus:
            state = "ready (nothing to measure: no GPU)" if not n_gpus else f"ready, needs {st.min_gpus} GPUs"
        else:
            state = "ready"
        lines.append(f"  {st.name:12} {state}")
    if needed:
        lines += [
            "",
            f"preflight: missing {', '.join(sorted(needed))}: install them (docs/gpus.md: GPU machines "
            "without network), then run this again",
        ]
        return 1, "\n".join(lines)
    lines += [
        "",
        "preflight: every step can run"
        + ("" if n_gpus else "; no GPU here, so there is nothing to measure on this machine"),
    ]
    return 0, "\n".join(lines)


def _logs(where: Path) -> Path:
    (where / "logs").mkdir(parents=True, exist_ok=True)
    return where / "logs"


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("treeattn", "torch", "triton", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _run(argv, timeout_s: float, log: Path, env: dict) -> tuple:
    """Run ``argv`` in its own process group with a time limit; returns ``(returncode or None
    on timeout, stdout, seconds)``. Output goes to ``log.out`` / ``log.err`` as it comes."""
    t0 = time.perf_counter()
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        p = subprocess.Popen(
            argv,
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,
            cwd=str(ROOT) if (ROOT / "pyproject.toml").exists() else None,
        )
        try:
            rc = p.wait(timeout=max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(p.pid, sig)  # the step and every rank it started
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
    return rc, log.with_suffix(".out").read_text(errors="replace"), time.perf_counter() - t0


def _tail(path: Path, n: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def run_report(
    out_dir, budget_s: float = DEFAULT_BUDGET_S, *, steps=None, devices=None, only=None, clock=time.perf_counter
) -> dict:
    """Run every step that fits, write ``report.json`` and ``report.md`` under ``out_dir`` and
    return the report. ``only``: the names of the steps to run; ``steps`` and ``devices`` (the
    ``devices`` step's answer) replace the defaults (tests).

    Time: each step runs under ``min(its cap, what the budget leaves after the later steps'
    floors)``; an earlier step (they run in priority order) that would get less than its own
    floor takes what is left instead, and a step that cannot get its floor is skipped."""
    out_dir = Path(out_dir).resolve()  # the steps run from the repository: absolute paths
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    start = clock()
    env = _step_env()
    rep = {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "budget_s": budget_s,
        "versions": _versions(),
        "steps": [],
    }
    shim = kernels_shim(env, out_dir)
    if shim:
        rep["shim"] = shim

    if devices is None:  # the devices step: its own process, so this one never holds a GPU context
        rc, text, secs = _run([_PY, "-c", _DEVICES_SNIPPET], min(60.0, budget_s), out_dir / "logs" / "devices", env)
        devices = parse_devices(text, out_dir) if rc == 0 else {}
        rep["steps"].append(
            {
                "name": "devices",
                "what": "GPUs, runtime and driver",
                "status": "pass" if rc == 0 else ("timeout" if rc is None else "fail"),
                "seconds": round(secs, 1),
                "reason": "" if rc == 0 else _tail(out_dir / "logs" / "devices.err"),
                "summary": devices,
            }
        )
    n_gpus = int(devices.get("count") or 0)
    rep["devices"] = devices
    rep["gpu_count"] = n_gpus
    if not n_gpus:
        rep["note"] = (
            "no GPU found (torch.cuda.is_available() is False): no GPU measurement was possible "
            "on this machine; every GPU step is skipped"
        )
    steps = default_steps(n_gpus, out_dir) if steps is None else steps
    if only is not None:
        steps = [s for s in steps if s.name in only]
    needs = sorted({n for s in steps for n in s.needs})
    imports = probe_imports(needs, env) if needs and n_gpus else {}

    for i, st in enumerate(steps):
        rec = {
            "name": st.name,
            "what": st.what,
            "command": " ".join(map(str, st.argv)),
            "status": "skipped",
            "seconds": 0.0,
            "timeout_s": None,
            "reason": "",
            "summary": {},
        }
        rep["steps"].append(rec)
        if n_gpus < st.min_gpus:
            rec["reason"] = "no GPU" if not n_gpus else f"needs {st.min_gpus} GPUs, this machine has {n_gpus}"
            continue
        if st.unavailable:
            rec["reason"] = st.unavailable
            continue
        miss = _missing(st, imports)
        if miss:
            rec["reason"] = "needs " + ", ".join(miss)
            continue
        left = budget_s - (clock() - start)
        later = sum(
            s.floor_s for s in steps[i + 1 :] if n_gpus >= s.min_gpus and not s.unavailable and not _missing(s, imports)
        )
        limit = min(st.cap_s, left - later)
        if limit < st.floor_s:
            limit = min(st.cap_s, left)  # what the later steps would get anyway; never past the budget
            if limit < st.floor_s:
                rec["reason"] = f"out of budget: {max(0.0, left):.0f} s left of {budget_s:.0f} s"
                continue
        rec["timeout_s"] = round(limit, 1)
        rc, text, secs = _run(st.argv, limit, out_dir / "logs" / st.name, {**env, **st.env})
        rec["seconds"] = round(secs, 1)
        rec["returncode"] = rc
        if rc is None:
            rec["status"], rec["reason"] = "timeout", f"stopped at its limit of {limit:.0f} s"
        else:
            rec["status"] = "pass" if rc == 0 else "fail"
            if rc != 0:
                rec["reason"] = f"exit status {rc}: " + _tail(out_dir / "logs" / f"{st.name}.err", 300)
        if st.parse is not None:
            try:
                rec["summary"] = st.parse(text, out_dir)
            except Exception as e:  # a parser's failure is a result too, never the end of the report
                rec["summary"] = {"parse_error": f"{type(e).__name__}: {e}"[:200]}
    rep["elapsed_s"] = round(clock() - start, 1)
    rep = _merged(out_dir / "report.json", rep)
    (out_dir / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    (out_dir / "report.md").write_text(markdown(rep))
    return rep


def _merged(path: Path, rep: dict) -> dict:
    """This call's report merged into the one already in ``--out`` (several shorter calls, e.g.
    ``--steps check,pytest-gpu`` then ``--steps kernel,decode``, make one report): a step this
    call ran replaces the earlier record of it; steps it skipped for want of budget, or did not
    select, keep what an earlier call measured."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return rep
    if (old.get("host"), old.get("devices")) != (rep.get("host"), rep.get("devices")):
        return rep  # another machine's report: replaced, never mixed
    ran = {
        s["name"]: s
        for s in rep["steps"]
        if s["status"] != "skipped" or not s.get("reason", "").startswith("out of budget")
    }
    steps = [ran.pop(s["name"], s) for s in old.get("steps", [])]
    steps += [s for s in rep["steps"] if s["name"] in ran]
    return {
        **rep,
        "steps": steps,
        "calls": old.get("calls", 1) + 1,
        "elapsed_s": round(old.get("elapsed_s", 0) + rep.get("elapsed_s", 0), 1),
    }


# ------------------------------------------------------------------ Markdown


def _fmt(v, nd=3):
    if isinstance(v, float):
        return f"{v:.{nd}g}"
    return "-" if v is None else str(v)


def _key_numbers(step: dict) -> str:
    s, name = step.get("summary") or {}, step["name"]
    if not s:
        return ""
    if "parse_error" in s:
        return f"unparsed output: {s['parse_error']}"
    if name == "devices":
        return "; ".join(f"{g['name']} ({g['memory_gib']} GiB, {g['sms']} SMs)" for g in s.get("gpus", [])) or "none"
    if name.startswith("check"):
        bad = s.get("failed") or []
        return f"{s.get('records', 0)} checks {s.get('verdicts', {})}" + (f"; FAILED: {', '.join(bad)}" if bad else "")
    if name == "pytest-gpu":
        return (
            f"{s.get('passed', 0)} passed, {s.get('failures', 0)} failed, {s.get('errors', 0)} errors, "
            f"{s.get('skipped', 0)} skipped"
        )
    if name == "kernel":
        return "; ".join(
            f"{n}: {m['treeattn']['us']} us, {m['treeattn']['frac_copy_bw']:.0%} of copy BW"
            for n, m in s.get("by_seq_len", {}).items()
            if "treeattn" in m
        )
    if name == "gpu-kernels":
        return "; ".join(
            f"{n}: bf16 {_fmt(r['records']['bf16'][0]['us'])} us, fp8 {_fmt(r.get('fp8_vs_bf16'))}x, "
            f"paged {_fmt(r.get('paged_vs_dense'))}x dense"
            for n, r in s.get("by_keys", {}).items()
            if "bf16" in r["records"]
        )
    if name == "gpu-step":
        parts = [
            f"{r['kv']} {r['N']}: {_fmt(r.get('replay_ms') or r.get('overlapped_ms'))} ms "
            f"({_fmt(r.get('of_floor'))} of floor)"
            for r in s.get("steps", [])
        ]
        parts += [
            f"{c['kv']} census: {sum(v['kernels'] for v in c['per_step'].values()):.0f} kernels/step"
            for c in s.get("census", [])
        ]
        return "; ".join(parts)
    if name == "kernel-tune":
        parts = []
        for n, r in s.get("by_seq_len", {}).items():
            b, d = r.get("best") or {}, r.get("default") or {}
            parts.append(
                f"{n}: default {_fmt(d.get('time_us'))} us, best {_fmt(b.get('time_us'))} us "
                f"(BN {b.get('block_n')}, {b.get('num_warps')} warps, {b.get('num_stages')} stages, "
                f"{b.get('splits')} splits)"
            )
        return "; ".join(parts)
    if name == "decode":
        parts = [
            f"{r['context']}: {_fmt(r['treeattn_ms'])} ms/token ({_fmt(r.get('fraction_of_floor'))} of floor "
            f"{_fmt(r['floor_ms'])} ms; transformers {_fmt(r.get('transformers_ms'))} ms)"
            for r in s.get("decode", [])
        ]
        if s.get("ttft"):
            parts.append(f"TTFT {s['ttft']['ttft_prompt']} tokens: {_fmt(s['ttft']['prefill_s'])} s")
        return "; ".join(parts)
    if name in ("batch", "batch-fp8"):
        return "; ".join(f"B={b}: {r['step_ms']} ms ({r['vs_batch_1']}x B=1)" for b, r in s.get("by_batch", {}).items())
    if name == "batch-graphs":
        return "; ".join(
            f"B={b}: eager {_fmt(r['eager_ms'])} ms, captured {_fmt(r['captured_ms'])} ms ({_fmt(r['speedup'])}x)"
            for b, r in s.get("by_batch", {}).items()
        )
    if name == "model":
        return "; ".join(
            f"{r['prompt_tokens']} {r['method']} {r.get('kv_dtype') or ''}: "
            f"{_fmt(r['decode_ms_per_token'])} ms/token"
            + (
                ""
                if r.get("same_tokens_as_transformers") is None
                else f", same tokens {r['same_tokens_as_transformers']}"
            )
            for r in s.get("rows", [])
        )
    if name == "speculate":
        return "; ".join(
            f"{r['request']} {r['method']}: {_fmt(r['ms'])} ms ({_fmt(r['x_off'])}x)"
            + (f", {r['accepted']}/{r['drafted']} kept" if r.get("drafted") else "")
            for r in s.get("rows", [])
        )
    if name == "serve":
        return "; ".join(
            f"#{r['request']}: first token {_fmt(r['ttft_s'])} s ({r.get('cached_tokens')} cached)"
            for r in s.get("requests", [])
        )
    if name == "prefill":
        return "; ".join(
            f"{c['method']} x{c['nproc']} {c['seq_len']}: {_fmt(c['step_ms_median'])} ms" for c in s.get("cases", [])
        )
    return json.dumps(s)[:300]


def markdown(rep: dict) -> str:
    """The report for people: what ran where, each step's status, time and key numbers."""
    dev = rep.get("devices") or {}
    gpus = dev.get("gpus") or []
    v = rep.get("versions", {})
    lines = [
        "# treeattn GPU report",
        "",
        f"- created: {rep['created']} on `{rep['host']}`",
        "- GPUs: " + (", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in gpus) if gpus else "**none**"),
        f"- runtime: CUDA {dev.get('cuda')}, HIP {dev.get('hip')}; driver: {dev.get('driver') or '-'}",
        "- versions: " + ", ".join(f"{k} {v[k]}" for k in v),
        f"- budget {rep['budget_s']:.0f} s, elapsed {rep.get('elapsed_s', 0):.0f} s",
        "",
    ]
    if rep.get("note"):
        lines += [f"> {rep['note']}", ""]
    lines += ["| step | status | seconds | limit s | key numbers |", "| --- | --- | ---: | ---: | --- |"]
    for s in rep["steps"]:
        info = _key_numbers(s) or s.get("reason", "")
        if s.get("reason") and s["status"] != "pass" and info != s["reason"]:
            info = f"{s['reason']}; {info}" if info else s["reason"]
        lines.append(
            f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | {_fmt(s.get('timeout_s'))} | "
            f"{info.replace('|', '/').replace(chr(10), ' ')} |"
        )
    lines += ["", "Commands:", ""]
    lines += [
        f"- `{s['name']}`: {s.get('what', '')} — `{s.get('command', '')}`" for s in rep["steps"] if s.get("command")
    ]
    lines += ["", "Raw output of every step: `logs/<step>.out` and `.err`; every number: `report.json`.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for report.json, report.md and logs/")
    ap.add_argument(
        "--preflight",
        action="store_true",
        help="run nothing: say whether every step could run here (imports, tools, GPUs)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"wall-clock budget of the whole run (default {DEFAULT_BUDGET_S:.0f})",
    )
    ap.add_argument("--only", "--steps", default=None, help="comma list of steps to run (default: all)")
    ap.add_argument(
        "--run",
        choices=sorted(RUNS),
        default=None,
        help=f"issue 51's measurement command 1 ({RUNS['1']}) or 2 ({RUNS['2']}), "
        f"within {RUN_BUDGET_S:.0f} s each (sets --steps and --budget-s)",
    )
    a = ap.parse_args(argv)
    if a.run:
        if a.only:
            ap.error("--run sets the steps itself; give --run or --steps, not both")
        a.only, a.budget_s = RUNS[a.run], min(a.budget_s, RUN_BUDGET_S)
    if a.preflight:
        code, text = preflight(a.out)
        print(text)
        return code
    if a.out is None:
        ap.error("--out is required (or --preflight)")
    only = None
    if a.only:
        only = {s.strip() for s in a.only.split(",") if s.strip()}
        names = [s.name for s in default_steps(2, Path(a.out))]
        if only - set(names):
            ap.error(f"unknown step(s) {sorted(only - set(names))}; steps: {', '.join(names)}")
    rep = run_report(a.out, a.budget_s, only=only)
    print(markdown(rep))
    return 1 if any(s["status"] in ("fail", "timeout") for s in rep["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
