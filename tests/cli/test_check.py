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
    assert {
        "partial/cpu",
        "merge/allreduce",
        "merge/allgather",
        "merge/tree",
        "merge/hierarchical",
        "ring-decode",
        "generate/eager",
        "generate/fp8",
        "batch/eager",
    } <= paths
    assert all(x["verdict"] in ("pass", "skipped") for x in recs)
    assert {x["path"] for x in recs if x["verdict"] == "skipped"} == {
        "merge/fused",
        "layer/fused",
        "compile/<gpu>",
        "generate/cuda-graph",
        "batch/cuda-graph",
    }
    graph = next(x for x in recs if x["path"] == "generate/cuda-graph")
    assert "no GPU" in graph["note"]  # a GPU row is listed with why it did not run (issue 39 item 7)
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

    from treeattn_cli.model.load import load_tokenizer

    d = tiny_models.make_model("llama", tmp_path / "m")
    prompt = "the quick brown fox jumps over the lazy dog, twice: the quick brown fox"
    want = tiny_models.hf_greedy(d, load_tokenizer(d)(prompt)["input_ids"], 8)
    p = subprocess.run(
        [
            TREEATTN,
            "generate",
            "--model",
            str(d),
            "--prompt",
            prompt,
            "--no-chat",
            "--nproc",
            "2",
            "--max-new-tokens",
            "8",
            "--dtype",
            "float32",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
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


# What the self-check runs is what the runtime launches (issue 34): the GPU's kernel on the
# interpreter, for the launches the check did not cover before.
LAUNCHES = ("decode-fp8-window-sorted", "verify-fp8", "cascade-window")


def test_the_check_covers_every_launch_the_runtime_makes():
    from treeattn_cli.verify.kernels import _kernel_cases

    cases = list(_kernel_cases(full=False))
    kinds = {c[0] for c in cases}
    assert {
        "decode-fp8",
        "decode-window-sorted",
        "verify",
        "verify-causal",
        "cascade",
        "cascade-window",
        "verify-fp8",
        "cascade-fp8",
        "decode-fp8-window-sorted",
    } <= kinds
    fp8 = {(c[2], c[6]) for c in cases if c[0] == "decode-fp8"}
    assert fp8 == {(G, d) for G in (1, 4, 8) for d in (64, 96, 128)}  # head dims x GQA groups
    assert all(c[8].get("ragged") for c in cases if c[0] == "decode-fp8")
    assert {c[4] for c in cases if c[0].startswith("verify")} >= {5, 17}  # verify blocks of K = 4 and 16


def test_triton_launches_pass_and_a_wrong_one_is_caught(monkeypatch):
    """Through the interpreter: the sorted-position window search, fp8 verify rows, the cascade's
    padded rows pass against the reference; an fp8 kernel that reads V's scales as K's fails
    exactly those fp8 cases, and the verdict names the path."""
    import treeattn_kernels.partial_triton as pt

    from treeattn_cli.verify.kernels import kernel_checks, verdict_of

    monkeypatch.setenv("TREEATTN_KERNEL", "triton")
    recs = kernel_checks(torch.device("cpu"), full=False, kinds=LAUNCHES)
    assert {(r["path"], r["case"].split()[0]) for r in recs} == {
        (p, k) for p in ("partial/cpu", "partial/triton") for k in LAUNCHES
    }
    assert all(r["verdict"] == "pass" for r in recs), [r for r in recs if r["verdict"] != "pass"]

    real = pt.partial_attention_triton

    def swapped_scales(q, k, v, *a, k_scale=None, v_scale=None, **kw):
        return real(q, k, v, *a, k_scale=v_scale, v_scale=v_scale, **kw)

    monkeypatch.setattr(pt, "partial_attention_triton", swapped_scales)
    recs = kernel_checks(torch.device("cpu"), full=False, kinds=("verify-fp8",))
    assert [(r["path"], r["verdict"]) for r in recs] == [("partial/cpu", "pass"), ("partial/triton", "FAIL")]
    assert verdict_of(torch.device("cpu"), recs)["failed"] == ["partial/triton"]


def test_the_gpus_write_and_pair_merge_checks_pass_and_a_wrong_write_is_caught(monkeypatch):
    """The GPU's self-checks of the pool's one-launch write (bf16, fp8), of the merge of a step's
    two partials (and of its two calls' splits in one launch) and of the layer's small kernels,
    run here through the interpreter: they pass; a merge that drops the tail's splits fails, and
    a write that stores the keys 10 % off fails its cases (fp8: codes more than one step off).
    The verdict's key names the kernels' sources."""
    import treeattn_kernels.write_triton as wt

    from treeattn_cli.verify import kernels as K

    gen = torch.Generator().manual_seed(5)
    recs = K._fused_merge_checks(torch.device("cpu"), gen) + K._write_checks(torch.device("cpu"), gen)
    cases = {r["case"] for r in recs}
    assert {"pair d=64 fp32", "pair d=128 bf16", "write_kv d=128 bf16", "write_kv d=128 fp8_e4m3fn"} <= cases
    assert {"two calls d=64 fp32", "two calls d=128 bf16"} <= cases  # (a step's splits reduced in one launch)
    assert all(r["verdict"] == "pass" for r in recs), [r for r in recs if r["verdict"] != "pass"]
    import treeattn_kernels.merge_triton as mt

    real_pair = mt.reduce_pair

    def one_call(a, b, *, out=None):  # the tail's splits dropped: wrong
        return real_pair(a, None, out=out)

    monkeypatch.setattr(mt, "reduce_pair", one_call)
    bad = [r for r in K._fused_merge_checks(torch.device("cpu"), gen) if r["case"].startswith("two calls")]
    assert [r["verdict"] for r in bad] == ["FAIL", "FAIL"], bad
    monkeypatch.setattr(mt, "reduce_pair", real_pair)
    layer = K._fused_layer_checks(torch.device("cpu"), gen)  # the norms (with a residual add), silu, rope
    assert {"add_rms_norm n=4096 bf16", "rms_norm n=896 fp16"} <= {r["case"] for r in layer}
    assert all(r["verdict"] == "pass" for r in layer), [r for r in layer if r["verdict"] != "pass"]
    real = wt.write_kv_triton

    def one_off(k_store, v_store, slots, k, v, *rest):  # the keys 10 % off: a write that is wrong
        return real(k_store, v_store, slots, k * 1.1, v, *rest)

    monkeypatch.setattr(wt, "write_kv_triton", one_off)
    recs = K._write_checks(torch.device("cpu"), gen)
    assert [r["verdict"] for r in recs] == ["FAIL", "FAIL"], recs
    assert len(K.machine_key(torch.device("cpu"))["kernels"]) == 16


def test_the_verdict_survives_stray_lines_on_stdout(monkeypatch):
    """The GPU verdict comes from a child's stdout: a library's line before or after the records
    neither fails a passed check nor hides a failed one."""
    from types import SimpleNamespace

    from treeattn_cli.verify import kernels as K

    recs = [
        {"path": "partial/triton", "case": "decode", "verdict": "pass"},
        {"path": "partial/aten", "case": "prefill [x]", "verdict": "FAIL"},
    ]
    text = "[W] a warning\n[1, 2]\n" + json.dumps(recs, indent=1) + "\nbye [done]\n"
    assert K.records_in(text) == recs
    assert K.records_in("no records [at all]\n") is None
    monkeypatch.setattr(K, "load_verdict", lambda d: None)
    monkeypatch.setattr(K, "machine_key", lambda d: {"device": "cuda"})
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=text, stderr="", returncode=1))
    v = K.kernel_verdict(torch.device("cuda", 0))
    assert v["ok"] is False and v["failed"] == ["partial/aten"]


