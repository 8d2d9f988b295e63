"""Projections that read one input as one matrix multiply (issue 51): a layer's query, key and
value projections, and its MLP's gate and up, their weights concatenated at load. A decode step
then reads the same bytes in 2 GEMVs where it took 5 (on a GPU, 3 fewer launches a layer, and
the narrow key and value GEMVs no longer run apart at a fraction of the bandwidth).

Transformers' attention and MLP keep their forwards: each of ``q_proj``, ``k_proj`` and
``v_proj`` (``gate_proj``, ``up_proj``) becomes a :class:`Part`, the columns of the fused
projection (``treeattn_qkv``, ``treeattn_gate_up``), whose product is computed once for the
parts that follow on the same input. A projection is fused where that is exact: on a CPU the
fused product's columns are the separate products' bits (MKL's strict mode fixes each element's
sum whatever the matrix's width; checked here on random rows, else the projections stay apart);
on a GPU within its dtype's rounding (cuBLAS picks its kernel by the shape: a fused product is
rounded as a GEMM of its own width). Not under tensor parallelism (the weights are shards).
"""

from __future__ import annotations

import torch
from torch import nn

GROUPS = {"treeattn_qkv": ("q_proj", "k_proj", "v_proj"), "treeattn_gate_up": ("gate_proj", "up_proj")}


class _Product:
    """The fused projection of a group, its last input and its product (not a module: the parts
    share it without registering it again)."""

    def __init__(self, linear: nn.Linear, widths: list[int]):
        self.linear = linear
        self.bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
        self.x = self.y = None


class Part(nn.Module):
    """Columns ``[lo, hi)`` of a fused projection: ``x -> fused(x)[..., lo:hi]`` (a view). The
    first part called on an input computes the product; the last lets go of it."""

    def __init__(self, product: _Product, i: int):
        super().__init__()
        self._product = [product]  # (a list: the fused linear stays its parent's child alone)
        self.i = i
        self.in_features = product.linear.in_features
        self.out_features = product.bounds[i + 1] - product.bounds[i]

    def forward(self, x):
        p = self._product[0]
        if p.x is not x:
            p.x, p.y = x, p.linear(x)
        y = p.y[..., p.bounds[self.i] : p.bounds[self.i + 1]]
        if self.i == len(p.bounds) - 2:
            p.x = p.y = None
        return y


def _plain(t) -> bool:
    """A plain tensor (not a tensor-parallel DTensor's shard)."""
    return isinstance(t, torch.Tensor) and not hasattr(t, "to_local")


def _fusable(parts) -> bool:
    if not all(type(p) is nn.Linear and _plain(p.weight) for p in parts):  # (not a quantized subclass)
        return False
    w = parts[0].weight
    biased = {p.bias is not None for p in parts}
    same = all(
        p.weight.shape[1] == w.shape[1] and p.weight.dtype == w.dtype and p.weight.device == w.device for p in parts
    )
    return same and len(biased) == 1


def _concat(parts) -> nn.Linear:
    w = parts[0].weight
    out = nn.Linear(w.shape[1], sum(p.weight.shape[0] for p in parts), bias=parts[0].bias is not None, device="meta")
    out.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
    if parts[0].bias is not None:
        out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return out


def exact(parts, fused: nn.Linear, seed: int = 0) -> bool:
    """Whether ``fused``'s columns give each of ``parts``' products on random rows (1, 3, 8 of
    them): bit for bit on a CPU, within the dtype's rounding on a GPU."""
    w = fused.weight
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + p.weight.shape[0])
    with torch.inference_mode():
        for rows in (1, 3, 8):
            x = torch.randn(rows, w.shape[1], generator=g).to(w.device, w.dtype)
            y = fused(x)
            for i, p in enumerate(parts):
                want, got = p(x), y[:, bounds[i] : bounds[i + 1]]
                if w.device.type == "cpu":
                    if not torch.equal(got, want):
                        return False
                else:
                    tol = 1e-5 if w.dtype == torch.float32 else 2e-2
                    if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max())):
                        return False
    return True


def install(model, only=None) -> dict:
    """Fuse every group of :data:`GROUPS` in ``model``'s modules where :func:`exact` holds
    (``only``: the modules to look in, default all); returns how many of each."""
    done = dict.fromkeys(GROUPS, 0)
    for m in list(only if only is not None else model.modules()):
        for name, group in GROUPS.items():
            parts = [getattr(m, n, None) for n in group]
            if hasattr(m, name) or not _fusable(parts):
                continue
            try:
                fused = _concat(parts)
                same = exact(parts, fused)
            except Exception:  # noqa: BLE001 - weights that do not concatenate or multiply so: left apart
                same = False
            if not same:
                continue
            setattr(m, name, fused)
            product = _Product(fused, [p.weight.shape[0] for p in parts])
            for i, n in enumerate(group):
                setattr(m, n, Part(product, i))
            done[name] += 1
    return done
