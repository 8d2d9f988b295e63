"""The kernel self-checks of ``treeattn check`` and their verdict, cached per machine.

The device paths (the Triton split-KV kernel, ATen's flash kernel as a partial attention, the
fused merge kernels) are tested in CI on CPU only, the kernels under Triton's interpreter. Here
each runs where the user will run it, against its reference:

* ``partial/<impl>``: the partial attention of each implementation this device uses vs the
  pure-torch reference, decode and prefill shapes (GQA group 1/4/8, head dim 64/128, fp32 and
  bf16, N from 1 to 64K+, ragged lengths, sliding window and soft-capping);
* ``merge/fused`` (CUDA): the fused pack/finish of the allreduce merge vs the torch merge;
* ``compile/<target>`` (GPU): every Triton kernel configuration compiled for the local target,
  no spills, shared memory within the limit (``treeattn_kernels.offline_compile``).

Records, one per (path, case): ``path, case, max_err, tol, seconds, verdict`` (``pass``, ``FAIL``,
``skipped``) and ``note``. The verdict of these paths is cached per machine and software versions
(:func:`kernel_verdict`); ``generate`` consults it and falls back to the reference path when it
failed. The checks across ranks and end to end are in ``ranks.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from .. import __version__

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
KERNEL_PATHS = ("partial/", "merge/fused", "compile/")  # what the cached verdict covers


def rel_err(actual, expected) -> float:
    """max |a - e| / max(1, max |e|) over finite entries; inf if NaN appears or the -inf
    pattern (rows without keys) differs."""
    a, e = actual.double().cpu(), expected.double().cpu()
    if torch.isnan(a).any() or not torch.equal(torch.isinf(a), torch.isinf(e)):
        return math.inf
    fin = torch.isfinite(e)
    if not fin.any():
        return 0.0
    return ((a - e).abs()[fin].max() / max(1.0, e.abs()[fin].max().item())).item()


def _record(path, case, err, tol, seconds, note=""):
    return {"path": path, "case": case, "max_err": err, "tol": tol, "seconds": round(seconds, 4),
            "verdict": "pass" if err <= tol else "FAIL", "note": note}


def skipped(path, why):
    return {"path": path, "case": "-", "max_err": None, "tol": None, "seconds": 0.0,
            "verdict": "skipped", "note": why}


# ---------------------------------------------------------------- kernels (this process)

def _kernel_cases(full: bool):
    """(kind, B, G, H_kv, Q, N, d, dtype, extra) of the partial-attention checks."""
    lengths = (1, 1000, 65536 + 7) if full else (1, 1000)
    for G in (1, 4, 8):
        for d in (64, 128):
            for dt in (torch.float32, torch.bfloat16):
                for N in lengths:
                    yield ("decode", 1, G, 8 // G if G < 8 else 1, 1, N, d, dt, {})
    for dt in (torch.float32, torch.bfloat16):
        yield ("decode-ragged", 3, 4, 2, 1, 777, 128, dt, {"ragged": True})
        yield ("decode-window", 1, 4, 2, 1, 3000, 128, dt, {"window": 1024, "softcap": 50.0})
        yield ("prefill-causal", 1, 4, 2, 300, 300, 128, dt, {"causal": True})
        yield ("prefill-past", 1, 4, 2, 129, 2048, 64, dt, {})
        yield ("prefill-window", 1, 2, 2, 200, 200, 64, dt, {"causal": True, "window": 64, "softcap": 30.0})


def _impls(device) -> list[str]:
    """The partial-attention implementations this device runs (explicitly, not via "auto")."""
    if device.type == "cuda":
        from treeattn_kernels import triton_available

        return (["triton"] if triton_available() else []) + ["aten"]
    return ["cpu"]


def kernel_checks(device, full: bool = True) -> list[dict]:
    """The partial attention of every implementation on ``device`` vs the reference, and on
    CUDA the fused merge kernels and the offline compile for the local target."""
    from treeattn_kernels import partial_attention, partial_attention_ref

    device = torch.device(device)
    gen = torch.Generator().manual_seed(1234)
    out = []
    for kind, B, G, H_kv, Q, N, d, dt, extra in _kernel_cases(full):
        H = G * H_kv
        q, k, v = (torch.randn(*s, generator=gen).to(device, dt) for s in
                   ((B, H, Q, d), (B, H_kv, N, d), (B, H_kv, N, d)))
        kw = {}
        if extra.get("ragged"):
            kw["kv_len"] = torch.tensor([N, N // 3, 0][:B], device=device)
        if extra.get("causal") or extra.get("window"):
            kw.update(q_pos=torch.arange(N - Q, N, device=device), k_pos=torch.arange(N, device=device))
        for key in ("window", "softcap"):
            if key in extra:
                kw[key] = extra[key]
        ref_o, ref_l = partial_attention_ref(q.float(), k.float(), v.float(), **kw)
        case = f"{kind} G={G} d={d} Q={Q} N={N} {_NAMES[dt]}" + (f" B={B}" if B > 1 else "")
        for impl in _impls(device):
            if impl == "aten" and (dt == torch.float32 or kind.startswith("decode")):
                continue  # CUDA's flash kernel serves 16-bit prefill blocks only
            t0 = time.perf_counter()
            try:
                o, lse = partial_attention(q, k, v, impl=impl, **kw)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                err = max(rel_err(o, ref_o), rel_err(lse, ref_l))
                note = ""
            except Exception as e:  # a crash is a failed check, named
                err, note = math.inf, f"{type(e).__name__}: {e}".splitlines()[0][:120]
            out.append(_record(f"partial/{impl}", case, err, TOL[dt], time.perf_counter() - t0, note))
    if device.type == "cuda":
        out += _fused_merge_checks(device, gen)
        if full:
            out.append(_compile_check(device))
    else:
        out.append(skipped("merge/fused", "CPU: the merge is the torch code itself"))
        if full:
            out.append(skipped("compile/<gpu>", "no GPU here (CI compiles for sm_80, sm_90, gfx942)"))
    return out


def _fused_merge_checks(device, gen) -> list[dict]:
    from treeattn_kernels.merge_triton import unweigh_fused, weigh_fused

    from ..parallel.merge import unweigh, weigh

    out = []
    for d, dt in ((64, torch.float32), (128, torch.bfloat16)):
        o = torch.randn(2, 8, 1, d, generator=gen).to(device)
        lse = torch.randn(2, 8, 1, generator=gen).to(device)
        m = lse + torch.rand(2, 8, 1, generator=gen).to(device)
        t0 = time.perf_counter()
        try:
            po, pl = unweigh_fused(weigh_fused(o, lse, m), m, dtype=dt)
            ro, rl = unweigh(weigh(o, lse, m), m)
            err, note = max(rel_err(po, ro.to(dt)), rel_err(pl, rl)), ""
        except Exception as e:
            err, note = math.inf, f"{type(e).__name__}: {e}".splitlines()[0][:120]
        out.append(_record("merge/fused", f"d={d} {_NAMES[dt]}", err, TOL[dt], time.perf_counter() - t0, note))
    return out


def _compile_check(device) -> dict:
    from treeattn_kernels.offline_compile import compile_all
    from treeattn_kernels.targets import target_of

    target = target_of(device)
    t0 = time.perf_counter()
    res = compile_all(target)
    bad = [f"{k['kernel']} ({k['first_config']}): spill {k['spill_bytes']} B, shared {k['shared_bytes']} B"
           for k in res["kernels"] if not k["ok"]]
    bad += [f"{e['config']}: {e['error']}" for e in res["errors"]]
    rec = _record(f"compile/{target.name}", f"{res['configs']} configurations, {len(res['kernels'])} kernels",
                  1.0 if bad else 0.0, 0.0, time.perf_counter() - t0, "; ".join(bad)[:300])
    rec["max_err"] = None
    return rec


# ---------------------------------------------------------------- the verdict cache

def machine_key(device) -> dict:
    """What a kernel verdict depends on: the device, its driver, torch, triton, treeattn."""
    device = torch.device(device)
    key = {"device": device.type, "torch": torch.__version__, "treeattn": __version__}
    if device.type == "cuda":
        key["name"] = torch.cuda.get_device_name(device)
        key["runtime"] = torch.version.hip or torch.version.cuda
        try:
            key["driver"] = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        except OSError:
            key["driver"] = None
    else:
        key["name"] = platform.processor() or platform.machine()
    try:
        import triton

        key["triton"] = triton.__version__
    except Exception:
        key["triton"] = None
    return key


def _verdict_file(device) -> Path:
    from ..paths import cache_root

    digest = hashlib.sha1(json.dumps(machine_key(device), sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "check" / f"{digest}.json"


def verdict_of(device, records) -> dict:
    """The kernel part's outcome: ``{"key", "ok", "failed": [paths], "when"}``."""
    failed = sorted({r["path"] for r in records if r["path"].startswith(KERNEL_PATHS) and r["verdict"] == "FAIL"})
    return {"key": machine_key(device), "ok": not failed, "failed": failed,
            "when": time.strftime("%Y-%m-%dT%H:%M:%S")}


