"""treeattn's attention kernels (installed as ``treeattn_kernels``, never as ``kernels``).

One entry point, :func:`partial_attention`: a rank's attention of its queries to its own KV
shard, returning the un-merged partial ``(o, lse)``. On CUDA it runs the Triton split-KV
kernel for decode and ATen's fused flash kernel for long query blocks (prefill); on CPU ATen's
fused CPU flash kernel (``partial_aten``) where it applies and the pure-torch reference
otherwise (neither imports triton).
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch

from .fused_ref import add_rms_norm_ref, rms_norm_ref, rope_ref, silu_mul_ref
from .paged_ref import gather_pages, partial_attention_paged_ref
from .partial_ref import add_sink, dequantize, partial_attention_ref
from .write_ref import quantize_ref, write_kv_ref

__all__ = [
    "partial_attention",
    "partial_attention_paged",
    "Partials",
    "merge_two",
    "partial_attention_ref",
    "partial_attention_paged_ref",
    "rms_norm",
    "rms_norm_ref",
    "add_rms_norm",
    "add_rms_norm_ref",
    "silu_mul",
    "silu_mul_ref",
    "rope",
    "rope_ref",
    "gather_pages",
    "gpu_path",
    "gpu_branches",
    "add_sink",
    "dequantize",
    "quantize",
    "quantize_ref",
    "write_kv",
    "takes_triton",
    "write_kv_ref",
    "triton_available",
    "gpu_route",
    "triton_problem",
    "use_reference",
    "reference_only",
    "TRITON_FLOOR",
]

_REFERENCE = {"on": False}
_GPU_BRANCHES = {"on": False}


class Partials(NamedTuple):
    """A call's splits, not yet reduced (``partial_attention_paged(..., partials=True)`` where
    the Triton split kernel runs): each split's ``o`` and natural-log lse, fp32. The call's
    ``Q`` query rows run in slices of ``step`` (the kernel's tile), and slice ``i`` writes its
    ``[B, H, q_i, S, d]`` (``q_i = min(step, Q - i·step)``) contiguous from ``i·B·H·step·S·d``
    of ``op`` (and ``[B, H, q_i, S]`` of ``lp``): the split kernel's own layout, whose one more
    argument spilled. ``rows``: how a merge's ``(r, h, t)`` row finds its ``(b, q)``, ``b = r·rows[0]``
    and ``q = r·rows[1] + t`` (a step's tail: ``(1, 0)``; its documents' call, each row's T
    tokens as query rows of one document: ``(0, T)``, :meth:`of_rows`). Two calls' merge as one
    launch: :func:`merge_two`."""

    op: torch.Tensor  # flat fp32
    lp: torch.Tensor  # flat fp32
    shape: tuple  # (B, H, Q, S, d)
    step: int
    rows: tuple = (1, 0)

    def slice(self, i: int):
        """Slice ``i``'s ``(op [B, H, q_i, S, d], lp [B, H, q_i, S])``: views to write."""
        B, H, Q, S, d = self.shape
        q = min(self.step, Q - i * self.step)
        at = i * B * H * self.step * S
        return (
            self.op[at * d : (at + B * H * q * S) * d].view(B, H, q, S, d),
            self.lp[at : at + B * H * q * S].view(B, H, q, S),
        )

    def dense(self):
        """``(op [B, H, Q, S, d], lp [B, H, Q, S])``: the slices side by side (a copy where
        there are several)."""
        B, H, Q, S, d = self.shape
        parts = [self.slice(i) for i in range(-(-Q // self.step))]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)

    def of_rows(self, T: int) -> Partials:
        """These splits merged as ``[R, H, T]`` rows where the call's query rows were each row's
        ``T`` tokens in turn, of one document (``B = 1``)."""
        return self._replace(rows=(0, T))


def merge_two(a, b, *, out=None, rotation=None):
    """Two partials of one query's disjoint keys merged, each ``(o, lse)`` or :class:`Partials`
    (``o [B, H, T, d]``): both unreduced, one Triton launch (``merge_triton.reduce_pair``: each
    call's splits reduced as its own reduce would, the pair merged as ``merge_pair_fused``, the
    same bits); else each reduced, then ``merge_pair_fused``. ``(o fp32, lse)``, or ``o`` written
    into ``out`` (any strides but along d, any dtype) and ``out`` returned; ``rotation [d, d]``:
    the merged ``o`` turned by it first (``o @ rotation``: an fp8 pool's output back from its
    rotated basis, in the same launch where both are unreduced). The GPU's branches only (Triton,
    interpreted on a CPU)."""
    from .merge_triton import merge_pair_fused, reduce_pair

    if isinstance(a, Partials) and isinstance(b, Partials):
        return reduce_pair(a, b, out=out, rotation=rotation)
    (oa, la), (ob, lb) = (reduce_pair(p, None) if isinstance(p, Partials) else p for p in (a, b))
    if rotation is None:
        return merge_pair_fused(oa, la, ob, lb, out=out)
    o, lse = merge_pair_fused(oa, la, ob, lb)
    o = o @ rotation.to(o.device, torch.float32)
    if out is not None:
        out.copy_(o)
    return (o if out is None else out), lse


def use_reference(on: bool = True) -> None:
    """Make ``impl="auto"`` run the pure-torch reference in this process (and ``comm`` merge
    with torch, not the fused kernels): what a rank does when the fast kernels failed their
    self-check on this machine (``treeattn check``). Exact, slower."""
    _REFERENCE["on"] = bool(on)


def reference_only() -> bool:
    return _REFERENCE["on"]


@contextlib.contextmanager
def gpu_branches():
    """Within: the engine takes the GPU's branches on CPU tensors (documents and tails read
    through their block tables, :func:`gpu_path` true), with the torch reference under every
    call (:func:`use_reference`). What the first-use probe runs to vet a model family on the
    branches a GPU takes, where no GPU is (``verify/family.py``)."""
    before = (_GPU_BRANCHES["on"], _REFERENCE["on"])
    _GPU_BRANCHES["on"] = _REFERENCE["on"] = True
    try:
        yield
    finally:
        _GPU_BRANCHES["on"], _REFERENCE["on"] = before


# The oldest Triton with every feature the kernels use (tests/kernel/test_partial_attention.py checks
# the kernels' source against TRITON_FEATURES; pyproject's floor is this one).
TRITON_FLOOR = (3, 2)
TRITON_FEATURES = {"do_not_specialize_on_alignment": (3, 2), "do_not_specialize": (2, 1)}


def _version_tuple(v: str) -> tuple:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def triton_problem() -> str | None:
    """Why the Triton kernel cannot run here (one line), or None: not installed, broken, or
    older than :data:`TRITON_FLOOR`."""
    try:
        import triton
    except Exception as e:  # ImportError, or a broken triton install
        return f"Triton cannot be imported ({type(e).__name__}: {e})"[:200]
    v = getattr(triton, "__version__", "0")
    if _version_tuple(v) < TRITON_FLOOR:
        need = ".".join(map(str, TRITON_FLOOR))
        return (
            f"Triton {v} is older than {need}, the oldest with every feature the decode kernel uses "
            f"(pip install 'triton>={need}')"
        )
    return None


_AVAILABLE: dict = {}  # id of the triton module seen -> whether the kernel can run (asked every decode step)


def triton_available() -> bool:
    """True when the Triton kernel can run here (triton importable, not older than its floor)."""
    import sys

    ok = _AVAILABLE.get(id(sys.modules.get("triton")))
    if ok is None:
        ok = triton_problem() is None  # imports triton: the key below is the module it found
        if ok:
            try:
                from . import partial_triton  # noqa: F401
            except Exception:  # ImportError, or a broken triton install
                ok = False
        _AVAILABLE[id(sys.modules.get("triton"))] = ok
    return ok


def gpu_route(G: int, Q: int) -> str:
    """What ``auto`` runs on the GPU's path for ``Q`` query rows of a group of ``G`` heads (when
    Triton can run): the Triton split kernel up to its tile's rows, ATen's flash kernel above
    (``treeattn check`` checks exactly this choice)."""
    from .partial_triton import MAX_ROWS

    return "aten" if G * Q > MAX_ROWS else "triton"


def gpu_path(q) -> bool:
    """Whether ``auto`` takes the GPU's kernels for ``q``: on CUDA, or with ``TREEATTN_KERNEL=triton``
    (Triton's interpreter on a CPU, for tests of that path end to end), or within
    :func:`gpu_branches`."""
    return q.is_cuda or _GPU_BRANCHES["on"] or os.environ.get("TREEATTN_KERNEL") == "triton"


def _small_impl(x, impl: str) -> str:
    """``auto``: Triton on CUDA (on a CPU with ``TREEATTN_KERNEL=triton``, interpreted) where
    it can run and the kernels passed their self-check (:func:`use_reference`), else torch."""
    if impl == "auto":  # (within gpu_branches the reference is on: torch)
        impl = "triton" if gpu_path(x) and not _REFERENCE["on"] and triton_available() else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"unknown impl {impl!r} (expected auto, triton or torch)")
    return impl


def quantize(x, rotation, dtype, groups: int, *, impl: str = "auto"):
    """Rows ``x [..., d]`` rotated and rounded to fp8 with their bf16 scales
    (:func:`write_ref.quantize_ref`): on the GPU's branches by the pool write's own kernel
    (``write_triton.quantize_triton``: the bits a write stores), else the torch reference."""
    if _small_impl(x, impl) == "triton":
        from .write_triton import quantizable, quantize_triton

        if quantizable(x.shape[-1], groups, rotation):
            return quantize_triton(x, rotation, dtype, groups)
    return quantize_ref(x, rotation, dtype, groups)


def takes_triton(x) -> bool:
    """Whether a small operation on ``x`` runs its Triton kernel (``auto``): on the GPU's branches,
    where Triton runs and the kernels passed their self-check; else its torch reference."""
    return _small_impl(x, "auto") == "triton"


def write_kv(k_store, v_store, slots, k, v, ks_store=None, vs_store=None, rotation=None, *, impl: str = "auto"):
    """Keys and values ``k, v [n, H_kv, d]`` into a block pool's layer at flat ``slots [n]``
    (:func:`write_ref.write_kv_ref`; fp8 with ``ks_store, vs_store`` and ``rotation``): one Triton
    launch on CUDA where the shapes allow (``write_triton.writable``), else the torch reference
    (a CPU's bits are its bits)."""
    if _small_impl(k_store, impl) == "triton":
        from .write_triton import writable, write_kv_triton

        if writable(k_store, k, ks_store, rotation, v_store, v, vs_store):
            return write_kv_triton(k_store, v_store, slots, k, v, ks_store, vs_store, rotation)
    return write_kv_ref(k_store, v_store, slots, k, v, ks_store, vs_store, rotation)


def rms_norm(x, weight, eps: float, *, impl: str = "auto", empty=torch.empty):
    """The RMS norm of Llama-style models (:func:`fused_ref.rms_norm_ref`): one Triton launch on
    CUDA (``fused_triton``; ``empty`` makes its output), else the torch reference, transformers'
    own operations (a CPU's bits are its bits)."""
    if _small_impl(x, impl) == "triton":
        from .fused_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, empty)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x, residual, weight, eps: float, *, impl: str = "auto", empty=torch.empty):
    """A layer's residual add and the RMS norm after it, ``(rms_norm(residual + x), residual +
    x)`` (:func:`fused_ref.add_rms_norm_ref`): one Triton launch on CUDA (``empty`` makes the
    normed output), else the torch reference (two operations, transformers' own)."""
    if _small_impl(x, impl) == "triton":
        from .fused_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps, empty)
    return add_rms_norm_ref(x, residual, weight, eps)


