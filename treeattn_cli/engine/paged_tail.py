"""A batch's tail in the rank's block pool (docs/architecture.md §11, §12; issue 35 item 1).

:class:`PagedTail` is the tail of ``batch.BatchDecoder``: one sequence per slot, its question's
and its answer's tokens (and drafts under verification), spread over the ranks, whose keys and
values live in blocks of the rank's ``pool.BlockPool``. The pool is the rank's one budget for KV:
a slot takes its blocks when its question is admitted (:meth:`PagedTail.admit`: the most tokens
its question and answer can ever place on this rank, :func:`most_here`, known before anything
runs, so a step never finds the pool full) and gives them back when its answer ends
(:meth:`PagedTail.release`), and a finished answer's memory serves the next document or question
at once. Rejected drafts change lengths only.

**Placement** is deterministic and needs no communication: every rank keeps the token counts of
all ranks, ``counts [slots, world]`` (host), and each new token of a slot goes to the rank
holding the fewest tokens of it, counting its document's (``beside``; ties: the lowest rank,
:func:`fewest_first`), so document and answer together stay balanced. Nothing in a step reads a
device value back to the host. The views are a function of every rank's counts, never of this
rank's alone, so all ranks grow them on the same step (a static step's CUDA graph is captured
again together).

``_flat [slots, capacity + 1]`` (device) names each slot's token slots in the pool (flat slots,
``block * page + offset``); the last column, and every index past a slot's blocks, name the
pool's write-off block, where a fixed-shape step writes what no slot keeps here (tokens other
ranks keep, idle slots). Writes go through it (the tokens' positions too, into the pool's
``pos``). Two ways to read:

* through block tables (the GPU's path, ``attention._cascade``): ``_table [slots,
  ceil(capacity / page)]`` (device) holds each slot's blocks in order, padded with the
  write-off block, and :meth:`PagedTail.step_tables` / :meth:`PagedTail.full_tables` /
  :meth:`PagedTail.rows_tables` give the tables and lengths the paged kernel takes, so a step
  reads each slot's tail where it lies, once, in the same launch for every row;
* gathered (elsewhere): the rows a step attends to copied into the dense ``[R, H_kv, L, X]``
  views the kernels take (a row's keys past its length are masked by its length; every value
  in the pool is finite). ``tests/dense_tail.py`` holds the same numbers in dense storage: the
  reference this class is tested against.

A captured step reads ``_flat`` and ``_table`` in place, so admitting or releasing a slot
changes no graph.
"""

from __future__ import annotations

import torch

from .graphs import SERIALS
from .pool import BlockPool

_MIN_CAPACITY = 64  # tokens per slot the views start with


def fewest_first(counts: torch.Tensor, n: int) -> list[int]:
    """The rank each of ``n`` new tokens of a sequence goes to, each to the rank holding the
    fewest (ties: the lowest) of ``counts [world]`` (host; updated in place as they are placed)."""
    out = []
    for _ in range(n):
        owner = int(torch.argmin(counts))
        counts[owner] += 1
        out.append(owner)
    return out


