"""A batch's tail in the rank's block pool (docs/architecture.md §12; issue 35 item 1).

:class:`PagedTail` is the tail of ``batch.BatchDecoder`` — one sequence per slot, its question's
and its answer's tokens (and drafts under verification), spread over the ranks and counted as
``cache.ShardedKVCache`` places them: the host bookkeeping, the positions and the lengths are
that class's — whose keys and values live in blocks of the rank's ``pool.BlockPool`` instead of
a dense ``[slots, H_kv, capacity + 1, d]`` store. The pool is then the rank's one budget for KV:
a slot takes its blocks when its question is admitted (:meth:`admit`: the most tokens its
question and answer can ever place on this rank, known before anything runs, so a step never
finds the pool full) and gives them back when its answer ends (:meth:`release`), and a finished
answer's memory serves the next document or question at once. Rejected drafts change lengths
only, as in the dense tail.

``_flat [slots, capacity + 1]`` (device) names each slot's token slots in the pool (flat slots,
``block * page + offset``); the last column, and every index past a slot's blocks, name the
pool's write-off block. Writes go through it (the tokens' positions too, into the pool's
``pos``). Two ways to read:

* through block tables (the GPU's path, ``attention._cascade``): ``_table [slots,
  ceil(capacity / page)]`` (device) holds each slot's blocks in order, padded with the
  write-off block, and :meth:`PagedTail.step_tables` / :meth:`PagedTail.full_tables` /
  :meth:`PagedTail.rows_tables` give the tables and lengths the paged kernel takes, so a step
  reads each slot's tail where it lies, once, in the same launch for every row;
* gathered (elsewhere): the rows a step attends to copied into the dense ``[R, H_kv, L, X]``
  views the kernels take, the same numbers the dense tail gives bit for bit (a row's keys past
  its length are masked by its length; every value in the pool is finite).

A captured step reads ``_flat`` and ``_table`` in place, so admitting or releasing a slot
changes no graph.
"""

from __future__ import annotations

import torch

from .cache import _MIN_CAPACITY, ShardedKVCache
from .pool import BlockPool


def most_here(beside, n: int, rank: int) -> int:
    """Tokens rank ``rank`` holds once ``n`` tokens of a sequence are placed, each on the rank
    holding the fewest (ties: the lowest) counting ``beside [world]`` (the document it continues,
    on every rank), as ``cache.ShardedKVCache`` places them: the most a slot's question and
    answer can ever place here (drafts cut back leave an earlier point of the same order)."""
    base = torch.as_tensor(beside).tolist()  # (host counts)
    lo, hi = min(base), min(base) + n  # the water level: every rank below it is filled up to it
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(max(0, mid - b) for b in base) <= n:
            lo = mid
        else:
            hi = mid - 1
    got = [max(0, lo - b) for b in base]
    left = n - sum(got)  # one more each for the ranks at the level, lowest first
    for r, b in enumerate(base):
        if left and b <= lo:
            got[r] += 1
            left -= 1
    return got[rank]