def silu_mul(gate, up, *, impl: str = "auto", empty=torch.empty):
    """``silu(gate) * up`` of a Llama-style MLP (:func:`fused_ref.silu_mul_ref`): one Triton
    launch on CUDA (``empty`` makes its output), else the torch reference."""
    if _small_impl(gate, impl) == "triton":
        from .fused_triton import silu_mul_triton

        return silu_mul_triton(gate, up, empty)
    return silu_mul_ref(gate, up)


def rope(q, k, cos, sin, *, impl: str = "auto"):
    """The rotary embedding of ``q [B, H, T, d]`` and ``k [B, H_kv, T, d]`` by ``cos, sin [B, T,
    d]`` (:func:`fused_ref.rope_ref`, transformers' ``apply_rotary_pos_emb``): one Triton launch
    for both on CUDA (``d`` a power of two), else the torch reference."""
    d = q.shape[-1]
    if _small_impl(q, impl) == "triton" and d & (d - 1) == 0:
        from .fused_triton import rope_triton

        return rope_triton(q, k, cos, sin)
    return rope_ref(q, k, cos, sin)


def partial_attention_paged(
    q,
    k_pool,
    v_pool,
    block_tables,
    kv_len,
    *,
    scale=None,
    q_pos=None,
    pos_pool=None,
    window=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
    out_dtype=None,
    block_lse=None,
    lse_block: int = 1,
    lse_rows=None,
    impl: str = "auto",
    fixed_splits: bool = False,
    partials: bool = False,
):
    """Partial attention of ``q [B, H, Q, d]`` to the shards ``block_tables [B, nb]`` name in a
    layer's pool ``k_pool, v_pool [blocks, H_kv, page, d]`` (row b: the first ``kv_len[b]``
    tokens of its blocks; ``pos_pool [blocks, page]`` their positions, for ``q_pos [B, Q]``
    masks and windows; ``k_scale, v_scale [blocks, H_kv, page, G]``: an fp8 pool). On the GPU's
    path (:func:`gpu_path`) the Triton split kernel reads through the tables, one launch for the
    rows of every sequence; elsewhere, or past its rows, each row's blocks are gathered and
    :func:`partial_attention` runs on them. ``block_lse [B, H, Q, ceil(nb·page / lse_block)]``,
    ``lse_rows``: as :func:`partial_attention`, over each row's keys in table order;
    ``fixed_splits`` too. Returns ``(o [B, H, Q, d], lse [B, H, Q])``; with ``partials`` where the
    Triton kernel runs, its splits unreduced (:class:`Partials`, for :func:`merge_two`)."""
    blocks = dict(block_lse=block_lse, lse_block=lse_block, lse_rows=lse_rows) if block_lse is not None else {}
    if impl == "auto" and _REFERENCE["on"]:
        impl = "torch"
    G = q.shape[1] // k_pool.shape[1]
    fast = impl == "auto" and gpu_path(q) and triton_available() and gpu_route(G, q.shape[2]) == "triton"
    if impl == "triton" or fast:
        from .partial_triton import partial_attention_triton_paged

        out = torch.empty(*q.shape, dtype=out_dtype or q.dtype, device=q.device)
        return partial_attention_triton_paged(
            q,
            k_pool,
            v_pool,
            block_tables,
            kv_len,
            scale=scale,
            q_pos=q_pos,
            pos_pool=pos_pool,
            window=window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
            out=out,
            fixed_splits=fixed_splits,
            partials=partials,
            **blocks,
        )
    kw = dict(blocks)
    if k_scale is not None:
        kw.update(k_scale=gather_pages(k_scale, block_tables), v_scale=gather_pages(v_scale, block_tables))
    if q_pos is not None:
        kw.update(q_pos=q_pos, k_pos=gather_pages(pos_pool, block_tables), k_pos_sorted=True)
    return partial_attention(
        q,
        gather_pages(k_pool, block_tables),
        gather_pages(v_pool, block_tables),
        scale=scale,
        kv_len=kv_len,
        window=window,
        softcap=softcap,
        out_dtype=out_dtype,
        impl=impl,
        fixed_splits=fixed_splits,
        **kw,
    )


