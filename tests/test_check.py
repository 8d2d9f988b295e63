"""`treeattn check`: every path this machine takes against its reference; the cached kernel
verdict that `generate` consults, and its fallback to the reference path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from treeattn_cli.verify import tiny as tiny_models
from treeattn_cli.main import app

TREEATTN = str(Path(sys.executable).with_name("treeattn"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("TREEATTN_CACHE", str(d))
    return d


def test_check_on_cpu_ranks_passes(cache):
    r = CliRunner().invoke(app, ["check", "--nproc", "2", "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout)
    paths = {x["path"] for x in recs}
    assert {"partial/cpu", "merge/allreduce", "merge/allgather", "merge/tree", "merge/hierarchical",
            "ring-decode", "generate/eager"} <= paths
    assert all(x["verdict"] in ("pass", "skipped") for x in recs)
    assert {x["path"] for x in recs if x["verdict"] == "skipped"} == {"merge/fused", "compile/<gpu>"}
    assert max(x["case"].count("N=65543") for x in recs)  # long shards are checked too
    (v,) = [json.loads(p.read_text()) for p in (cache / "check").glob("*.json")]
    assert v["ok"] and v["key"]["device"] == "cpu"


def test_broken_kernel_fails_check_and_generate_falls_back(cache, tmp_path, monkeypatch):
    """A kernel that is subtly wrong on this machine (1 % off) is named by `check` (exit 1),
    its verdict is cached, and `generate` then takes the reference path with a one-line
    warning, still giving transformers' tokens."""
    import treeattn_kernels.partial_aten as pa

    real = pa._OP_CPU

    def broken(q, k, v, *a, **kw):
        o, lse, *rest = real(q, k, v, *a, **kw)
        return (o * 1.01, lse, *rest)

    monkeypatch.setattr(pa, "_OP_CPU", broken)
    r = CliRunner().invoke(app, ["check", "--kernels-only"])
    assert r.exit_code == 1, r.output
    assert "FAILED: partial/cpu" in r.stdout.replace("\n", " ")
    monkeypatch.setattr(pa, "_OP_CPU", real)

    from treeattn_cli.engine.model import load_tokenizer

    d = tiny_models.make_model("llama", tmp_path / "m")
    prompt = "the quick brown fox jumps over the lazy dog, twice: the quick brown fox"
    want = tiny_models.hf_greedy(d, load_tokenizer(d)(prompt)["input_ids"], 8)
    p = subprocess.run([TREEATTN, "generate", "--model", str(d), "--prompt", prompt, "--no-chat",
                        "--nproc", "2", "--max-new-tokens", "8", "--dtype", "float32", "--json"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    warn = [ln for ln in p.stderr.splitlines() if "warning" in ln]
    assert len(warn) == 1 and "partial/cpu" in warn[0] and "reference path" in warn[0], p.stderr
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert rec["kernels"].startswith("reference") and rec["token_ids"] == want


def test_generate_checks_the_kernels_once_per_machine(cache, tmp_path):
    """The first generate on a machine (these versions) runs the quick kernel checks and caches
    the verdict; later runs read it."""
    from treeattn_cli.verify.kernels import kernel_verdict, load_verdict

    dev = torch.device("cpu")
    assert load_verdict(dev) is None
    v = kernel_verdict(dev)
    assert v["ok"] and load_verdict(dev) == v


def test_under_torchrun_only_local_rank_0_checks(cache, monkeypatch):
    """Under torchrun, local rank 0 of a node runs the kernel self-check on its own device; the
    node's other processes wait for its cached verdict instead of checking GPU 0 all at once."""
    import threading

    from treeattn_cli.cli import prepare
    from treeattn_cli.verify import kernels as check

    ran = []
    real = check.kernel_checks
    monkeypatch.setattr(check, "kernel_checks", lambda *a, **k: ran.append(1) or real(*a, **k))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    verdict = real(torch.device("cpu"), full=False)
    saving = threading.Event()

    def rank0_saves():
        saving.set()  # set before the file exists: a waiter that returned must see it
        check.save_verdict(torch.device("cpu"), verdict)

    later = threading.Timer(0.5, rank0_saves)
    later.start()  # "local rank 0" finishes its check later
    assert prepare._kernels_failed("cpu") is False
    assert saving.is_set() and not ran  # waited for the verdict, ran nothing itself
    later.join()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TREEATTN_CACHE", str(cache.parent / "other"))
    assert prepare._kernels_failed("cpu") is False and ran  # local rank 0 checks