def save_verdict(device, records) -> dict:
    """Cache the kernel part's outcome (atomically; best effort: a read-only cache directory
    only means checking again next time)."""
    from ..paths import write_atomic

    v = verdict_of(device, records)
    path = _verdict_file(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(v))
    except OSError:
        pass
    return v


def load_verdict(device) -> dict | None:
    try:
        return json.loads(_verdict_file(device).read_text())
    except (OSError, ValueError):
        return None


def kernel_verdict(device) -> dict:
    """The cached kernel verdict for this machine, running the quick kernel checks first when
    there is none (in this process on CPU; on a GPU in a child process, so the launcher holds
    no CUDA context afterwards)."""
    device = torch.device(device)
    v = load_verdict(device)
    if v is not None:
        return v
    if device.type != "cuda":
        return save_verdict(device, kernel_checks(device, full=False))
    import subprocess
    import sys

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    idx = device.index or 0
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible.split(",")[idx] if visible else str(idx))
    p = subprocess.run([sys.executable, "-m", "treeattn_cli.main", "check", "--kernels-only", "--json",
                        "--quiet"], capture_output=True, text=True, timeout=900, env=env)
    try:
        return verdict_of(device, json.loads(p.stdout))
    except ValueError:
        why = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"ok": False, "failed": [f"the kernel self-check did not complete: {why}"]}


def wait_for_verdict(device, timeout_s: float = 1800.0, poll_s: float = 0.5) -> dict:
    """The kernel verdict another process (local rank 0 under torchrun) is producing for this
    machine: wait for it to be cached, as long as a full self-check may take."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = load_verdict(device)
        if v is not None:
            return v
        if time.monotonic() > deadline:
            return {"ok": False, "failed": [f"no kernel verdict from local rank 0 within {timeout_s:g} s"]}
        time.sleep(poll_s)
