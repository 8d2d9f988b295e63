"""Rows that do not see their neighbours: a row's weight matmuls give the same bits whether it is
alone, one of a batch of 32, a draft of a verify or a token of a question's prefill (issue 49).

A batch, a verify of K drafts and a joined request all change how many rows share a matrix
multiply, and BLAS libraries pick their kernel by that number: measured on the project's CPU
(MKL 2024.2, torch 2.13), a row of ``linear(x, W)`` alone (a GEMV) differs in its last bits from
the same row among 2..64 rows, and the GEMMs of 2-3 rows differ from those of 8 or 16. An fp8
cache turns one such bit into a whole e4m3 step of a key, and answers change.

Two ways to make every row's numbers its own, chosen per model by :func:`prepare` on its own
weights and checked there (the check computes rows alone and among 2..200 others at several
places and compares the bits):

* ``library``: the matmul library is invariant by itself. MKL's strict conditional numerical
  reproducibility (``MKL_CBWR=AUTO,STRICT``, set by ``treeattn_cli/__init__.py`` before any MKL
  call of the process) fixes each element's order of summation whatever the number of rows or
  threads: measured, every row equal at any M. No padding (a layer's rows are only made
  contiguous); a one-row GEMV then runs as a GEMM row (BENCHMARKS.md, "what bit-for-bit answers
  cost").
* ``fixed``: every call has exactly ``chunk`` rows (the rows cut in chunks, the last one's rows
  copied into a buffer of ``chunk`` rows: :func:`_padded`): one shape, one kernel, a row's numbers independent of its place in the chunk and of
  its neighbours (measured on the CPU without strict mode at 8 rows; on GPUs cuBLAS chooses its
  kernel by the shape, so one shape is one kernel).

Both are a wrapper of each linear layer's forward (:func:`fixed_linear`; tensor-parallel styles
included: they wrap the layer's forward, ours wraps theirs), and the check runs the layers through
it, collectives and all.

Fixed rows apply where rows of several requests meet (:func:`shared_rows`: the engine's decode
steps, verifies and questions); a document's prefill segments, whose rows are the document's
alone, run at their natural size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__

CHUNK = {"cpu": 8, "cuda": 64}  # rows per call where the library is not invariant by itself
PROBE_ROWS = (1, 2, 3, 17, 64, 200)  # how many rows a checked row is computed among
_SHARED = {"on": 0}  # > 0: the forward under way mixes requests' rows (shared_rows)
_PAD = {"chunk": None}  # the rows empty_rows pads to: every fixed policy's chunk of this process


@dataclass(frozen=True)
class RowPolicy:
    """How this model's linear layers keep rows apart: ``how`` is ``library`` or ``fixed``
    (``chunk`` rows per call), ``checked`` whether the check of :func:`prepare` passed."""

    how: str
    chunk: int | None
    checked: bool

    def describe(self) -> str:
        """One line for ``generate --json``'s record (``rows``)."""
        what = (
            f"the matmul library's own (MKL_CBWR={os.environ.get('MKL_CBWR', '')})"
            if self.how == "library"
            else f"every linear layer's call on {self.chunk} rows (padded)"
        )
        return f"{what}, checked" if self.checked else f"{what}: NOT row-invariant on this machine"


@contextlib.contextmanager
def shared_rows(on: bool = True):
    """Inside: linear layers of a ``fixed`` policy cut their rows in fixed chunks (the forward
    mixes rows of several requests, or must give a request's rows as any other forward would)."""
    _SHARED["on"] += int(on)
    try:
        yield
    finally:
        _SHARED["on"] -= int(on)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if hasattr(w, "to_local") else w  # a tensor-parallel shard


def fixed_linear(forward, chunk: int | None):
    """``forward`` (a linear layer's) on rows in contiguous memory, and with a ``chunk`` on
    exactly ``chunk`` rows per call while :func:`shared_rows` is on: the rows of ``x [..., in]``
    cut in chunks, the last padded. (Contiguous: a tensor-parallel layer takes another route for
    strided rows than for contiguous ones, measured: the LM head's ``[B, 1, in]`` slice of the
    last positions gives row 0 other bits beside a second row.)"""

    def run(x, *args, **kwargs):
        if chunk is None or not _SHARED["on"]:
            return forward(x.contiguous(), *args, **kwargs)
        lead, width = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, width)
        n = rows.shape[0]
        outs = []
        for i in range(0, n, chunk):
            part = rows[i : i + chunk]
            if part.shape[0] < chunk:  # (the same shape always)
                full = _in_place(part, chunk)
                part = full if full is not None else _padded(part, chunk)
            outs.append(forward(part.contiguous(), *args, **kwargs)[: min(chunk, n - i)])
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out.reshape(*lead, out.shape[-1])

    return run