def test_fp8_generate_agrees_with_the_reference_or_names_a_near_tie():
    """The bf16 + fp8 generate check: equal answers pass; answers that part where the reference saw
    a near tie pass with a note; a real divergence, or a run that did not store fp8, fails."""
    from treeattn_cli.verify.ranks import NEAR_TIE, _fp8_agreement

    def run(ids, top=None, kv="fp8_e4m3fn"):
        return {
            "kv_dtype": kv,
            "logprobs": [{"id": t, "top": (top or {}).get(i, [[t, -0.1]])} for i, t in enumerate(ids)],
        }

    assert _fp8_agreement(run([5, 6, 7]), run([5, 6, 7])) == ("", True)
    tie = {1: [[9, -0.70], [6, -0.70 - NEAR_TIE / 2]]}
    note, ok = _fp8_agreement(run([5, 6, 1]), run([5, 9, 2], tie))
    assert ok and "near tie" in note and "token 1" in note
    far = {1: [[9, -0.2], [6, -2.0]]}
    assert _fp8_agreement(run([5, 6, 1]), run([5, 9, 2], far))[1] is False
    assert _fp8_agreement(run([5, 6, 1]), run([5, 9, 2]))[1] is False  # the fast choice not even in its top 2
    assert _fp8_agreement(run([5, 6]), run([5, 6], kv="bfloat16"))[1] is False


def test_the_compile_row_fails_on_what_cannot_launch_and_notes_a_spill(monkeypatch):
    """A GPU's compile/<target> row: a compile error or shared memory over the limit fails it (the
    kernel verdict then sends generate to the reference path); a spill only costs speed, so it is
    named in the note and the row passes (Triton 3.6 spills 8 bytes where CI's Triton spills none)."""
    import treeattn_kernels.offline_compile as oc
    import treeattn_kernels.targets as tg
    from treeattn_cli.verify import kernels as vk

    def kernel(spill=0, shared=1000):
        return {
            "kernel": "_split_kernel",
            "first_config": "decode x",
            "spill_bytes": spill,
            "shared_bytes": shared,
            "max_shared": 2000,
            "ok": spill == 0 and shared <= 2000,
        }

    monkeypatch.setattr(tg, "target_of", lambda device: tg.TARGETS["sm_90"])
    for kernels, errors, verdict, note in (
        ([kernel(), kernel(spill=8)], [], "pass", "spill 8 B"),
        ([kernel(shared=4000)], [], "FAIL", "shared 4000 B of 2000"),
        ([kernel()], [{"config": "prefill y", "error": "RuntimeError: x"}], "FAIL", "prefill y"),
    ):
        monkeypatch.setattr(
            oc, "compile_all", lambda target, k=kernels, e=errors: {"configs": 3, "kernels": k, "errors": e}
        )
        rec = vk._compile_check(torch.device("cpu"))
        assert rec["verdict"] == verdict and note in rec["note"], rec
