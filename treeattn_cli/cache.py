"""The sharded KV cache: what this rank holds, and where each new token goes (DESIGN.md §4).

Per layer this rank keeps ``k, v [B, H_kv, capacity, d]``; per sequence the global positions
of its tokens ``pos [B, capacity]`` and their number ``length [B]``. Positions and lengths are
shared by all layers (every layer stores the same tokens). Capacity grows geometrically, so an
append costs O(1) amortised, never a copy of the shard per token.

Placement of decode tokens is deterministic and needs no communication: every rank keeps the
token counts of all ranks, ``counts [B, world]``, and a new token of sequence b goes to the rank
holding the fewest tokens of b (ties: the lowest rank), so shard sizes never differ by more
than one token once decoding has started from balanced prefill chunks.
"""

from __future__ import annotations

import torch

_MIN_CAPACITY = 64


class ShardedKVCache:
    """This rank's slice of the KV cache of every layer.

    Life of a decode step: :meth:`begin_step` (placement of the new token of each sequence),
    then per layer :meth:`update` (writes this rank's new K/V, returns the shard to attend
    to), then :meth:`end_step` (lengths advance).
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, *,
                 dtype=torch.float32, device="cpu", rank: int = 0, world: int = 1,
                 capacity: int = 0):
        self.num_layers, self.batch, self.kv_heads, self.head_dim = num_layers, batch, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.rank, self.world = rank, world
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.pos = torch.empty(batch, 0, dtype=torch.int64, device=self.device)
        self.length = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.counts = torch.zeros(batch, world, dtype=torch.int64)  # host: tokens per (seq, rank)
        self._store = None  # [B] bool: this rank stores the current step's token
        self._slot = None  # [B] int64: where
        self.step_positions = None  # [B] global positions of the current decode step's tokens
        self.reserve(capacity)

    # -- capacity -----------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` tokens per sequence (grows geometrically, keeps data)."""
        if capacity <= self.capacity:
            return
        new = max(capacity, 2 * self.capacity, _MIN_CAPACITY)
        shape = (self.batch, self.kv_heads, new, self.head_dim)
        n = self.capacity
        if not self.k:
            self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        else:
            for store in (self.k, self.v):
                for i, t in enumerate(store):
                    grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                    grown[:, :, :n] = t[:, :, :n]
                    store[i] = grown
        pos = torch.full((self.batch, new), -1, dtype=torch.int64, device=self.device)
        pos[:, :n] = self.pos[:, :n]
        self.pos = pos
        self.capacity = new

    @property
    def max_len(self) -> int:
        return int(self.length.max().item()) if self.batch else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # -- prefill ------------------------------------------------------------------------
    def set_counts(self, counts) -> None:
        """Every rank's token count per sequence after prefill: ``counts [B, world]`` (or a
        list of ``world`` ints shared by all sequences)."""
        c = torch.as_tensor(counts, dtype=torch.int64)
        self.counts = (c.expand(self.batch, self.world) if c.dim() == 1 else c).clone()

    def append_chunk(self, layer: int, k, v, positions) -> None:
        """Append a prefill piece of ``C`` tokens to every sequence: ``k, v [B, H_kv, C, d]``,
        ``positions [C]`` or ``[B, C]`` (global). Called once per layer, in layer order; the
        lengths advance after the last layer."""
        C = k.shape[2]
        start = int(self.length[0].item()) if self.batch else 0
        self.reserve(start + C)
        self.k[layer][:, :, start:start + C] = k
        self.v[layer][:, :, start:start + C] = v
        if layer == self.num_layers - 1:
            self.pos[:, start:start + C] = torch.as_tensor(positions, device=self.device).expand(self.batch, C)
            self.length += C

    # -- decode -------------------------------------------------------------------------
    def place(self) -> torch.Tensor:
        """Owner rank of the next token of each sequence: ``[B]`` (fewest tokens, lowest rank
        on ties); updates every rank's view of the counts."""
        owner = torch.argmin(self.counts, dim=1)  # first minimum = lowest rank
        self.counts[torch.arange(self.batch), owner] += 1
        return owner

    def begin_step(self, positions) -> torch.Tensor:
        """Start a decode step whose new tokens have global ``positions [B]``; returns
        ``store [B] bool``, whether this rank keeps each sequence's new token."""
        owner = self.place()
        store = (owner == self.rank).to(self.device)
        self.reserve(self.max_len + 1)
        self._store = store
        self._slot = self.length.clone()
        self.step_positions = torch.as_tensor(positions, dtype=torch.int64, device=self.device).expand(self.batch)
        idx = torch.nonzero(store).flatten()
        if idx.numel():  # positions first: sliding-window masks of this step already need them
            self.pos[idx, self._slot[idx]] = self.step_positions[idx]
        return store

    def update(self, layer: int, k_new, v_new):
        """Write this rank's share of the step's K/V (``k_new, v_new [B, H_kv, 1, d]``) and
        return ``(k, v [B, H_kv, L, d], kv_len [B])``, the shard this step attends to."""
        idx = torch.nonzero(self._store).flatten()
        if idx.numel():
            slots = self._slot[idx]
            self.k[layer][idx, :, slots] = k_new[idx, :, 0].to(self.dtype)
            self.v[layer][idx, :, slots] = v_new[idx, :, 0].to(self.dtype)
        kv_len = self.length + self._store.to(torch.int64)
        L = int(kv_len.max().item()) if self.batch else 0
        return self.k[layer][:, :, :L], self.v[layer][:, :, :L], kv_len

    def end_step(self) -> None:
        """Advance lengths after the last layer of the step."""
        self.length += self._store.to(torch.int64)
        self._store = None

    def view(self, layer: int):
        """``(k, v [B, H_kv, L, d], kv_len [B], pos [B, L])`` of this rank without a new token."""
        L = self.max_len
        return self.k[layer][:, :, :L], self.v[layer][:, :, :L], self.length.clone(), self.pos[:, :L]
