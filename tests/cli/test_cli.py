"""The console script: help for every command, clean errors for bad flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TREEATTN = str(Path(sys.executable).with_name("treeattn"))


def run(*args, timeout=120):
    return subprocess.run([TREEATTN, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", [[], ["generate"], ["topo"], ["bench"]])
def test_help(cmd):
    r = run(*cmd, "--help")
    assert r.returncode == 0, r.stderr
    assert "Usage" in r.stdout


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("treeattn ")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["frobnicate"], "No such command 'frobnicate'. (see 'treeattn --help')"),
        (["generate", "--frobnicate"], "No such option: --frobnicate"),
        (["generate", "--nproc", "many"], "Invalid value for '--nproc'"),
    ],
)
def test_unknown_command_is_one_line_usage_error(args, needle):
    """Click's own usage errors (unknown command or flag, a value of the wrong type) read like
    every other bad input: one line, ``treeattn: error: ...``, exit 2, nothing on stdout."""
    r = run(*args)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    assert len(lines) == 1 and lines[0].startswith("treeattn: error: ") and needle in lines[0], r.stderr


def test_kernel_bench_runs_on_cpu():
    """The GPU kernel-timing script stays runnable (tiny CPU shapes; numbers are meaningless here)."""
    from treeattn_cli.bench.kernel import kernel_bench

    recs = kernel_bench([64, 300], heads=4, kv_heads=2, head_dim=64, dtype="float32", iters=2, warmup=1, copy_bw=1e10)
    assert [(r["seq_len"], r["method"]) for r in recs] == [
        (64, "treeattn"),
        (64, "sdpa"),
        (300, "treeattn"),
        (300, "sdpa"),
    ]
    assert all(r["kv_bytes"] == 2 * 2 * r["seq_len"] * 64 * 4 and r["gbps"] > 0 for r in recs)


def test_kernel_bench_times_an_fp8_cache_beside():
    """``--kv-dtype fp8``: the same kernel over the engine's fp8 cache of the same keys, its
    bytes the fp8 rows plus their bf16 scales (one per 32 channels)."""
    from treeattn_cli.bench.kernel import kernel_bench

    recs = kernel_bench(
        [100],
        heads=4,
        kv_heads=2,
        head_dim=64,
        dtype="float32",
        iters=1,
        warmup=0,
        copy_bw=1e10,
        baselines=(),
        kv_dtype="fp8",
    )
    assert [r["method"] for r in recs] == ["treeattn", "treeattn-fp8"]
    assert recs[1]["kv_bytes"] == 2 * 2 * 100 * (64 + 2 * 2) and recs[1]["kv_dtype"] == "fp8"


def test_the_prefill_bar_rate_is_measured_from_its_first_event():
    """The first event already counts a segment done before the bar existed: no rate until there
    is time to measure, then tokens since the first event over the time since it (issue 39)."""
    from treeattn_cli.report import prefill_rate

    assert prefill_rate(4096, 2.6e-5) == ""  # 155,349,838 tok/s, as the first update showed
    assert prefill_rate(0, 1.0) == ""
    assert prefill_rate(8192, 2.0) == "4,096 tok/s"
