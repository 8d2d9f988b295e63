"""Compile every Triton kernel of treeattn for a GPU target, without a GPU, and report resources.

Triton's interpreter (the CPU tests) accepts code no GPU compiler does, so device code is not
done until it compiles for real targets. Here a stand-in driver names the target
(``targets.compile_only``) and every configuration the runtime can pick is *launched through
the runtime's own code* on ``meta`` tensors (shapes and strides, no memory), which compiles it
with the wheel's own backends (ptxas for CUDA, LLVM's AMDGPU backend for ROCm) instead of
running it. The configurations: head dim 64/128/256, GQA group 1-8, fp32/bf16/fp16, decode
(Q = 1, a static cache with ragged lengths; sliding window, soft-capping and sinks on and off) and
prefill slices (causal, windowed, pass-Q), KV lengths from 1 to 1M (every split count the
launch code chooses), and the fused merge kernels. Runtime integers are not specialised, so
the configurations share a few dozen compiled kernels; each is checked once.

Per compiled kernel: registers, spill bytes, shared memory (LDS) against the target's limit.
``resources`` is also what ``python -m treeattn_cli.bench.kernel --tune`` reports on a real GPU.

    python -m treeattn_kernels.offline_compile --target sm_90 [--json]

One target per process (Triton keeps compiled kernels per device index; the stand-in is 0).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

from .targets import TARGETS, Target, compile_only

HEAD_DIMS = (64, 128, 256)
GROUPS = tuple(range(1, 9))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_LENS = (1, 63, 64, 65, 1000, 4096, 32768, 131072, 1 << 20)  # every split count from 1 to the cap
SPILL_BOUND = 0  # bytes of spilled registers (local memory / scratch) a kernel may use
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _meta(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _cache_kv(B, H_kv, N, d, dtype):
    """K or V as the static cache holds them: ``[B, H_kv, capacity + 1, d]`` viewed to N."""
    return _meta(B, H_kv, N + 1, d, dtype=dtype)[:, :, :N]


def decode_calls():
    """Every decode launch: ``(label, kwargs of partial_attention_triton)``."""
    for d, G, dt, N in itertools.product(HEAD_DIMS, GROUPS, DTYPES, KV_LENS):
        for window, softcap in ((None, None), (1024, None), (None, 30.0), (4096, 50.0)):
            B, H_kv = 1, 8 // G if G <= 8 else 1
            q = _meta(B, H_kv * G, 1, d, dtype=dt)
            k, v = _cache_kv(B, H_kv, N, d, dt), _cache_kv(B, H_kv, N, d, dt)
            kw = dict(kv_len=_meta(B, dtype=torch.int64), window=window, softcap=softcap)
            if window is not None:
                kw.update(q_pos=_meta(B, 1, dtype=torch.int64), k_pos=_meta(B, N + 1, dtype=torch.int64)[:, :N])
            yield (f"decode d={d} G={G} {NAMES[dt]} N={N} window={window} softcap={softcap}",
                   dict(q=q, k=k, v=v, **kw))
    for d, dt in itertools.product(HEAD_DIMS, DTYPES):  # learned attention sinks (gpt-oss): the reduce folds them
        q = _meta(1, 8, 1, d, dtype=dt)
        k, v = _cache_kv(1, 2, 4096, d, dt), _cache_kv(1, 2, 4096, d, dt)
        yield (f"decode d={d} G=4 {NAMES[dt]} N=4096 sink",
               dict(q=q, k=k, v=v, kv_len=_meta(1, dtype=torch.int64), sink=_meta(8, dtype=torch.float32)))


def prefill_calls():
    """Long query blocks the Triton path runs in slices (fp32 on CUDA, windows, soft-capping;
    ATen's flash kernel takes the rest): the diagonal block, earlier blocks, pass-Q."""
    for d, G, dt in itertools.product(HEAD_DIMS, GROUPS, DTYPES):
        H_kv, Q = max(1, 8 // G), 301  # 301: full slices and a ragged tail slice
        q = _meta(1, H_kv * G, Q, d, dtype=dt)
        for N, kind in ((Q, "causal"), (4096, "past"), (8192, "pass-q")):
            k, v = _meta(1, H_kv, N, d, dtype=dt), _meta(1, H_kv, N, d, dtype=dt)
            pos = dict(q_pos=_meta(Q, dtype=torch.int64), k_pos=_meta(N, dtype=torch.int64))
            for window, softcap in ((None, None), (512, 30.0)):
                kw = dict(window=window, softcap=softcap)
                if kind == "causal" or window is not None:
                    kw.update(pos)
                if kind == "pass-q":
                    kw["kv_len"] = _meta(1, dtype=torch.int64)
                yield (f"prefill-{kind} d={d} G={G} {NAMES[dt]} window={window} softcap={softcap}",
                       dict(q=q, k=k, v=v, **kw))


def merge_calls():
    """The fused pack/finish of the allreduce merge, per head dim and output dtype."""
    for d, dt in itertools.product(HEAD_DIMS, DTYPES):
        yield f"merge d={d} {NAMES[dt]}", d, dt


def resources(ck, target: Target) -> dict:
    """Registers, spill bytes and shared memory of a compiled kernel, from its binary (CUDA:
    the cubin through the wheel's ``cuobjdump``; ROCm: the AMDGPU assembly's metadata)."""
    meta = ck.metadata
    shared = int(getattr(meta, "shared", 0) or 0)
    out = {"num_warps": meta.num_warps, "num_stages": getattr(meta, "num_stages", None)}
    if target.backend == "cuda":
        from triton import knobs

        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            text = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                                  capture_output=True, text=True, timeout=60, check=True).stdout
        use = dict((k, int(v)) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
        out.update(regs=use.get("REG"), spill_bytes=use.get("STACK", 0) + use.get("LOCAL", 0),
                   shared_bytes=shared + use.get("SHARED", 0))
    else:
        asm = ck.asm["amdgcn"]

        def field(name):
            m = re.search(rf"\.{name}:\s+(\d+)", asm)
            return int(m.group(1)) if m else 0

        # VGPR spills go to scratch memory (the private segment); SGPR spills go to VGPR lanes,
        # which costs no memory traffic and is reported apart
        out.update(regs=field("vgpr_count"), sgpr_spills=field("sgpr_spill_count"),
                   spill_bytes=max(4 * field("vgpr_spill_count"), field("private_segment_fixed_size")),
                   shared_bytes=max(shared, field("group_segment_fixed_size")))
    out["max_shared"] = target.max_shared
    out["ok"] = out["spill_bytes"] <= SPILL_BOUND and out["shared_bytes"] <= target.max_shared
    return out


def narrow_base_offsets(ck) -> list[str]:
    """Pointer arguments that a kernel offsets by a 32-bit scalar (``tt.addptr %K, %x : ...,
    i32`` in its Triton IR): a batch or head offset computed in i32 wraps past 2^31 elements."""
    ttir = ck.asm.get("ttir", "")
    head = next((line for line in ttir.splitlines() if "tt.func public" in line), "")
    args = set(re.findall(r"%(\w+): !tt\.ptr<", head))  # the kernel's pointer arguments
    found = re.findall(r"tt\.addptr %(\w+), %[\w.#]+ : !tt\.ptr<\w+>, i32", ttir)
    return sorted(set(found) & args)


def decode_growth(target: Target, tokens: int = 8192, d: int = 128, dtype=torch.bfloat16) -> int:
    """Distinct kernels eager decode compiles while a shard grows from 1 to ``tokens`` keys
    (Llama-3.1-8B's shape on one rank): the split count and the length change every step."""
    from .partial_triton import partial_attention_triton

    with compile_only(target) as compiled:
        q = _meta(1, 32, 1, d, dtype=dtype)
        for n in range(1, tokens + 1):
            kv = _meta(1, 8, tokens, d, dtype=dtype)[:, :, :n]
            partial_attention_triton(q, kv, kv, kv_len=_meta(1, dtype=torch.int64))
        return len({id(ck) for _, ck, _ in compiled})


def compile_all(target: Target, calls=None) -> dict:
    """Compile every configuration for ``target``; returns ``{"kernels": [...], "errors": [...],
    "configs": n, "seconds": s}``. Each kernel record carries its resources and the first
    configuration that needed it."""
    from .merge_triton import unweigh_fused, weigh_fused
    from .partial_triton import partial_attention_triton

    t0 = time.perf_counter()
    kernels, errors, seen, n = [], [], {}, 0
    with compile_only(target) as compiled:
        def record(label, fn):
            nonlocal n
            n += 1
            before = len(compiled)
            try:
                fn()
            except Exception as e:  # a compile error is a result: name the configuration
                errors.append({"config": label, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
                return
            for name, ck, grid in compiled[before:]:
                if id(ck) in seen:
                    continue
                seen[id(ck)] = ck
                rec = {"kernel": name, "target": target.name, "first_config": label, "grid": list(grid),
                       "constexprs": _constexprs(ck)}
                rec.update(resources(ck, target))
                rec["narrow_base_offsets"] = narrow_base_offsets(ck)
                kernels.append(rec)

        for label, kw in itertools.chain(calls or (), decode_calls() if calls is None else (),
                                         prefill_calls() if calls is None else ()):
            record(label, lambda kw=kw: partial_attention_triton(**kw))
        if calls is None:
            for label, d, dt in merge_calls():
                def merge(d=d, dt=dt):
                    o, lse = _meta(1, 32, 1, d, dtype=torch.float32), _meta(1, 32, 1, dtype=torch.float32)
                    packed = weigh_fused(o, lse, lse)
                    unweigh_fused(packed, lse, out=_meta(1, 1, 32, d, dtype=dt).transpose(1, 2), dtype=dt)
                record(label, merge)
    growth = decode_growth(target) if calls is None else None
    return {"target": target.name, "configs": n, "kernels": kernels, "errors": errors,
            "decode_growth_kernels": growth, "seconds": round(time.perf_counter() - t0, 1)}


def _constexprs(ck) -> dict:
    """The compile-time parameters of a compiled kernel, by name (tile sizes, flags)."""
    src = getattr(ck, "src", None)
    names = getattr(getattr(src, "fn", None), "arg_names", [])
    out = {}
    for k, v in (getattr(src, "constants", None) or {}).items():
        i = k[0] if isinstance(k, tuple) and len(k) == 1 else k
        if isinstance(i, int) and i < len(names) and names[i].isupper() and isinstance(v, (int, bool)):
            out[names[i]] = v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Compile treeattn's Triton kernels for a GPU target "
                                             "without a GPU; report registers, spills, shared memory.")
    ap.add_argument("--target", required=True, choices=sorted(TARGETS))
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("offline_compile: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    res = compile_all(TARGETS[a.target])
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{res['target']}: {res['configs']} configurations, {len(res['kernels'])} kernels, "
              f"{len(res['errors'])} errors, {res['seconds']} s; eager decode from 1 to 8192 keys "
              f"compiles {res['decode_growth_kernels']} kernel(s)")
        for k in res["kernels"]:
            print(f"  {'ok ' if k['ok'] else 'BAD'} {k['kernel']:<16} regs={k['regs']} spill={k['spill_bytes']} "
                  f"shared={k['shared_bytes']}/{k['max_shared']} warps={k['num_warps']} "
                  f"stages={k['num_stages']}  {k['first_config']}")
        for e in res["errors"]:
            print(f"  ERROR {e['config']}: {e['error']}")
    return 0 if not res["errors"] and all(k["ok"] for k in res["kernels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
