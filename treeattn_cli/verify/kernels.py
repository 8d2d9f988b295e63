"""The kernel self-checks of ``treeattn check`` and their verdict, cached per machine.

The device paths (the Triton split-KV kernel, ATen's flash kernel as a partial attention, the
fused merge kernels) are tested in CI on CPU only, the kernels under Triton's interpreter. Here
each runs where the user will run it, against its reference:

* ``partial/<impl>``: the partial attention of each implementation this device uses vs the
  pure-torch reference, at every launch the runtime makes (:func:`_kernel_cases`): decode and
  prefill shapes (GQA group 1/4/8, head dim 64/128, fp32 and bf16, N from 1 to 64K+, ragged
  lengths, sliding window and soft-capping), the sorted-position window search, verify blocks
  of 5 and 17 rows, the cascade's document rows of a batch (a padded row among them), and an
  fp8 cache (head dims 64/96/128, groups 1/4/8, ragged; where the device stores fp8);
* ``merge/fused`` (CUDA): the fused pack/finish of the allreduce merge vs the torch merge;
* ``merge/fused`` also covers the one-launch merge of a step's two partials;
* ``layer/fused`` (CUDA): the layer's small kernels (the RMS norm, SiLU × up, the rotary
  embedding; ``model/fused.py``) vs their torch references, transformers' own operations, and the
  write of a step's keys and values into the pool (bf16; fp8 where the device stores it);
* ``compile/<target>`` (GPU): every Triton kernel configuration compiled for the local target,
  no spills, shared memory within the limit (``treeattn_kernels.offline_compile``).

Records, one per (path, case): ``path, case, max_err, tol, seconds, verdict`` (``pass``, ``FAIL``,
``skipped``) and ``note``. The verdict of these paths is cached per machine and software versions
(:func:`kernel_verdict`); ``generate`` consults it and falls back to the reference path when it
failed. The checks across ranks and end to end are in ``ranks.py``.
"""

from __future__ import annotations

import functools
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
KERNEL_PATHS = ("partial/", "merge/fused", "layer/fused", "compile/")  # what the cached verdict covers


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
    return {
        "path": path,
        "case": case,
        "max_err": err,
        "tol": tol,
        "seconds": round(seconds, 4),
        "verdict": "pass" if err <= tol else "FAIL",
        "note": note,
    }


def skipped(path, why):
    return {"path": path, "case": "-", "max_err": None, "tol": None, "seconds": 0.0, "verdict": "skipped", "note": why}


# ---------------------------------------------------------------- kernels (this process)