_PADS: dict = {}  # (device, dtype, width, chunk) -> the rows a short chunk is copied into


def _padded(part: torch.Tensor, chunk: int) -> torch.Tensor:
    """``part`` (fewer than ``chunk`` rows) as the first rows of a buffer of ``chunk`` rows kept for
    its shape: one copy, where a fresh zero-padded chunk took two launches (zeros, cat). The rows
    below hold whatever an earlier call left there: a row's numbers do not depend on its
    neighbours (what the policy is, checked by :func:`prepare`), and their outputs are dropped.
    Calls share a buffer in stream order (each layer's matmul reads it before the next layer's
    copy), CUDA graphs included; one is made outside a capture, never inside one."""
    key = (part.device, part.dtype, part.shape[1], chunk)
    buf = _PADS.get(key)
    if buf is None:
        if part.is_cuda and torch.cuda.is_current_stream_capturing():
            return torch.cat([part, part.new_zeros(chunk - part.shape[0], part.shape[1])])
        with torch.inference_mode(False):  # (a plain tensor: written in and out of inference mode)
            buf = _PADS[key] = part.new_zeros(chunk, part.shape[1])
    buf[: part.shape[0]].copy_(part)
    return buf


def empty_rows(shape, dtype=None, device=None, width: int | None = None) -> torch.Tensor:
    """A new tensor of ``shape`` for rows a linear layer takes next (``numel / width`` rows of
    ``width``, by default ``shape[-1]``): under a fixed policy, while :func:`shared_rows` is on, its
    storage runs on to whole chunks of rows, which :func:`fixed_linear` then reads where they lie
    (:func:`_in_place`) instead of copying the short chunk into its buffer: the producers of a
    layer's rows (the fused norm and ``silu_mul`` on a GPU, the attention's output) allocate so, and
    a decode step's four copies a layer go. Elsewhere a plain ``torch.empty``."""
    chunk, width = _PAD["chunk"], width or shape[-1]
    n = math.prod(shape)
    if chunk is None or not _SHARED["on"] or n == 0 or n % width:
        return torch.empty(shape, dtype=dtype, device=device)
    rows = -(-(n // width) // chunk) * chunk
    return torch.empty(rows * width, dtype=dtype, device=device)[:n].view(shape)


def _in_place(part: torch.Tensor, chunk: int) -> torch.Tensor | None:
    """``part`` (fewer than ``chunk`` rows of unit stride) and the rows after it in its storage,
    ``chunk`` rows in all, when its storage holds them (:func:`empty_rows` made it so): the call's
    shape without a copy. The rows past ``part`` hold whatever is there (another use of the
    buffer, nothing at all): a row's numbers do not depend on its neighbours (the policy,
    checked), and their outputs are dropped. None where the storage ends sooner."""
    width = part.shape[1]
    if part.stride(1) != 1 or (part.shape[0] > 1 and part.stride(0) != width):
        return None
    if (part.storage_offset() + chunk * width) * part.element_size() > part.untyped_storage().nbytes():
        return None
    return part.as_strided((chunk, width), (width, 1))


def rows_invariant(f, width: int, device, dtype, seed: int = 0) -> bool:
    """Whether ``f(x)`` (a linear layer, ``x [..., width]``) gives a row the same bits alone and
    among 2..200 other rows (:data:`PROBE_ROWS`) at its first and last place, the rows as a
    batch of positions (``[M, 1, width]``: a decode step's) and as one sequence's (``[1, M,
    width]``: a prefill's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(width, generator=g).to(device, dtype)
    alone = f(x[None, None])[0, 0]
    for m in PROBE_ROWS[1:]:
        others = torch.randn(m, width, generator=g).to(device, dtype)
        for at in (0, m - 1):
            rows = others.clone()
            rows[at] = x
            if not (torch.equal(f(rows[:, None])[at, 0], alone) and torch.equal(f(rows[None])[0, at], alone)):
                return False
    return True


def _linears(model) -> list:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _check(model) -> bool:
    """Every kind of linear layer of ``model`` (by name and local weight), through its forward as
    installed (a tensor-parallel one's collectives included: every rank checks the same layers in
    the same order, with the same rows)."""
    seen = set()
    for name, m in _linears(model):
        w = _local(m.weight)
        key = (name.rsplit(".", 1)[-1], tuple(w.shape), w.dtype)
        if key in seen:
            continue
        seen.add(key)
        if not rows_invariant(m, _width(m, w), w.device, w.dtype):
            return False
    return True


def _width(m, w) -> int:
    """The width of the rows layer ``m`` takes: its weight's (a tensor-parallel shard's: the
    rows arrive split), or the declared ``in_features`` for a style that splits them itself (a
    row-wise layer whose input is replicated). The same answer on every rank."""
    try:
        m(torch.zeros(1, w.shape[1], device=w.device, dtype=w.dtype))
        return w.shape[1]
    except RuntimeError:
        return m.in_features


def _verdict_file(model, linears) -> Path | None:
    """Where the policy of a model of this shape is remembered on this machine (the check costs
    seconds on a CPU: the LM head among 200 rows), or None for a tensor-parallel model, whose
    check runs collectives that every rank must run alike (a rank that found the verdict would
    skip them)."""
    from ..paths import cache_root

    if any(hasattr(m.weight, "to_local") for m in linears):
        return None
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        info = []
    cpu = [next((ln for ln in info if ln.startswith(k)), "") for k in ("model name", "flags")]
    w = linears[0].weight if linears else None
    key = {
        "torch": torch.__version__,
        "treeattn": __version__,
        "mkl": os.environ.get("MKL_CBWR"),
        "cpu": cpu,
        "device": str(w.device) if w is not None else "",
        "cuda": torch.cuda.get_device_name(w.device) if w is not None and w.device.type == "cuda" else None,
        "layers": sorted(
            {(n.rsplit(".", 1)[-1], tuple(m.weight.shape), str(m.weight.dtype)) for n, m in _linears(model)}
        ),
    }
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / "rows" / f"{digest}.json"


def prepare(model) -> RowPolicy:
    """Make ``model``'s linear layers row-invariant and say how (``model.treeattn_rows``): the
    library's own matmul where it is invariant on the model's layers (MKL's strict mode on a
    CPU), else fixed chunks of rows (:data:`CHUNK`), checked the same way. Where neither passes
    (an unknown BLAS), fixed chunks stay and the policy says it is not checked. The verdict is
    remembered per machine, library and model shape (not for a tensor-parallel model)."""
    from ..paths import write_atomic

    linears = [m for _, m in _linears(model)]
    device = _local(linears[0].weight).device if linears else torch.device("cpu")
    real = [m.forward for m in linears]
    where = _verdict_file(model, linears)
    try:
        policy = RowPolicy(**json.loads(where.read_text())) if where is not None else None
    except (OSError, ValueError, TypeError):
        policy = None
    with torch.inference_mode(), shared_rows():
        if policy is None:
            for m, f in zip(linears, real):
                m.forward = fixed_linear(f, None)
            policy = RowPolicy("library", None, True)
            if device.type != "cpu" or not _check(model):
                chunk = CHUNK.get(device.type, CHUNK["cuda"])
                for m, f in zip(linears, real):
                    m.forward = fixed_linear(f, chunk)
                policy = RowPolicy("fixed", chunk, _check(model))
            if where is not None:
                try:
                    where.parent.mkdir(parents=True, exist_ok=True)
                    write_atomic(where, json.dumps(vars(policy)))
                except OSError:  # a read-only cache: checked again next time
                    pass
        else:
            for m, f in zip(linears, real):
                m.forward = fixed_linear(f, policy.chunk)
    model.treeattn_rows = policy
    if policy.chunk:  # (models of two chunks in one process: storage in whole chunks of both)
        _PAD["chunk"] = math.lcm(_PAD["chunk"] or 1, policy.chunk)
    return policy
