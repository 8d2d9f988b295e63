"""The host-memory tier behind a rank's block pool (issue 52; docs/architecture.md §12).

A document that leaves the pool (:meth:`documents.Documents._evict`) leaves a copy of this
rank's shard here: its rows exactly as the pool stored them (fp8 rows with their scales), their
global positions and every rank's token counts, in host memory (pinned on a GPU, so a restore is
one DMA per tensor). Coming back (:meth:`documents.Documents.get`) the copy is written into fresh
blocks, not prefilled: the same bytes at the same positions on the same ranks, so every answer
over it is the one it gave before.

The tier is bounded by ``budget`` bytes per rank, counted from the documents' token counts (the
same on every rank, as :meth:`documents.Documents.nbytes` counts: every rank keeps and drops the
same documents). The least recently used copy leaves first; one larger than the whole budget is
not kept. A copy that leaves is gone from memory: the cache directory, when there is one, holds
it already (an eviction saves there first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

# Bytes per rank the tier may hold when ``--host-memory`` is not given: a quarter of the memory
# available at start over the ranks that share it, at most this much (a CPU's pool lives in the
# same memory, so it gets less).
DEFAULT_CAP = {"cpu": 512 << 20, "cuda": 64 << 30}


def default_budget(device: torch.device, ranks: int) -> int:
    """``--host-memory`` when not given: a quarter of the host's available memory over
    ``ranks``, capped by :data:`DEFAULT_CAP` of the device."""
    from .pool_sizing import free_memory

    return min(DEFAULT_CAP.get(device.type, DEFAULT_CAP["cuda"]), free_memory(torch.device("cpu"), ranks) // 4)


@dataclass
class HostCopy:
    """One document's shard of this rank, in host memory."""

    ids: list
    pos: torch.Tensor  # [n] global positions of this rank's tokens, in shard order
    counts: torch.Tensor  # [world] every rank's tokens
    layers: list  # per layer [k, v (, ks, vs)] [1, H_kv, n, X], as the pool stores them
    charge: int  # bytes the budget counts (the same on every rank)


def copy_out(shard, ids, charge: int) -> HostCopy:
    """This rank's ``shard`` (a ``paged_shard.PagedShard``) copied to host memory: each layer's
    rows as stored (pinned when the pool is on a GPU; the copies queued, then one wait)."""
    pin = shard.device.type == "cuda"
    layers = []
    for layer in range(shard.num_layers):
        out = []
        for t in shard.layer_tensors(layer):  # [1, H_kv, n, X] on the device
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            h.copy_(t, non_blocking=pin)
            out.append(h)
        layers.append(out)
    if pin:
        torch.cuda.synchronize(shard.device)
    return HostCopy(list(ids), shard.pos[0].to("cpu").clone(), shard.counts[0].clone(), layers, charge)


def copy_in(copy: HostCopy, shard) -> None:
    """``copy`` into ``shard`` (empty, in a pool with room for it: :meth:`documents.Documents.room`
    agreed): its positions, every rank's counts, each layer's rows as they were stored."""
    shard.begin_fill(copy.pos, copy.counts)
    raw = shard.quant is not None
    for layer, t in enumerate(copy.layers):
        shard.fill_layer(layer, t[0], t[1], scales=(t[2], t[3]) if raw else None)


class HostTier:
    """This rank's copies by document key, least recently used first, within ``budget`` bytes."""

    def __init__(self, budget: int):
        self.budget = max(0, int(budget))
        self.copies: OrderedDict[str, HostCopy] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self.copies

    def charged(self) -> int:
        return sum(c.charge for c in self.copies.values())

    def fits(self, charge: int) -> bool:
        return 0 < charge <= self.budget

    def put(self, key: str, shard, ids, charge: int) -> bool:
        """Keep a copy of ``shard`` (holding ``ids``) under ``key``, ``charge`` bytes; False
        (nothing kept) when it alone exceeds the budget."""
        self.copies.pop(key, None)
        if not self.fits(charge):
            return False
        self._room(charge)
        self.copies[key] = copy_out(shard, ids, charge)
        return True

    def add(self, key: str, copy: HostCopy) -> None:
        """``copy`` back under ``key`` (taken for a restore that did not happen), most recently used."""
        self.copies.pop(key, None)
        if self.fits(copy.charge):
            self._room(copy.charge)
            self.copies[key] = copy

    def _room(self, charge: int) -> None:
        """The least recently used copies leave until ``charge`` more bytes fit."""
        while self.copies and self.charged() + charge > self.budget:
            self.copies.popitem(last=False)

    def take(self, key: str) -> HostCopy | None:
        """The copy of ``key``, out of the tier (its document is going back to the pool, or
        leaves memory altogether)."""
        return self.copies.pop(key, None)