class PagedTail(ShardedKVCache):
    """A batch's tail whose keys and values live in ``pool``'s blocks (see the module)."""

    def __init__(self, pool: BlockPool, slots: int, *, rank: int, world: int, capacity: int = 0,
                 static: bool = False):
        self.pool = pool
        self.blocks: list[list[int]] = [[] for _ in range(slots)]  # each slot's blocks, in order
        self._flat = torch.zeros(slots, 1, dtype=torch.int64, device=pool.device)
        self._table = torch.zeros(slots, 0, dtype=torch.int32, device=pool.device)
        self.capacity = 0
        super().__init__(pool.num_layers, slots, pool.kv_heads, pool.head_dim,
                         dtype=pool.dtype if pool.quant is None else torch.float32, device=pool.device,
                         rank=rank, world=world, capacity=capacity, static=static, quant=pool.quant)

    # -- blocks ---------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.page)

    def admit(self, b: int, tokens: int) -> None:
        """Give slot ``b`` the blocks for ``tokens`` tokens on this rank (its worst case:
        :func:`most_here`), in place of any it held. Raises ``pool.PoolFull`` (nothing changed)
        when the pool has not got them: the caller asks every rank first."""
        new = self.pool.allocate(self.blocks_for(tokens))
        self.release(b)
        self.blocks[b] = new
        self._map(b)

    def release(self, b: int) -> None:
        """Slot ``b``'s blocks back to the pool (its answer ended); its reads and writes go to
        the write-off slot until it is admitted again."""
        if self.blocks[b]:
            self.pool.release(self.blocks[b])
            self.blocks[b] = []
            self._map(b)

    def release_all(self) -> None:
        for b in range(self.batch):
            self.release(b)

    def held(self) -> int:
        return sum(len(x) for x in self.blocks)

    def _row(self, b: int, width: int) -> torch.Tensor:
        page = self.pool.page
        out = torch.full((width,), self.pool.write_off * page, dtype=torch.int64)
        blocks = torch.tensor(self.blocks[b], dtype=torch.int64)
        n = min(width - 1, len(self.blocks[b]) * page)  # (the last column: always the write-off slot)
        idx = torch.arange(n)
        out[:n] = blocks[idx // page] * page + idx % page
        return out

    def _table_row(self, b: int, width: int) -> torch.Tensor:
        out = torch.full((width,), self.pool.write_off, dtype=torch.int32)
        n = min(width, len(self.blocks[b]))
        out[:n] = torch.tensor(self.blocks[b][:n], dtype=torch.int32)
        return out

    def _map(self, b: int) -> None:
        self._flat[b].copy_(self._row(b, self._flat.shape[1]), non_blocking=True)
        self._table[b].copy_(self._table_row(b, self._table.shape[1]), non_blocking=True)

    # -- storage: the pool's, through _flat ---------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Views ``capacity`` tokens wide per slot (geometric, as the dense tail's): the positions
        grow, ``_flat`` is made again (a captured step keyed by the capacity is captured again);
        blocks come only with :meth:`admit`."""
        if capacity <= self.capacity:
            return
        new = max(capacity, 2 * self.capacity, _MIN_CAPACITY)
        n = self.capacity
        pos = torch.full((self.batch, new + 1), -1, dtype=torch.int64, device=self.device)
        pos[:, :n] = self.pos[:, :n]
        self.pos = pos
        self.capacity = new
        self._flat = torch.stack([self._row(b, new + 1) for b in range(self.batch)]).to(self.device) \
            if self.batch else torch.zeros(0, new + 1, dtype=torch.int64, device=self.device)
        nb = self.blocks_for(new)
        self._table = torch.stack([self._table_row(b, nb) for b in range(self.batch)]).to(self.device) \
            if self.batch else torch.zeros(0, nb, dtype=torch.int32, device=self.device)

    # -- positions: the host bookkeeping's, and the pool's for reads through tables ------------
    def start_step(self, store, store_dev, positions_dev) -> None:
        super().start_step(store, store_dev, positions_dev)
        self._place(self._rows, self._slot)

    def begin_extend(self, rows, positions) -> None:
        super().begin_extend(rows, positions)
        b, _, _, slot = self._ext
        if b.numel():
            self._place(b, slot)

    def _place(self, rows, slots) -> None:
        """The positions of tokens ``(rows, slots)`` (set in ``pos``) at their pool slots too."""
        self.pool.pos.view(-1)[self._flat[rows, slots]] = self.pos[rows, slots]

    def _put(self, layer: int, index, k, v) -> None:
        rows, _, slots = index  # (the tail's writes: row and slot indices, every KV head)
        self.pool.write(layer, self._flat[rows, slots], k, v)

    def _pick(self, t: torch.Tensor, rows, width: int) -> torch.Tensor:
        """The first ``width`` columns of slot-major ``t`` (``_flat``, ``_table``, ``pos``) for
        slots ``rows`` (None: all; a view then)."""
        if rows is None or list(rows) == list(range(self.batch)):
            return t[:, :width]
        return t[torch.as_tensor(list(rows), dtype=torch.int64, device=self.device), :width]

    def _lens(self, rows, extended: bool) -> torch.Tensor:
        """Host lengths of slots ``rows``, with the extension under way's tokens when ``extended``."""
        return self.host_length[rows] + (self._ext_added[rows] if extended else 0)

    def _stores(self):
        return (self.pool.k, self.pool.v) + ((self.pool.ks, self.pool.vs) if self.quant is not None else ())

    # -- reads through block tables (the paged kernel's) ---------------------------------------
    def _tables(self, tokens: int, rows=None) -> torch.Tensor:
        """``[R, ceil(tokens / page)]`` int32: the blocks of slots ``rows`` (None: all) wide enough
        for ``tokens`` tokens (a view of ``_table`` when all rows)."""
        return self._pick(self._table, rows, max(1, self.blocks_for(tokens)))

    def step_tables(self, layer: int, k_new, v_new):
        """:meth:`update` for a read through tables: write this rank's share of the step's K/V and
        return ``(block_tables [B, nb], kv_len [B])`` of what the step attends to (the whole
        capacity when static: a captured step's shapes)."""
        self.write_step(layer, k_new, v_new)
        return self._tables(self.capacity if self.static else self._view_len), self._kv_len

    def full_tables(self) -> torch.Tensor:
        """:meth:`full`'s tokens as ``block_tables [B, ceil(capacity / page)]`` (a fixed-shape
        verify's; its lengths come with it)."""
        return self._tables(self.capacity)

    def rows_tables(self, rows, extended: bool = False):
        """:meth:`view_rows`'s tokens as ``(block_tables [R, nb], kv_len [R])``."""
        lens = self._lens(rows, extended)
        return self._tables(int(lens.max()) if len(rows) else 0, rows), lens.to(self.device)

    # -- the reads of cache.ShardedKVCache, gathered ----------------------------------------
    def write_step(self, layer: int, k_new, v_new) -> None:
        """A step's K/V ``[B, H_kv, 1, d]`` at each slot's next token here, or the write-off slot."""
        self._put(layer, (self._rows, slice(None), self._slot), k_new[:, :, 0], v_new[:, :, 0])

    def update(self, layer: int, k_new, v_new):
        self.write_step(layer, k_new, v_new)
        flat = self._flat[:, :self.capacity if self.static else self._view_len]
        return self.pool.gather(self.pool.k[layer], flat), self.pool.gather(self.pool.v[layer], flat), self._kv_len

    def full(self, layer: int):
        flat = self._flat[:, :self.capacity]
        return (self.pool.gather(self.pool.k[layer], flat), self.pool.gather(self.pool.v[layer], flat),
                self.pos[:, :self.capacity])

    def scales(self, layer: int, L: int, rows=None):
        if self.quant is None:
            return None, None
        flat = self._pick(self._flat, rows, L)
        return self.pool.gather(self.pool.ks[layer], flat), self.pool.gather(self.pool.vs[layer], flat)

    def _span(self, b: int, start: int, m: int) -> torch.Tensor:
        return self._flat[b:b + 1, start:start + m]

    def extension_view(self, layer: int, b: int):
        start, m = int(self.host_length[b]), int(self._ext_added[b])
        flat = self._span(b, start, m)
        return (self.pool.gather(self.pool.k[layer], flat), self.pool.gather(self.pool.v[layer], flat),
                self.pos[b, start:start + m])

    def extension_scales(self, layer: int, b: int):
        start, m = int(self.host_length[b]), int(self._ext_added[b])
        flat = self._span(b, start, m)
        return self.pool.gather(self.pool.ks[layer], flat), self.pool.gather(self.pool.vs[layer], flat)

    def view_rows(self, layer: int, rows, extended: bool = False):
        lens = self._lens(rows, extended)
        L = int(lens.max()) if len(rows) else 0
        flat, pos = self._pick(self._flat, rows, L), self._pick(self.pos, rows, L)
        return (self.pool.gather(self.pool.k[layer], flat), self.pool.gather(self.pool.v[layer], flat),
                lens.to(self.device), pos)

    def row_stored(self, layer: int, b: int) -> list[torch.Tensor]:
        flat = self._span(b, 0, int(self.host_length[b]))
        return [self.pool.gather(store[layer], flat) for store in self._stores()]
