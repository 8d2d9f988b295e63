"""fp8 KV cache (docs/architecture.md §11, issue 27): keys and values stored as 8-bit floats in a rotated
basis, with a bfloat16 scale per 32 channels of each token's row.

Scales matter more than the format. A rotation ``R`` of the head dimension (a normalised
Hadamard matrix when it is a power of two, else a fixed random orthogonal one) spreads a few
outlier channels over all of them; then each group of 32 channels of a token's row gets its
own scale, so its largest magnitude lands on e4m3's largest value. Attention runs on ``q R``
against the rotated keys (scores unchanged: ``(q R)(k R)ᵀ = q kᵀ``) and its output, a
combination of rotated values, turns back with ``Rᵀ``.

Measured with ``treeattn check --kv-dtype fp8`` (our engine, one CPU rank, the embedded
SmolLM2-135M in fp32, 2,170 tokens of the GPL-3 text; top-1 agreement / mean KL against the
fp32 cache): one fp32 scale per rotated row 0.9525 / 0.0071; one bf16 scale per 32 channels
0.9627 / 0.0074 at the same bytes (d = 64); bf16 KV 0.9963 / 0.00008.

Storage: e4m3 (``float8_e4m3fn``: CUDA sm_89 and newer, and the CPU) or e4m3fnuz (MI300X,
gfx942), plus ``d / 32`` bf16 scales per row: ``d + d / 16`` bytes per head and token against
``2d`` in bf16, 0.531x. Quantizing what the cache holds gives back the same rows and scales,
so a prefill can attend its own keys as stored and store them without drifting.
"""

from __future__ import annotations

import math

import torch

from treeattn_kernels import dequantize, quantize

from .kvdtypes import scale_groups


def fp8_dtype(device) -> torch.dtype:
    """The e4m3 flavour a device stores and loads: fnuz on ROCm (gfx942), fn elsewhere. A CUDA
    GPU older than sm_89 has no fp8 loads in its kernels: refused in one line (upcasting every
    tile would read twice the bytes fp8 is meant to save)."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.version.hip:
            return torch.float8_e4m3fnuz
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"--kv-dtype fp8 needs an fp8-capable GPU (sm_89 and newer, or MI300); this is "
                f"sm_{major}{minor}: use --kv-dtype bfloat16"
            )
    return torch.float8_e4m3fn


def storage(kv_dtype: str, compute: torch.dtype, device, head_dim: int):
    """``(storage dtype, KVQuant or None, name)`` of a ``--kv-dtype``: ``auto`` is the model's
    dtype; a plain dtype is stored as such (attention upcasts or downcasts its rows to the
    model's dtype as it reads them: lossless, the keys were computed in that dtype); ``fp8`` is
    e4m3 with scales (:class:`KVQuant`). ``name`` is what a saved cache records."""
    if kv_dtype in (None, "auto"):
        return compute, None, str(compute).replace("torch.", "")
    if kv_dtype == "fp8":
        q = KVQuant(head_dim, device)
        return q.dtype, q, q.name
    dt = getattr(torch, kv_dtype)
    return dt, None, kv_dtype


def rotation_name(d: int) -> str:
    """What a saved cache records of :func:`rotation` (a loader checks it makes the same one)."""
    return f"hadamard-{d}" if d & (d - 1) == 0 else f"orthogonal-qr-20261123-{d}"


def rotation(d: int, device=None) -> torch.Tensor:
    """An orthogonal ``[d, d]`` fp32 matrix: normalised Hadamard (Sylvester) for a power of two,
    else a random orthogonal matrix from a fixed seed (the same on every rank and run)."""
    if d & (d - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r = h / math.sqrt(d)
    else:
        g = torch.Generator().manual_seed(20261123)
        r, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        r = r.float()
    return r.to(device) if device is not None else r


class KVQuant:
    """Rounding of keys and values to fp8 for one cache: ``quantize`` (rotated, scaled, cast),
    ``restore``, and the rotation of queries and outputs that goes with it. Each token's row of
    a KV head has one bfloat16 scale per ``SCALE_GROUP`` channels (``groups`` of them)."""

    def __init__(self, head_dim: int, device, dtype: torch.dtype | None = None):
        self.dtype = dtype or fp8_dtype(device)
        self.max = torch.finfo(self.dtype).max
        self.head_dim = head_dim
        self.groups = scale_groups(head_dim)
        self.r = rotation(head_dim, device)  # [d, d]
        self.rt = self.r.t().contiguous()
        self.name = {torch.float8_e4m3fn: "fp8_e4m3fn", torch.float8_e4m3fnuz: "fp8_e4m3fnuz"}[self.dtype]
        self.rotation = rotation_name(head_dim)

    def quantize(self, x: torch.Tensor):
        """``x [..., d]`` -> ``(x8 [..., d] fp8, scale [..., groups] bf16)`` of ``x R``: each
        group's largest magnitude lands on the format's largest value (``treeattn_kernels.write_ref``)."""
        return quantize(x, self.r, self.dtype, self.groups)  # (on a GPU: the pool write's own bits)

    def restore(self, x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Stored fp8 rows back in the model's basis, fp32 (a saved cache converted as it loads)."""
        return dequantize(x8.to(self.r.device), scale.to(self.r.device), torch.float32) @ self.rt

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache will hold of ``x``, in ``x``'s basis and dtype (fresh keys and values
        are attended as stored, so every attention of a run sees the same numbers)."""
        return self.restore(*self.quantize(x)).to(x.dtype)

    def rotate(self, q: torch.Tensor) -> torch.Tensor:
        return (q.float() @ self.r).to(q.dtype)

    def unrotate(self, o: torch.Tensor) -> torch.Tensor:
        return (o.float() @ self.rt).to(o.dtype)