def most_here(beside, n: int, rank: int) -> int:
    """Tokens rank ``rank`` holds once ``n`` tokens of a sequence are placed, each on the rank
    holding the fewest (ties: the lowest) counting ``beside [world]`` (the document it continues,
    on every rank), as :func:`fewest_first` places them: the most a slot's question and
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


class PagedTail:
    """A batch's tail whose keys and values live in ``pool``'s blocks (see the module).

    Life of a step: :meth:`plan_step` (the host: where each slot's new token goes), then
    :meth:`start_step` (the device's copy of that), then per layer :meth:`update` /
    :meth:`step_tables` (writes this rank's new K/V, returns what the step attends to), then
    :meth:`end_step` (lengths advance).
    Several tokens per slot (a question, verified drafts): :meth:`begin_extend`, :meth:`extend`
    per layer, :meth:`end_extend`. With ``static=True`` the views are capacity-long (fixed shapes,
    for CUDA graphs); the valid lengths come with them."""

    def __init__(self, pool: BlockPool, slots: int, *, rank: int, world: int, capacity: int = 0, static: bool = False):
        self.pool = pool
        self.num_layers, self.batch, self.kv_heads, self.head_dim = pool.num_layers, slots, pool.kv_heads, pool.head_dim
        self.device, self.quant = pool.device, pool.quant
        self.rank, self.world, self.static = rank, world, static
        self.serial = next(SERIALS)
        self.blocks: list[list[int]] = [[] for _ in range(slots)]  # each slot's blocks, in order
        self._flat = torch.zeros(slots, 1, dtype=torch.int64, device=pool.device)
        self._table = torch.zeros(slots, 0, dtype=torch.int32, device=pool.device)
        self.capacity = 0
        self.pos = torch.full((slots, 1), -1, dtype=torch.int64, device=self.device)
        self.length = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.host_length = torch.zeros(slots, dtype=torch.int64)  # the same, on the host
        self.counts = torch.zeros(slots, world, dtype=torch.int64)  # host: tokens per (slot, rank)
        # host: tokens each rank holds of the document a slot continues: placement counts them too
        self.beside = torch.zeros(slots, world, dtype=torch.int64)
        self._rows = torch.arange(slots, device=self.device)
        # per-step buffers, written in place so a captured step reads the same storage
        self.step_positions = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self._store = torch.zeros(slots, dtype=torch.int64, device=self.device)  # 1: kept here
        self._slot = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self._step_slots = torch.zeros(slots, 1, dtype=torch.int64, device=self.device)  # their pool slots
        self._kv_len = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self._view_len = 0
        self._ext_added = torch.zeros(slots, dtype=torch.int64)  # tokens of the extension under way
        # Per slot: the owner rank of each token of its latest extension, in order, while those
        # tokens are still its newest (None once anything else touched the slot: a decode token,
        # a reset). Strictly per row: extending one slot never touches another's, so a slot can
        # be cut back after others were extended.
        self._ext_owners: list[list[int] | None] = [None] * slots
        self.reserve(capacity)

    @property
    def max_len(self) -> int:
        return int(self.host_length.max()) if self.batch else 0

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

    # -- views: capacity ------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Views ``capacity`` tokens wide per slot (growing geometrically): the positions
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
        self._flat = (
            torch.stack([self._row(b, new + 1) for b in range(self.batch)]).to(self.device)
            if self.batch
            else torch.zeros(0, new + 1, dtype=torch.int64, device=self.device)
        )
        nb = self.blocks_for(new)
        self._table = (
            torch.stack([self._table_row(b, nb) for b in range(self.batch)]).to(self.device)
            if self.batch
            else torch.zeros(0, nb, dtype=torch.int32, device=self.device)
        )

    # -- placement: decode steps ------------------------------------------------------------
    def place(self, active=None) -> torch.Tensor:
        """Owner rank of the next token of each sequence: ``[B]`` (fewest tokens, lowest rank
        on ties); updates every rank's view of the counts. ``active [B]`` (host bool): only
        those sequences get a token (the others' counts stay)."""
        owner = torch.argmin(self.counts + self.beside, dim=1)  # first minimum = lowest rank
        add = torch.ones(self.batch, dtype=torch.int64) if active is None else torch.as_tensor(active).to(torch.int64)
        self.counts[torch.arange(self.batch), owner] += add
        return owner

    def plan_step(self, active=None) -> torch.Tensor:
        """Start a decode step, on the host: place each sequence's new token (counts, the
        capacity, what the step views); ``store [B] bool`` (host): this rank keeps it. ``active
        [B]`` (host bool, default all): a sequence that is not active this step (a free slot of
        a batch) keeps its token nowhere (every rank writes it off)."""
        store = self.place(active) == self.rank  # host
        if active is not None:
            store &= torch.as_tensor(active, dtype=torch.bool)
        for b in range(self.batch):  # a new newest token: the latest extension can no longer be cut back
            if self._ext_owners[b] is not None and (active is None or bool(active[b])):
                self._ext_owners[b] = None
        # Grow by the largest shard of any rank (every rank holds the same counts): capacities
        # then change on the same step everywhere, so a static decode step's CUDA graph is
        # recaptured together (a capture runs the step's collectives) and shapes stay equal.
        self.reserve(int(self.counts.max()))
        self._view_len = self.max_len + int(store.any())
        return store

    def start_step(self, store, store_dev, positions_dev) -> None:
        """The device's part of a step's start: ``store`` (host, :meth:`plan_step`'s),
        ``store_dev [B]`` int64 and ``positions_dev [B]`` the same and the step's positions, on
        the device (device work only: nothing waits for it)."""
        self._store.copy_(store_dev, non_blocking=True)
        self.step_positions.copy_(positions_dev, non_blocking=True)
        # where each sequence's K/V goes: its next slot here, or the write-off slot
        torch.where(self._store.bool(), self.length, torch.full_like(self.length, self.capacity), out=self._slot)
        torch.add(self.length, self._store, out=self._kv_len)
        self.pos[self._rows, self._slot] = self.step_positions  # masks of this step need them
        self._store_host = store
        torch.gather(self._flat, 1, self._slot[:, None], out=self._step_slots)  # once, for every layer
        self.pool.pos.view(-1)[self._step_slots[:, 0]] = self.step_positions

    def end_step(self) -> None:
        """Advance lengths after the last layer of the step."""
        self.length += self._store
        self.host_length += self._store_host.to(torch.int64)

    # -- several tokens per slot (a question, verified drafts) ----------------------------------
    def begin_extend(self, rows, positions) -> None:
        """Start appending several tokens to some sequences, every rank computing all of them:
        ``rows`` (sequence indices), ``positions [len(rows), T]`` (host, global; -1 marks a
        padding token, kept nowhere). Each token goes to the rank holding the fewest tokens of
        its sequence at that point (ties: the lowest), like decode tokens, so a sequence's
        tokens spread evenly over the ranks; this rank writes its own with :meth:`extend` (one
        call per layer) and :meth:`view_rows` returns what the step attends to."""
        positions = torch.as_tensor(positions, dtype=torch.int64)
        rows = [int(b) for b in rows]
        if len(set(rows)) != len(rows):
            raise ValueError(f"begin_extend: a sequence appears twice in rows {rows}")
        if bool(self._ext_added.any()):
            raise RuntimeError("begin_extend: the previous extension was not ended (end_extend)")
        b_idx, i_idx, t_idx, slot_idx = [], [], [], []
        for i, b in enumerate(rows):
            held = int(self.host_length[b])
            real = (positions[i] >= 0).nonzero().flatten().tolist()  # (padding: kept nowhere)
            total = self.counts[b] + self.beside[b]
            owners = self._ext_owners[b] = fewest_first(total, len(real))  # this sequence's new tokens' owners
            self.counts[b] = total - self.beside[b]
            for t, owner in zip(real, owners):
                if owner == self.rank:
                    b_idx.append(b)
                    i_idx.append(i)
                    t_idx.append(t)
                    slot_idx.append(held)
                    held += 1
        self.reserve(int(self.counts.max()))  # by the largest shard of any rank: the same everywhere
        dev = self.device
        self._ext = [torch.tensor(x, dtype=torch.int64, device=dev) for x in (b_idx, i_idx, t_idx, slot_idx)]
        self._ext_host = (b_idx, i_idx, t_idx, slot_idx)
        if b_idx:
            self.pos[self._ext[0], self._ext[3]] = positions.to(dev)[self._ext[1], self._ext[2]]
        if b_idx:
            self._place(self._ext[0], self._ext[3])
        self._ext_added = (
            torch.bincount(torch.tensor(b_idx, dtype=torch.int64), minlength=self.batch)
            if b_idx
            else torch.zeros(self.batch, dtype=torch.int64)
        )

    def extend(self, layer: int, k_new, v_new) -> None:
        """This rank's share of the extension's K/V, ``k_new, v_new [len(rows), H_kv, T, d]``
        (the lengths advance at :meth:`end_extend`)."""
        b, i, t, slot = self._ext
        if b.numel():
            self._put(layer, (b, slice(None), slot), k_new[i, :, t], v_new[i, :, t])

    def extended_lengths(self) -> list[int]:
        """Each sequence's tokens here with the ones the extension under way gives it (host)."""
        return (self.host_length + self._ext_added).tolist()

    def extension_slots(self, i: int, T: int) -> list[int]:
        """Where each of the latest extension's ``T`` tokens of its ``i``-th row goes on this
        rank: its slot where this rank keeps it, else the write-off slot (``capacity``): every
        token written, a fixed shape (:meth:`put_rows`, a captured verify)."""
        out = [self.capacity] * T
        for ii, t, slot in zip(*self._ext_host[1:]):
            if ii == i:
                out[t] = slot
        return out

    def put_rows(self, layer: int, slots, k, v) -> None:
        """Write every row's tokens ``k, v [B, H_kv, T, d]`` at ``slots [B·T]`` (device, row after
        row; the write-off slot for tokens kept elsewhere, and for padding)."""
        B, H, T, d = k.shape
        rows = self._rows.repeat_interleave(T)
        self._put(
            layer,
            (rows, slice(None), slots),
            k.transpose(1, 2).reshape(B * T, H, d),
            v.transpose(1, 2).reshape(B * T, H, d),
        )

    def end_extend(self) -> None:
        """After the last layer: the extension's tokens count."""
        self.length += self._ext_added.to(self.device)
        self.host_length += self._ext_added
        self._ext_added = torch.zeros(self.batch, dtype=torch.int64)

    def truncate_extension(self, b: int, keep: int) -> None:
        """Keep only the first ``keep`` tokens the latest extension gave sequence ``b`` (rejected
        drafts go): each rank forgets its own share of the rest, the newest it holds. Only that
        sequence changes. Raises if anything else was added to ``b`` since (its newest tokens
        are no longer the extension's: cutting lengths back would drop the wrong ones)."""
        owners = self._ext_owners[b]
        if owners is None or bool(self._ext_added[b]):
            raise RuntimeError(
                f"truncate_extension: sequence {b} has no ended extension to cut back "
                "(a decode token, a reset or a rollback came after it)"
            )
        if not 0 <= keep <= len(owners):
            raise ValueError(f"truncate_extension: keep={keep} of an extension of {len(owners)} tokens")
        for owner in owners[keep:]:
            self.counts[b, owner] -= 1
            if owner == self.rank:
                self.length[b] -= 1
                self.host_length[b] -= 1
        self._ext_owners[b] = owners[:keep]

    def reset_rows(self, rows, beside=None) -> None:
        """Empty sequences ``rows`` (a batch slot that takes the next question); the others
        keep everything, their extensions' owners included. ``beside``: each row's ``[world]``
        tokens of its document on every rank (placement then balances the two together)."""
        for i, b in enumerate(rows):
            if bool(self._ext_added[b]):
                raise RuntimeError(f"reset_rows: sequence {b} has an extension under way")
            self.beside[b] = 0 if beside is None else torch.as_tensor(beside[i], dtype=torch.int64)
            self.length[b] = 0
            self.host_length[b] = 0
            self.counts[b] = 0
            self._ext_owners[b] = None

    # -- writes: the pool's, through _flat -----------------------------------------------------
    def _place(self, rows, slots) -> None:
        """The positions of tokens ``(rows, slots)`` (set in ``pos``) at their pool slots too."""
        self.pool.pos.view(-1)[self._flat[rows, slots]] = self.pos[rows, slots]

    def _put(self, layer: int, index, k, v) -> None:
        rows, _, slots = index  # (the tail's writes: row and slot indices, every KV head)
        self.pool.write(layer, self._flat[rows, slots], k, v)

    # -- reads through block tables (the paged kernel's) ---------------------------------------
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

    # -- reads gathered into dense views ----------------------------------------------------
    def write_step(self, layer: int, k_new, v_new) -> None:
        """A step's K/V ``[B, H_kv, 1, d]`` at each slot's next token here, or the write-off slot."""
        self.pool.write(layer, self._step_slots[:, 0], k_new[:, :, 0], v_new[:, :, 0])

    def update(self, layer: int, k_new, v_new):
        self.write_step(layer, k_new, v_new)
        flat = self._flat[:, : self.capacity if self.static else self._view_len]
        return self.pool.gather(self.pool.k[layer], flat), self.pool.gather(self.pool.v[layer], flat), self._kv_len

    def full(self, layer: int):
        flat = self._flat[:, : self.capacity]
        return (
            self.pool.gather(self.pool.k[layer], flat),
            self.pool.gather(self.pool.v[layer], flat),
            self.pos[:, : self.capacity],
        )

    def scales(self, layer: int, L: int, rows=None):
        if self.quant is None:
            return None, None
        flat = self._pick(self._flat, rows, L)
        return self.pool.gather(self.pool.ks[layer], flat), self.pool.gather(self.pool.vs[layer], flat)

    def _span(self, b: int, start: int, m: int) -> torch.Tensor:
        return self._flat[b : b + 1, start : start + m]

    def extension_view(self, layer: int, b: int):
        start, m = int(self.host_length[b]), int(self._ext_added[b])
        flat = self._span(b, start, m)
        return (
            self.pool.gather(self.pool.k[layer], flat),
            self.pool.gather(self.pool.v[layer], flat),
            self.pos[b, start : start + m],
        )

    def extension_scales(self, layer: int, b: int):
        start, m = int(self.host_length[b]), int(self._ext_added[b])
        flat = self._span(b, start, m)
        return self.pool.gather(self.pool.ks[layer], flat), self.pool.gather(self.pool.vs[layer], flat)

    def view_rows(self, layer: int, rows, extended: bool = False):
        lens = self._lens(rows, extended)
        L = int(lens.max()) if len(rows) else 0
        flat, pos = self._pick(self._flat, rows, L), self._pick(self.pos, rows, L)
        return (
            self.pool.gather(self.pool.k[layer], flat),
            self.pool.gather(self.pool.v[layer], flat),
            lens.to(self.device),
            pos,
        )

    def row_stored(self, layer: int, b: int) -> list[torch.Tensor]:
        flat = self._span(b, 0, int(self.host_length[b]))
        return [self.pool.gather(store[layer], flat) for store in self._stores()]