def partial_attention(
    q,
    k,
    v,
    *,
    scale=None,
    q_pos=None,
    k_pos=None,
    kv_len=None,
    window=None,
    softcap=None,
    sink=None,
    k_scale=None,
    v_scale=None,
    k_pos_sorted: bool = False,
    out=None,
    lse_out=None,
    out_dtype=None,
    block_lse=None,
    lse_block: int = 1,
    lse_rows=None,
    impl: str = "auto",
    fixed_splits: bool = False,
):
    """Partial attention of ``q [B, H, Q, d]`` to one KV shard ``k, v [B, H_kv, N, d]``.

    Returns ``(o [B, H, Q, d] in q.dtype, lse [B, H, Q] fp32, natural log)``; rows with no
    visible key give ``o = 0, lse = -inf``. See :func:`partial_attention_ref` for the
    arguments. ``impl``: ``"auto"`` (on CUDA Triton for decode, ATen's flash kernel for long
    query blocks; on CPU the fused CPU path), ``"triton"``,
    ``"aten"`` (alias ``"cpu"``: the fused ATen path), ``"torch"`` (the reference).
    ``out_dtype``: the dtype of ``o`` when no ``out`` is given (default q's); partials that are
    merged later stay fp32, so a merge of p shards rounds once, like one device. ``sink [H]``:
    learned sink logits folded into this partial (give them to one partial of a merge only).
    ``k_scale, v_scale [B, H_kv, N, G]``: ``k`` and ``v`` are fp8, each token's row scaled by
    G factors, one per ``d / G`` channels (an fp8 KV cache, :func:`dequantize`); the Triton
    kernel dequantizes each tile in registers, the reference and the fused ATen path one key
    block at a time.
    ``k_pos_sorted``: the caller promises ``k_pos`` ascends over each sequence's valid keys (a
    cache's positions do): the Triton kernel then searches a sliding window's first key instead
    of walking the shard; the other paths do not need it.

    Rows whose bits must not depend on their neighbours (issue 49: a batch's, a verify's) take
    ``impl="triton"`` on the GPU's path and ``"torch"`` elsewhere: both reduce keys in splits
    fixed by their index, never by the rows or the grid. ``fixed_splits``: the Triton kernel's
    splits are of one length whatever a row's length (keys that grow at the end: a tail); the
    reference's always are.

    ``TREEATTN_KERNEL=triton`` in the environment makes ``auto`` choose on CPU as it does on CUDA
    (the Triton kernel for decode and verify rows, ATen for long query blocks), the kernel run
    by Triton's interpreter (``TRITON_INTERPRET=1``): slow, for tests of the GPU's path end to
    end on a machine without one.
    """
    if out is None and out_dtype is not None:
        out = torch.empty(*q.shape, dtype=out_dtype, device=q.device)
    kw = dict(
        scale=scale,
        q_pos=q_pos,
        k_pos=k_pos,
        kv_len=kv_len,
        window=window,
        softcap=softcap,
        sink=sink,
        out=out,
        lse_out=lse_out,
    )
    if block_lse is not None:
        kw.update(block_lse=block_lse, lse_block=lse_block, lse_rows=lse_rows)
    if impl == "auto" and _REFERENCE["on"]:
        impl = "torch"
    on_gpu_path = gpu_path(q)
    if impl == "auto":
        if on_gpu_path and triton_available():  # (on CPU, TREEATTN_KERNEL=triton: the same choice, interpreted)
            impl = gpu_route(q.shape[1] // max(1, k.shape[1]), q.shape[2])
        else:  # (rows that ask for block_lse take the same path as the others: the fused kernel's
            # partials, the scores beside them, so a citation never changes an answer's bits)
            impl = "aten" if q.device.type == "cpu" else "torch"
    if k_scale is not None:  # every path takes the fp8 rows and their scales (ATen's: a key block at a time)
        kw.update(k_scale=k_scale, v_scale=v_scale)
    if impl in ("aten", "cpu"):
        from .partial_aten import partial_attention_aten

        slow = None
        if on_gpu_path and triton_available():
            import functools

            from .partial_triton import partial_attention_triton

            slow = functools.partial(partial_attention_triton, k_pos_sorted=k_pos_sorted)
        return partial_attention_aten(q, k, v, fallback=slow, **kw)
    if impl == "torch":
        return partial_attention_ref(q, k, v, **kw)
    if impl == "triton":
        from .partial_triton import partial_attention_triton

        return partial_attention_triton(q, k, v, k_pos_sorted=k_pos_sorted, fixed_splits=fixed_splits, **kw)
    raise ValueError(f"unknown kernel impl {impl!r} (expected auto, triton, aten, cpu or torch)")
