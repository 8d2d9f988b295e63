"""The host-memory tier behind a rank's block pool (issue 52; docs/architecture.md §12).

A document that leaves the pool (:meth:`documents.Documents._evict`) leaves a copy of this
rank's shard here: its rows exactly as the pool stored them (fp8 rows with their scales), their
global positions and every rank's token counts, in host memory (pinned on a GPU, so a restore is
one DMA per tensor). Coming back (:meth:`documents.Documents.get`) the copy is written into fresh
blocks, not prefilled: the same bytes at the same positions on the same ranks, so every answer
over it is the one it gave before. It is written a few layers per round of the step loop
(:data:`RESTORE_BYTES_PER_ROUND`), so answers under way keep stepping while it comes back.

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
    from ..memory import free_memory

    return min(DEFAULT_CAP.get(device.type, DEFAULT_CAP["cuda"]), free_memory(torch.device("cpu"), ranks) // 4)


@dataclass
class HostCopy:
    """One document's shard of this rank, in host memory."""

    ids: list
    pos: torch.Tensor  # [n] global positions of this rank's tokens, in shard order
    counts: torch.Tensor  # [world] every rank's tokens
    layers: list  # per layer [k, v (, ks, vs)] [1, H_kv, n, X], as the pool stores them
    charge: int  # bytes the budget counts (the same on every rank)
    digests: list | None = None  # its document's (Document.digests): kept across the host tier


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


# Bytes per rank a restore copies per round of the step loop (``batch.BatchDecoder.loop``): a
# document coming back from host memory is copied a few layers at a time, one part per round, so
# the answers under way keep stepping meanwhile instead of waiting for the whole shard (~3 ms of
# an H100's PCIe 5 link per part; ~0.1 s of a CPU's memory).
RESTORE_BYTES_PER_ROUND = 128 << 20


def layers_per_round(copy: HostCopy, budget: int | None = None) -> int:
    """How many of ``copy``'s layers one round copies: as many as ``budget`` bytes hold, at least
    one. Counted from ``copy.charge`` (the same on every rank), so every rank copies the same
    layers in the same round."""
    per_layer = max(1, copy.charge // max(1, len(copy.layers)))
    return max(1, (RESTORE_BYTES_PER_ROUND if budget is None else budget) // per_layer)


def copy_in(copy: HostCopy, shard, start: int = 0, count: int | None = None) -> int:
    """``copy`` into ``shard`` (in a pool with room for it: :meth:`documents.Documents.room`
    agreed), layers ``start .. start + count - 1`` (default: all): at ``start == 0`` its
    positions and every rank's counts first (the shard emptied), then each layer's rows as they
    were stored (from pinned memory on a GPU: queued, the host does not wait). Returns the next
    layer to copy (``len(copy.layers)``: done)."""
    if start == 0:
        shard.begin_fill(copy.pos, copy.counts)
    raw = shard.quant is not None
    end = len(copy.layers) if count is None else min(len(copy.layers), start + count)
    for layer in range(start, end):
        t = copy.layers[layer]
        shard.fill_layer(layer, t[0], t[1], scales=(t[2], t[3]) if raw else None)
    return end


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

    def put(self, key: str, shard, ids, charge: int, digests: list | None = None) -> bool:
        """Keep a copy of ``shard`` (holding ``ids``; its document's ``digests``) under ``key``,
        ``charge`` bytes; False (nothing kept) when it alone exceeds the budget."""
        self.copies.pop(key, None)
        if not self.fits(charge):
            return False
        self._room(charge)
        self.copies[key] = copy_out(shard, ids, charge)
        self.copies[key].digests = digests
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
