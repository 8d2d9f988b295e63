"""A document's shard on this rank, kept in the rank's block pool (docs/architecture.md §12; issue 35).

:class:`PagedShard` is the face of one sequence's shard that prefill, the cascade and
``kvstore`` use, its tokens in
blocks of a :class:`pool.BlockPool` named by a :class:`pool.BlockTable`: nothing is reserved
beyond the blocks its tokens fill, growth allocates blocks (nothing copied, nothing doubles), and
freeing the document returns its blocks to the pool. Reads gather the table's blocks into a dense
shard (``view``): what the reference and ATen kernels take; the paged split kernel reads the
table itself. A document's tokens are written once (its prefill or a load) and read by many
questions, whose own tokens live elsewhere (a batch's tail).
"""

from __future__ import annotations

import torch

from .graphs import SERIALS
from .paged_tail import fewest_first
from .pool import BlockPool, BlockTable


class PagedShard:
    """One sequence's shard on this rank, in ``pool``'s blocks (see the module)."""

    batch = 1
    static = False

    def __init__(self, pool: BlockPool, *, rank: int, world: int):
        self.pool, self.table = pool, BlockTable(pool)
        self.num_layers, self.kv_heads, self.head_dim = pool.num_layers, pool.kv_heads, pool.head_dim
        self.device, self.quant, self.dtype = pool.device, pool.quant, pool.dtype
        self.rank, self.world = rank, world
        self.serial = next(SERIALS)
        self.counts = torch.zeros(1, world, dtype=torch.int64)  # host: every rank's tokens
        self._slots = torch.zeros(0, dtype=torch.int64)  # flat pool slot of each token, in shard order
        self.n = 0  # tokens that count (a piece being appended counts after its last layer)
        self._refresh()  # _dev: (slots [n], length [1]) on the device, made as the shard changes
        self._pending: torch.Tensor | None = None  # slots of the piece being appended (every layer)
        self._ext: tuple | None = None  # an extension under way: (its tokens this rank keeps, their slots, counts)

    # -- its shape and size ---------------------------------------------------------------
    @property
    def k(self) -> list:
        return self.pool.k

    @property
    def host_length(self) -> torch.Tensor:
        return torch.tensor([self.n], dtype=torch.int64)

    @property
    def max_len(self) -> int:
        return self.n

    def graph_key(self) -> tuple:
        """What a captured step over this shard took from the host: its length and its table's
        (the pool's buffers never move; the table's entries travel as a step's input)."""
        return (self.serial, self.n, len(self.table.blocks))

    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token()

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool.as_stored(x)

    def reserve(self, capacity: int) -> None:
        """Nothing: blocks are taken as tokens arrive."""

    def set_counts(self, counts) -> None:
        c = torch.as_tensor(counts, dtype=torch.int64)
        self.counts = (c.expand(1, self.world) if c.dim() == 1 else c).clone()

    def free(self) -> None:
        """Every block back to the pool (the document leaves memory)."""
        self.table.free()
        self._slots = self._slots[:0]
        self.n = 0
        self.counts = torch.zeros(1, self.world, dtype=torch.int64)
        self._refresh()

    def adopt(self, blocks, n: int, counts) -> None:
        """Become the first ``n`` tokens of ``blocks`` (a cached prefix, already acquired for
        this shard: shared, nothing copied; blocks past ``n`` are released) and every rank's
        ``counts``. A later append to a partial last block another table holds copies it first."""
        self.free()
        self.table = BlockTable(self.pool, blocks, len(blocks) * self.pool.page)
        self.table.truncate(n)
        self._slots = self.table.flat(0, n)
        self.n = n
        self._refresh()
        self.set_counts(counts)

    # -- writing ----------------------------------------------------------------------------
    def append_chunk(self, layer: int, k, v, positions) -> None:
        """Append ``k, v [1, H_kv, C, d]`` at global ``positions [C]`` (once per layer, in layer
        order; the blocks are taken at layer 0, the tokens count after the last layer: until
        then :meth:`view` is the shard before the piece, as prefill's attention needs)."""
        C = k.shape[2]
        if layer == 0:
            self._pending = self.table.slots(C)  # all or nothing: pool.PoolFull
            self._slots = self.table.flat(0, self.table.length)  # a copied last block moves its tokens
            self._refresh()
            self.pool.place(self._pending.to(self.device), torch.as_tensor(positions).reshape(-1))
        self.pool.write(layer, self._pending.to(self.device), k[0].transpose(0, 1), v[0].transpose(0, 1))
        if layer == self.num_layers - 1:
            self.n += C
            self._refresh()

    def begin_fill(self, positions, counts) -> None:
        """Replace the shard by ``positions [n]`` (a loaded cache) and every rank's counts."""
        self.free()
        n = int(positions.shape[-1])
        self._slots = self.table.slots(n)
        self.n = n
        self.pool.place(self._slots.to(self.device), torch.as_tensor(positions).reshape(-1))
        self._refresh()  # (after the positions: it keeps them)
        self.set_counts(counts)

    def fill_layer(self, layer: int, k, v, slots=None, heads: slice = slice(None), scales=None) -> None:
        """``k, v [1, h, m, d]`` into shard slots ``slots [m]`` (default ``0 .. m - 1``) and KV
        heads ``heads``; ``scales``: ``(k_scale, v_scale [1, h, m, G])`` when the rows are this
        pool's fp8 already (copied), else they are stored like fresh keys and values."""
        idx = torch.arange(k.shape[2]) if slots is None else torch.as_tensor(slots)
        flat = self._slots[idx].to(self.device)
        b, o = flat // self.pool.page, flat % self.pool.page
        rows = [(k, self.pool.k, 0), (v, self.pool.v, 1)]
        for x, store, i in rows:
            x = x[0].transpose(0, 1).to(self.device)  # [m, h, d]
            if scales is not None:
                store[layer][b, heads, o] = x
                (self.pool.ks, self.pool.vs)[i][layer][b, heads, o] = scales[i][0].transpose(0, 1).to(self.device)
            elif self.quant is not None:
                x8, s = self.quant.quantize(x)
                store[layer][b, heads, o] = x8
                (self.pool.ks, self.pool.vs)[i][layer][b, heads, o] = s
            else:
                store[layer][b, heads, o] = x.to(self.dtype)

    def append_stored(self, positions, counts, layers) -> None:
        """Append tokens already in the pool's storage form (a batch tail's
        ``PagedTail.row_stored``, copied as they are: fp8 rows keep their scales):
        ``positions [m]`` (global), ``counts [world]`` (every rank's new tokens), ``layers``:
        each layer's ``[k, v, (ks, vs)]`` ``[1, H_kv, m, X]``. Blocks are taken as for a
        prefill piece (a shared partial last block is copied first): raises ``pool.PoolFull``
        when they are not there, before anything changes."""
        m, start = int(len(positions)), self.n
        if m:
            new = self.table.slots(m)
            self._slots = self.table.flat(0, self.table.length)
            self.pool.place(new.to(self.device), torch.as_tensor(positions).reshape(-1))
            for layer, t in enumerate(layers):
                self.fill_layer(
                    layer,
                    t[0],
                    t[1],
                    slots=torch.arange(start, start + m),
                    scales=(t[2], t[3]) if self.quant is not None else None,
                )
            self.n += m
        self.counts[0] += torch.as_tensor(counts, dtype=torch.int64)
        self._refresh()

    # -- a piece every rank computes (shorter than the sequence shards: decode._prefill_replicated)
    def begin_extend(self, rows, positions) -> None:
        """Start appending tokens every rank computes, ``positions [1, T]`` (host, global; -1 a
        padding token, kept nowhere) of this one sequence (``rows`` = ``[0]``): each goes to the
        rank holding the fewest tokens at that point (ties: the lowest), as the tail places
        them (``paged_tail.PagedTail.begin_extend``). This rank takes the blocks for its own now
        (all or nothing: ``pool.PoolFull``), writes them with :meth:`extend` (once per layer),
        and they count at :meth:`end_extend`; until then :meth:`view` is the shard before them."""
        if [int(b) for b in rows] != [0]:
            raise ValueError(f"begin_extend: a document's shard has one sequence, not rows {list(rows)}")
        if self._ext is not None:
            raise RuntimeError("begin_extend: the previous extension was not ended (end_extend)")
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
        mine, counts = self.placement([p >= 0 for p in positions.tolist()])
        new = self.table.slots(len(mine)).to(self.device)
        self._slots = self.table.flat(0, self.table.length)  # a copied last block moves its tokens
        self._refresh()
        self.pool.place(new, positions[mine])
        self._ext = (torch.tensor(mine, dtype=torch.int64, device=self.device), new, counts)

    def placement(self, kept) -> tuple[list[int], torch.Tensor]:
        """Where an extension's tokens go, ``kept [T]`` saying which are tokens (not padding):
        the indices of those this rank keeps, and every rank's counts after them ``[world]``."""
        counts = self.counts[0].clone()
        real = [t for t, token in enumerate(kept) if token]
        return [t for t, owner in zip(real, fewest_first(counts, len(real))) if owner == self.rank], counts

    def extend(self, layer: int, k_new, v_new) -> None:
        """This rank's share of the extension's ``k_new, v_new [1, H_kv, T, d]``, into its blocks."""
        t, slots, _ = self._ext
        if t.numel():
            self.pool.write(layer, slots, k_new[0][:, t].transpose(0, 1), v_new[0][:, t].transpose(0, 1))

    def extension_view(self, layer: int, b: int = 0):
        """``(k, v [1, H_kv, m, d], pos [m])``: the extension's tokens this rank keeps, as stored
        (written by :meth:`extend`, not yet counted)."""
        _, slots, _ = self._ext
        page = self.pool.page
        return (
            self.pool.gather(self.pool.k[layer], slots[None]),
            self.pool.gather(self.pool.v[layer], slots[None]),
            self.pool.pos[slots // page, slots % page],
        )

    def extension_scales(self, layer: int, b: int = 0):
        """The fp8 scales of :meth:`extension_view`'s tokens: ``(k_scale, v_scale [1, H_kv, m, G])``."""
        _, slots, _ = self._ext
        return self.pool.gather(self.pool.ks[layer], slots[None]), self.pool.gather(self.pool.vs[layer], slots[None])

    def end_extend(self) -> None:
        """After the last layer: the extension's tokens count, on every rank's counts."""
        _, slots, counts = self._ext
        self.n += int(slots.numel())
        self.counts[0] = counts
        self._ext = None
        self._refresh()

    def mark(self):
        """A point to come back to (:meth:`rollback`): this rank's tokens and every rank's counts."""
        return self.n, self.counts.clone()

    def rollback(self, mark) -> None:
        """Forget every token added since ``mark``: the blocks past it go back to the pool
        (nothing copied). Every rank rolls back together."""
        n, counts = mark
        self.table.truncate(n)
        self._slots = self._slots[:n]
        self.n = n
        self.counts = counts.clone()
        self._refresh()

    # -- reading ----------------------------------------------------------------------------
    def _refresh(self) -> None:
        """The shard's slots, length, blocks and positions on the device, made as the shard
        changes (a prefill piece, a load, a prefix taken over, freeing): the steps that read it
        copy nothing when its blocks are consecutive (``_blocks``: ``(first, count)``, the pool's
        storage read in place; else their ids, gathered once a read)."""
        page, n = self.pool.page, self.n
        used = self.table.blocks[: -(-n // page)]
        run = bool(used) and used == list(range(used[0], used[0] + len(used)))
        self._blocks = (used[0], len(used)) if run else torch.tensor(used, dtype=torch.int64, device=self.device)
        self._dev = (self._slots[:n].to(self.device), torch.tensor([n], dtype=torch.int64, device=self.device))
        flat = self._dev[0]
        self._pos = self.pool.pos[flat // page, flat % page][None]  # positions are written before they count

    def _gather(self, store: torch.Tensor) -> torch.Tensor:
        """``store [blocks, H_kv, page, X]`` -> this shard's ``[1, H_kv, n, X]`` (in place for
        consecutive blocks: :meth:`pool.BlockPool.dense`)."""
        return self.pool.dense(store, self._blocks, self.n)

    @property
    def pos(self) -> torch.Tensor:
        """``[1, n]`` global positions of the shard's tokens."""
        return self._pos

    def view(self, layer: int):
        """``(k, v [1, H_kv, n, d], kv_len [1], pos [1, n])``: the shard, gathered."""
        return (self._gather(self.pool.k[layer]), self._gather(self.pool.v[layer]), self._dev[1], self.pos)

    def scales(self, layer: int, L: int, rows=None):
        """``(k_scale, v_scale [1, H_kv, L, G])`` of an fp8 pool, else ``(None, None)``."""
        if self.quant is None:
            return None, None
        return self._gather(self.pool.ks[layer])[:, :, :L], self._gather(self.pool.vs[layer])[:, :, :L]

    def layer_tensors(self, layer: int) -> list[torch.Tensor]:
        """``k, v`` (and fp8 ``ks, vs``) of a layer as ``[1, H_kv, n, X]`` (what a save writes)."""
        out = [self._gather(self.pool.k[layer]), self._gather(self.pool.v[layer])]
        if self.quant is not None:
            out += [self._gather(self.pool.ks[layer]), self._gather(self.pool.vs[layer])]
        return out