def _kernel_cases(full: bool):
    """(kind, B, G, H_kv, Q, N, d, dtype, extra) of the partial-attention checks: every launch
    the runtime makes (docs/architecture.md §11), at the shapes it makes them.

    ``extra``: ``ragged`` (B = 3 sequences of N, N/3 and 0 keys), ``causal`` (the last Q of N
    positions), ``window``/``softcap``, ``sorted`` (per-sequence ascending positions, a cache's,
    with stale entries past each length, and ``k_pos_sorted``: the kernel searches the window's
    first key), ``cascade`` (a batch's R = 3 sequences of T = 4 rows against one shared document,
    a padded row at position -1), ``fp8`` (e4m3 rows with bf16 scales, the queries in the
    cache's rotated basis)."""
    lengths = (1, 1000, 65536 + 7) if full else (1, 1000)
    for G in (1, 4, 8):
        for d in (64, 128):
            for dt in (torch.float32, torch.bfloat16):
                for N in lengths:
                    yield ("decode", 1, G, 8 // G if G < 8 else 1, 1, N, d, dt, {})
    for dt in (torch.float32, torch.bfloat16):
        yield ("decode-ragged", 3, 4, 2, 1, 777, 128, dt, {"ragged": True})
        yield ("decode-window", 1, 4, 2, 1, 3000, 128, dt, {"window": 1024, "softcap": 50.0})
        yield ("decode-window-sorted", 3, 4, 2, 1, 3000, 128, dt, {"window": 1024, "ragged": True, "sorted": True})
        yield ("verify", 1, 8, 1, 5, 2000, 128, dt, {})  # drafts against the document shard: no mask
        yield ("verify", 1, 4, 2, 17, 2000, 128, dt, {})
        yield ("verify-causal", 1, 4, 2, 17, 2000, 64, dt, {"causal": True})  # against their own extension
        yield ("cascade", 1, 4, 2, 12, 3000, 128, dt, {"cascade": True})
        yield ("cascade-window", 1, 4, 2, 12, 3000, 128, dt, {"cascade": True, "window": 1024, "sorted": True})
        yield ("prefill-causal", 1, 4, 2, 300, 300, 128, dt, {"causal": True})
        yield ("prefill-past", 1, 4, 2, 129, 2048, 64, dt, {})
        yield ("prefill-window", 1, 2, 2, 200, 200, 64, dt, {"causal": True, "window": 64, "softcap": 30.0})
    for d in (64, 96, 128):
        for G in (1, 4, 8):
            yield (
                "decode-fp8",
                3,
                G,
                8 // G if G < 8 else 1,
                1,
                1000,
                d,
                torch.bfloat16,
                {"fp8": True, "ragged": True},
            )
    if full:  # a long shard: 64-bit offsets and many splits over fp8 rows
        yield ("decode-fp8", 3, 4, 2, 1, 65536 + 7, 128, torch.bfloat16, {"fp8": True, "ragged": True})
    yield ("decode-fp8", 3, 4, 2, 1, 1000, 128, torch.float32, {"fp8": True, "ragged": True})
    yield (
        "decode-fp8-window-sorted",
        3,
        4,
        2,
        1,
        3000,
        128,
        torch.bfloat16,
        {"fp8": True, "window": 1024, "ragged": True, "sorted": True},
    )
    yield ("verify-fp8", 1, 4, 2, 5, 2000, 128, torch.bfloat16, {"fp8": True})
    yield ("cascade-fp8", 1, 4, 2, 12, 3000, 128, torch.bfloat16, {"fp8": True, "cascade": True})


def _case_inputs(kind, B, G, H_kv, Q, N, d, dt, extra, device, gen):
    """``(q, k, v, kwargs for both paths, kwargs for the kernel only)`` of one case."""
    H = G * H_kv
    q, k, v = (torch.randn(*s, generator=gen) for s in ((B, H, Q, d), (B, H_kv, N, d), (B, H_kv, N, d)))
    kw, fast = {}, {}
    lens = [N, N // 3, 0][:B] if extra.get("ragged") else [N] * B
    if extra.get("ragged"):
        kw["kv_len"] = torch.tensor(lens)
    if extra.get("sorted"):  # a cache's positions: ascending over each sequence's keys, stale past its length
        k_pos = torch.arange(N).repeat(B, 1) + 7 * torch.arange(B)[:, None]
        for b, n in enumerate(lens):
            k_pos[b, n:] = torch.randint(0, N, (N - n,), generator=gen)
        last = torch.tensor([7 * b + n for b, n in enumerate(lens)])  # the next position of each sequence
        kw.update(k_pos=k_pos, q_pos=last[:, None] + torch.arange(Q))
        fast["k_pos_sorted"] = True
    elif extra.get("cascade"):  # R = 3 sequences x T = 4 rows over one document of N keys
        T = Q // 3
        start = torch.tensor([N, N + 9, N + 2])  # each sequence's first position after the document
        q_pos = (start[:, None] + torch.arange(T)).reshape(-1)
        q_pos[-1] = -1  # a padded row (a shorter sequence's extension)
        kw.update(q_pos=q_pos, k_pos=torch.arange(N))
        if extra.get("window"):
            fast["k_pos_sorted"] = True
    elif extra.get("causal") or extra.get("window"):
        kw.update(q_pos=torch.arange(N - Q, N), k_pos=torch.arange(N))
    for key in ("window", "softcap"):
        if key in extra:
            kw[key] = extra[key]
    kw = {k_: t.to(device) if torch.is_tensor(t) else t for k_, t in kw.items()}
    if extra.get("fp8"):
        from treeattn_kernels import quantize

        from ..storage.kvquant import KVQuant

        quant = KVQuant(d, device)
        quant_rows = functools.partial(quantize, rotation=quant.r, dtype=quant.dtype, groups=quant.groups, impl="torch")
        k, ks = quant_rows((k * 2.0).to(device))  # (a case's cache: any rounding of it will do;
        v, vs = quant_rows(v.to(device))  # torch's costs nothing under the interpreter)
        q = quant.rotate(q.to(device, dt))  # attention in the cache's basis, as the engine calls it
        kw.update(k_scale=ks, v_scale=vs)
        return q, k, v, kw, fast
    return q.to(device, dt), k.to(device, dt), v.to(device, dt), kw, fast


def _impls(device, G: int, Q: int) -> list[str]:
    """The partial-attention implementations this device runs for ``Q`` rows of a group of
    ``G`` heads, named explicitly: on CUDA what "auto" picks (``gpu_route``; without Triton
    "auto" runs the reference there: nothing to check); on a CPU the fused CPU path, and with
    ``TREEATTN_KERNEL=triton`` (the GPU's path, interpreted) also the Triton kernel where "auto"
    would pick it."""
    from treeattn_kernels import gpu_route, triton_available

    if device.type == "cuda":
        return [gpu_route(G, Q)] if triton_available() else []
    if os.environ.get("TREEATTN_KERNEL") == "triton" and triton_available() and gpu_route(G, Q) == "triton":
        return ["cpu", "triton"]
    return ["cpu"]


def _fp8_refusal(device) -> str | None:
    """Why this device stores no fp8 KV cache (the runtime refuses it there), or None."""
    from ..storage.kvquant import fp8_dtype

    try:
        fp8_dtype(device)
        return None
    except ValueError as e:
        return str(e)


def kernel_checks(device, full: bool = True, kinds=None, say=None) -> list[dict]:
    """The partial attention of every implementation on ``device`` vs the reference, and on
    CUDA the fused merge kernels and the offline compile for the local target. ``kinds``: only
    the partial-attention cases of these kinds, nothing else (tests). ``say(what)``: a progress
    line before each part."""
    say = say or (lambda what: None)
    device = torch.device(device)
    warming = []
    if device.type == "cuda" and full and kinds is None:
        # the compile row's kernels, compiled into Triton's cache by worker processes while the
        # partial checks run: one process takes ~100 s for sm_90's 142 kernels, cold
        from treeattn_kernels.offline_compile import start_warming
        from treeattn_kernels.targets import target_of

        warming = start_warming(target_of(device))
    try:
        return _kernel_checks(device, full, kinds, say, warming)
    finally:
        for p in warming:
            if p.poll() is None:
                p.kill()


def _kernel_checks(device, full, kinds, say, warming) -> list[dict]:
    from treeattn_kernels import partial_attention, partial_attention_ref

    gen = torch.Generator().manual_seed(1234)
    out = []
    no_fp8 = _fp8_refusal(device)
    for kind, B, G, H_kv, Q, N, d, dt, extra in _kernel_cases(full):
        if kinds is not None and kind not in kinds:
            continue
        case = f"{kind} G={G} d={d} Q={Q} N={N} {_NAMES[dt]}" + (f" B={B}" if B > 1 else "")
        if extra.get("fp8") and no_fp8:
            out.append({**skipped("partial/fp8", no_fp8.split(":")[0]), "case": case})
            continue
        q, k, v, kw, fast = _case_inputs(kind, B, G, H_kv, Q, N, d, dt, extra, device, gen)
        ref_o, ref_l = partial_attention_ref(
            q.float(), k if extra.get("fp8") else k.float(), v if extra.get("fp8") else v.float(), **kw
        )
        for impl in _impls(device, G, Q):
            t0 = time.perf_counter()
            try:
                o, lse = partial_attention(q, k, v, impl=impl, **kw, **fast)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                err = max(rel_err(o, ref_o), rel_err(lse, ref_l))
                note = ""
            except Exception as e:  # a crash is a failed check, named
                err, note = math.inf, f"{type(e).__name__}: {e}".splitlines()[0][:120]
            out.append(_record(f"partial/{impl}", case, err, TOL[dt], time.perf_counter() - t0, note))
    if kinds is not None:
        return out
    if device.type == "cuda":
        say("fused merge kernels, the layer's fused kernels")
        out += _fused_merge_checks(device, gen)
        out += _fused_layer_checks(device, gen)
        if full:
            say(
                f"every kernel configuration compiled for this GPU (compile/<target>; {len(warming)} "
                "processes compiled them into the cache meanwhile)"
            )
            for p in warming:
                try:
                    p.wait(timeout=600)
                except Exception:  # noqa: BLE001 - a stuck worker: compile_all compiles what it left
                    p.kill()
            out.append(_compile_check(device))
    else:
        out.append(skipped("merge/fused", "CPU: the merge is the torch code itself"))
        out.append(skipped("layer/fused", "CPU: the norms and the MLP are transformers' operations themselves"))
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
    from treeattn_kernels.merge_triton import merge_pair_fused

    from ..parallel.merge import merge_pair

    for d, dt in ((64, torch.float32), (128, torch.bfloat16)):  # a step's two partials, into the layer's layout
        o_a, o_b = (torch.randn(2, 8, 3, d, generator=gen).to(device) for _ in range(2))
        l_a, l_b = (torch.randn(2, 8, 3, generator=gen).to(device) * 10 for _ in range(2))
        l_a[0, 1] = -math.inf  # (a row with one side empty, and one with both)
        l_a[1, 2, 0] = l_b[1, 2, 0] = -math.inf
        layer_out = torch.empty(2, 3, 8, d, dtype=dt, device=device)
        t0 = time.perf_counter()
        try:
            po, pl = merge_pair_fused(o_a, l_a, o_b, l_b, out=layer_out.transpose(1, 2))
            fo, fl = merge_pair_fused(o_a, l_a, o_b, l_b)  # (fp32, for the ranks' merge after it)
            ro, rl = merge_pair(o_a, l_a, o_b, l_b)
            err, note = max(rel_err(po, ro.to(dt)), rel_err(pl, rl), rel_err(fo, ro), rel_err(fl, rl)), ""
        except Exception as e:
            err, note = math.inf, f"{type(e).__name__}: {e}".splitlines()[0][:120]
        out.append(_record("merge/fused", f"pair d={d} {_NAMES[dt]}", err, TOL[dt], time.perf_counter() - t0, note))
    from treeattn_kernels import Partials, merge_two

    from ..parallel.merge import merge_partials

    def made(B, Q, S, d, step):  # random splits of a call, in its slices' layout
        n = -(-Q // step) * B * 8 * step * S
        o, lse = torch.randn(n * d, generator=gen), torch.randn(n, generator=gen) * 10
        return Partials(o.to(device), lse.to(device), (B, 8, Q, S, d), step)

    def dense(p):  # its splits as [B, 8, Q, S(, d)]
        return (torch.cat(x, dim=2) for x in zip(*(p.slice(i) for i in range(-(-p.shape[2] // p.step)))))

    for d, dt in ((64, torch.float32), (128, torch.bfloat16)):  # two calls' splits unreduced, into the layer
        docs = made(1, 3, 5, d, 2)  # a step's 3 rows as one document's query rows, in 2 slices
        tail = made(3, 1, 2, d, 4)  # each row's own tail
        docs.slice(0)[1][0, :, 1, 2:] = -math.inf  # (empty splits, and a row empty on one side)
        tail.slice(0)[1][2, 3] = -math.inf
        (dop, dlp), (top, tlp) = dense(docs), dense(tail)
        layer_out = torch.empty(3, 1, 8, d, dtype=dt, device=device)
        # (bf16: an fp8 pool's output turned back from its rotated basis in the same launch)
        rot = torch.linalg.qr(torch.randn(d, d, generator=gen))[0].to(device) if dt == torch.bfloat16 else None
        t0 = time.perf_counter()
        try:
            po, pl = merge_two(docs.of_rows(1), tail, out=layer_out.transpose(1, 2), rotation=rot)
            ro, rl = merge_pair(
                *merge_partials(dop[0].transpose(0, 1)[:, :, None], dlp[0].transpose(0, 1)[:, :, None], dim=3),
                *merge_partials(top, tlp, dim=3),
            )
            ro = ro if rot is None else ro @ rot
            err, note = max(rel_err(po, ro.to(dt)), rel_err(pl, rl)), ""
        except Exception as e:
            err, note = math.inf, f"{type(e).__name__}: {e}".splitlines()[0][:120]
        out.append(
            _record("merge/fused", f"two calls d={d} {_NAMES[dt]}", err, TOL[dt], time.perf_counter() - t0, note)
        )
    return out


def _fused_layer_checks(device, gen) -> list[dict]:
    """The layer's small kernels (issue 51: the RMS norm, SiLU × up) against their torch
    references, which are transformers' own operations."""
    from treeattn_kernels.fused_ref import add_rms_norm_ref, rms_norm_ref, rope_ref, silu_mul_ref
    from treeattn_kernels.fused_triton import add_rms_norm_triton, rms_norm_triton, rope_triton, silu_mul_triton

    def both(pair):  # (the normed sum and the sum, as one tensor)
        return torch.cat([t.float().flatten() for t in pair])

    out = []
    for n, dt in ((4096, torch.bfloat16), (896, torch.float16), (128, torch.float32)):
        x = (torch.randn(3, n, generator=gen) * 4).to(device, dt)
        w = (torch.randn(n, generator=gen) * 0.3 + 1).to(device, dt)
        up = torch.randn(3, n, generator=gen).to(device, dt)
        for what, fast, ref in (
            ("rms_norm", lambda: rms_norm_triton(x, w, 1e-6), lambda: rms_norm_ref(x, w, 1e-6)),
            ("silu_mul", lambda: silu_mul_triton(x, up), lambda: silu_mul_ref(x, up)),
            (
                "add_rms_norm",
                lambda: both(add_rms_norm_triton(x, up, w, 1e-6)),
                lambda: both(add_rms_norm_ref(x, up, w, 1e-6)),
            ),
        ):
            t0 = time.perf_counter()
            try:
                err, note = rel_err(fast(), ref()), ""
            except Exception as e:
                err, note = math.inf, f"{type(e).__name__}: {e}".splitlines()[0][:120]
            out.append(
                _record("layer/fused", f"{what} n={n} {_NAMES[dt]}", err, TOL[dt], time.perf_counter() - t0, note)
            )
    for d, dt in ((128, torch.bfloat16), (64, torch.float32)):
        # q and k as columns of one fused product (strided, each its own strides), angles shared
        # by the batch ([1, T, d]) as transformers' rotary embedding gives them
        B, H, Hk, T = 2, 8, 2, 5
        qkv = torch.randn(B, T, (H + 2 * Hk) * d, generator=gen).to(device, dt)
        q = qkv[..., : H * d].view(B, T, H, d).transpose(1, 2)
        k = qkv[..., H * d : (H + Hk) * d].view(B, T, Hk, d).transpose(1, 2)
        half = torch.randn(1, T, d // 2, generator=gen) * 30
        emb = torch.cat([half, half], dim=-1)
        cos, sin = emb.cos().to(device, dt), emb.sin().to(device, dt)
        t0 = time.perf_counter()
        try:
            err = max(rel_err(a, b) for a, b in zip(rope_triton(q, k, cos, sin), rope_ref(q, k, cos, sin)))
            note = ""
        except Exception as e:
            err, note = math.inf, f"{type(e).__name__}: {e}".splitlines()[0][:120]
        out.append(_record("layer/fused", f"rope d={d} {_NAMES[dt]}", err, TOL[dt], time.perf_counter() - t0, note))
    out += _write_checks(device, gen)
    return out


def _write_err(pools, quant) -> float:
    """How far the kernel's pool (``pools[0]``) is from the torch write's (``pools[1]``): a plain
    store's relative error (a cast: 0); an fp8 one's share of codes that differ, where each may
    differ by one code and each scale by one bf16 step (the rotation's fp32 sums, in another
    order, land on the other side of a rounding now and then), else inf."""
    if quant is None:
        return max(rel_err(a.float(), b.float()) for a, b in zip(*pools))

    def ordinal(x):  # a code's place on the number line: sign-magnitude bits as a signed count
        i = x.view(torch.uint8 if x.element_size() == 1 else torch.int16).to(torch.int32)
        top = 0x80 if x.element_size() == 1 else 0x8000
        return torch.where(i & top != 0, -(i & (top - 1)), i & (top - 1))

    (k, v, ks, vs), (rk, rv, rks, rvs) = pools
    codes = [(ordinal(x) - ordinal(y)).abs() for x, y in ((k, rk), (v, rv))]
    scales = [(ordinal(x) - ordinal(y)).abs() for x, y in ((ks, rks), (vs, rvs))]
    if max(int(c.max()) for c in codes + scales) > 1:
        return math.inf
    return max(float((c > 0).float().mean()) for c in codes)


def _write_checks(device, gen) -> list[dict]:
    """A step's keys and values into a block pool (``write_triton``) against the torch write
    (``write_ref``): a bf16 pool, and an fp8 one where the device stores fp8 (its codes and
    scales compared: :func:`_write_err`)."""
    from treeattn_kernels.write_ref import write_kv_ref
    from treeattn_kernels.write_triton import write_kv_triton

    from ..storage.kvquant import KVQuant

    out = []
    H, d, blocks, page = 8, 128, 4, 16
    n = blocks * page  # every slot written, in a shuffled order (a share of differing codes is one of written ones)
    k, v = (torch.randn(n, H, d, generator=gen).to(device, torch.bfloat16) * 3 for _ in range(2))
    slots = torch.randperm(n, generator=gen).to(device)
    kinds = [("bf16", torch.bfloat16, None)]
    if _fp8_refusal(device) is None:
        quant = KVQuant(d, device)
        kinds.append((quant.name, quant.dtype, quant))
    for name, dt, quant in kinds:
        t0 = time.perf_counter()
        try:
            pools = []
            for write in (write_kv_triton, write_kv_ref):
                stores = [torch.zeros(blocks, H, page, d, dtype=dt, device=device) for _ in range(2)]
                if quant is not None:
                    stores += [
                        torch.zeros(blocks, H, page, quant.groups, dtype=torch.bfloat16, device=device)
                        for _ in range(2)
                    ]
                    write(*stores[:2], slots, k, v, *stores[2:], quant.r)
                else:
                    write(*stores, slots, k, v)
                pools.append(stores)
            err, note = _write_err(pools, quant), ""
        except Exception as e:
            err, note = math.inf, f"{type(e).__name__}: {e}".splitlines()[0][:120]
        tol = TOL[torch.bfloat16] if quant is None else 0.01  # (fp8: a share of codes, each one step off at most)
        out.append(_record("layer/fused", f"write_kv d={d} {name}", err, tol, time.perf_counter() - t0, note))
    return out


def _compile_check(device) -> dict:
    from treeattn_kernels.offline_compile import compile_all
    from treeattn_kernels.targets import target_of

    target = target_of(device)
    t0 = time.perf_counter()
    res = compile_all(target)
    # A kernel that does not compile, or asks for more shared memory than the GPU has, cannot
    # launch: the kernel path fails (generate falls back to the reference). A spill only costs
    # speed: CI holds its Triton to none, and another release may spill a few bytes (Triton 3.6
    # on sm_90: 8 bytes in two fp32 soft-capped decode kernels), so it is a note, not a failure.
    bad = [
        f"{k['kernel']} ({k['first_config']}): shared {k['shared_bytes']} B of {k['max_shared']}"
        for k in res["kernels"]
        if k["shared_bytes"] > k["max_shared"]
    ]
    bad += [f"{e['config']}: {e['error']}" for e in res["errors"]]
    spills = [
        f"spill {k['spill_bytes']} B: {k['kernel']} ({k['first_config']})"
        for k in res["kernels"]
        if k["spill_bytes"] > 0
    ]
    rec = _record(
        f"compile/{target.name}",
        f"{res['configs']} configurations, {len(res['kernels'])} kernels",
        1.0 if bad else 0.0,
        0.0,
        time.perf_counter() - t0,
        "; ".join(bad + spills)[:300],
    )
    rec["max_err"] = None
    return rec


# ---------------------------------------------------------------- the verdict cache


@functools.lru_cache(maxsize=1)
def _kernels_digest() -> str:
    """A digest of the kernels' sources (``treeattn_kernels``, every ``.py``; read once a process)."""
    import treeattn_kernels

    h = hashlib.sha256()
    for f in sorted(Path(treeattn_kernels.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def machine_key(device) -> dict:
    """What a kernel verdict depends on: the device, its driver, torch, triton, treeattn, and
    which paths the checks cover (a verdict from before a path was checked is not reused)."""
    device = torch.device(device)
    key = {"device": device.type, "torch": torch.__version__, "treeattn": __version__, "checks": list(KERNEL_PATHS)}
    key["kernels"] = _kernels_digest()  # (a kernel changed within a version is checked again)
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
    return {"key": machine_key(device), "ok": not failed, "failed": failed, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}


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
    p = subprocess.run(
        [sys.executable, "-m", "treeattn_cli.main", "check", "--kernels-only", "--json", "--quiet"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    records = records_in(p.stdout)
    if records is None:
        why = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"ok": False, "failed": [f"the kernel self-check did not complete: {why}"]}
    return verdict_of(device, records)


def records_in(text: str) -> list[dict] | None:
    """The last JSON list of check records in a child's stdout, whatever else a library printed
    before or after it (a stray line must not turn a passed check into a failed one, nor hide
    a failed one); None when there is none."""
    dec, found, at = json.JSONDecoder(), None, 0
    for line in text.splitlines(keepends=True):
        start = at + len(line) - len(line.lstrip())
        at += len(line)
        if not line.lstrip().startswith("["):
            continue
        try:
            val, _ = dec.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(val, list) and val and all(isinstance(r, dict) and "path" in r and "verdict" in r for r in val):
            found = val
    return found


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
