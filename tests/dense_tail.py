"""The reference of a batch's tail (``paged_tail.PagedTail``): the same placement and the same
numbers, in dense storage ``[slots, H_kv, capacity + 1, d]`` per layer instead of the block pool
(``tests/engine/test_paged_tail.py`` compares the two through every operation a batch makes). Once the
engine's own cache (issue 50 moved every token's KV into the pool); kept here as the oracle.

Per layer: ``k, v [B, H_kv, capacity + 1, d]`` (the extra slot is a write-off target for
sequences whose token goes elsewhere, so every step writes the same shapes); per sequence the
global positions of its tokens ``pos [B, capacity + 1]`` and their number ``length [B]`` on the
device, mirrored on the host. Placement: a new token of sequence b goes to the rank holding the
fewest tokens of b (its document's counted too: ``beside``; ties: the lowest rank).
"""

from __future__ import annotations

import itertools

import torch

SERIALS = itertools.count(1)  # each cache object's own number (a CUDA graph's key: ids are reused)

_MIN_CAPACITY = 64
# Past this many bytes a cache grows by a quarter, not double: a GPU's static cache sized for a
# long document would otherwise double at the first question and halve the longest document
# that fits (review R13); a growth copies the cache and recaptures the step's graph, rarely.
GROW_GENTLY_BYTES = 1 << 30


def fewest_first(counts: torch.Tensor, n: int) -> list[int]:
    """The rank each of ``n`` new tokens of a sequence goes to, each to the rank holding the
    fewest (ties: the lowest) of ``counts [world]`` (host; updated in place as they are placed)."""
    out = []
    for _ in range(n):
        owner = int(torch.argmin(counts))
        counts[owner] += 1
        out.append(owner)
    return out


class DenseTail:
    """This rank's slice of the KV cache of every layer.

    Life of a decode step: :meth:`begin_step` (placement of the new token of each sequence),
    then per layer :meth:`update` (writes this rank's new K/V, returns the shard to attend
    to), then :meth:`end_step` (lengths advance). With ``static=True`` :meth:`update` returns
    capacity-long views (fixed shapes, for CUDA graphs); the valid length is ``kv_len``.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype=torch.float32,
        device="cpu",
        rank: int = 0,
        world: int = 1,
        capacity: int = 0,
        static: bool = False,
        quant=None,
    ):
        self.num_layers, self.batch, self.kv_heads, self.head_dim = num_layers, batch, kv_heads, head_dim
        self.device = torch.device(device)
        self.quant = quant  # kvquant.KVQuant: keys and values stored as fp8 with per-token scales, rotated
        self.dtype = quant.dtype if quant is not None else dtype
        self.rank, self.world, self.static = rank, world, static
        self.serial = next(SERIALS)
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ks: list[torch.Tensor] = []  # fp8: the scales of each (sequence, KV head, token) row, bf16
        self.vs: list[torch.Tensor] = []
        self.pos = torch.full((batch, 1), -1, dtype=torch.int64, device=self.device)
        self.length = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.host_length = torch.zeros(batch, dtype=torch.int64)  # the same, on the host
        self.counts = torch.zeros(batch, world, dtype=torch.int64)  # host: tokens per (seq, rank)
        # host: tokens each rank holds of what a sequence continues elsewhere (a batch slot's
        # document): placement counts them too, so document and answer together stay balanced
        self.beside = torch.zeros(batch, world, dtype=torch.int64)
        self._rows = torch.arange(batch, device=self.device)
        # per-step buffers, written in place so a captured step reads the same storage
        self.step_positions = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self._store = torch.zeros(batch, dtype=torch.int64, device=self.device)  # 1: kept here
        self._slot = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self._kv_len = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self._view_len = 0
        self._ext_added = torch.zeros(batch, dtype=torch.int64)  # tokens of the extension under way
        # Per sequence: the owner rank of each token of its latest extension, in order, while
        # those tokens are still its newest (None once anything else touched the sequence: a
        # decode token, a reset, a rollback). Strictly per row: extending one sequence never
        # touches another's, so a slot can be cut back after others were extended.
        self._ext_owners: list[list[int] | None] = [None] * batch
        self.reserve(capacity)

    # -- capacity -----------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` tokens per sequence (grows geometrically, keeps data)."""
        if capacity <= self.capacity:
            return
        grown = 2 * self.capacity if self.nbytes() < GROW_GENTLY_BYTES else self.capacity + self.capacity // 4
        new = max(capacity, grown, _MIN_CAPACITY)
        n = self.capacity
        stores = [(self.k, self.dtype, self.head_dim), (self.v, self.dtype, self.head_dim)]
        if self.quant is not None:  # fp8: each row's scales, [B, H_kv, capacity + 1, G] bf16
            stores += [(self.ks, torch.bfloat16, self.quant.groups), (self.vs, torch.bfloat16, self.quant.groups)]
        for store, dtype, d in stores:
            shape = (self.batch, self.kv_heads, new + 1, d)  # + the write-off slot
            if not store:
                store.extend(torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers))
                continue
            for i, t in enumerate(store):
                grown = torch.zeros(shape, dtype=dtype, device=self.device)
                grown[:, :, :n] = t[:, :, :n]
                store[i] = grown
        pos = torch.full((self.batch, new + 1), -1, dtype=torch.int64, device=self.device)
        pos[:, :n] = self.pos[:, :n]
        self.pos = pos
        self.capacity = new

    @property
    def max_len(self) -> int:
        return int(self.host_length.max()) if self.batch else 0

    def graph_key(self) -> tuple:
        """What a captured step reading this cache as a document (:meth:`view`) took from the
        host: which buffers (a growth makes new ones) and how long its view is. (A cache a step
        writes, :meth:`update`, is static: its serial and capacity say it all.)"""
        return (self.serial, self.capacity, self.max_len)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.ks + self.vs)

    def bytes_per_token(self) -> int:
        """Bytes one token takes in this rank's cache, every layer (fp8: its scales included)."""
        per = self.head_dim * torch.empty(0, dtype=self.dtype).element_size()
        if self.quant is not None:
            per += 2 * self.quant.groups  # bf16 scales
        return self.num_layers * 2 * self.kv_heads * per

    def _put(self, layer: int, index, k, v) -> None:
        """Write keys and values ``k, v [..., d]`` at ``index`` (over the first three dims) of a
        layer: cast to the cache's dtype, or rounded to fp8 with their scales."""
        if self.quant is None:
            self.k[layer][index] = k.to(self.dtype)
            self.v[layer][index] = v.to(self.dtype)
            return
        for x, store, scales in ((k, self.k, self.ks), (v, self.v, self.vs)):
            x8, scale = self.quant.quantize(x.to(self.device))
            store[layer][index] = x8
            scales[layer][index] = scale

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """Fresh keys or values ``x`` as this cache will hold them, in ``x``'s dtype: a prefill
        segment attends its own tokens as stored, so every attention of a run sees the same
        numbers whichever route it takes."""
        if self.quant is not None:
            return self.quant.roundtrip(x)
        if self.dtype != x.dtype:
            return x.to(self.dtype).to(x.dtype)
        return x

    def scales(self, layer: int, L: int, rows=None):
        """``(k_scale, v_scale [B, H_kv, L, G])`` of an fp8 cache (``rows``: those sequences), else
        ``(None, None)``."""
        if self.quant is None:
            return None, None
        if rows is None or list(rows) == list(range(self.batch)):
            return self.ks[layer][:, :, :L], self.vs[layer][:, :, :L]
        idx = torch.as_tensor(list(rows), dtype=torch.int64, device=self.device)
        return self.ks[layer][idx, :, :L], self.vs[layer][idx, :, :L]

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
        if layer == 0 and self.batch > 1 and bool((self.host_length != self.host_length[0]).any()):
            raise ValueError(
                "append_chunk appends to every sequence at once: their lengths must be equal "
                f"(they are {self.host_length.tolist()}); extend sequences of their own with begin_extend"
            )
        start = self.max_len
        self.reserve(start + C)
        self._put(layer, (slice(None), slice(None), slice(start, start + C)), k, v)
        if layer == self.num_layers - 1:
            self.pos[:, start : start + C] = torch.as_tensor(positions, device=self.device).expand(self.batch, C)
            self.length += C
            self.host_length += C
            self._ext_owners = [None] * self.batch

    # -- decode -------------------------------------------------------------------------
    def place(self, active=None) -> torch.Tensor:
        """Owner rank of the next token of each sequence: ``[B]`` (fewest tokens, lowest rank
        on ties); updates every rank's view of the counts. ``active [B]`` (host bool): only
        those sequences get a token (the others' counts stay)."""
        owner = torch.argmin(self.counts + self.beside, dim=1)  # first minimum = lowest rank
        add = torch.ones(self.batch, dtype=torch.int64) if active is None else torch.as_tensor(active).to(torch.int64)
        self.counts[torch.arange(self.batch), owner] += add
        return owner

    def begin_step(self, positions, active=None, staged=None) -> torch.Tensor:
        """Start a decode step whose new tokens have global ``positions [B]``; returns
        ``store [B] bool`` (host), whether this rank keeps each sequence's new token.
        ``active [B]`` (host bool, default all): a sequence that is not active this step (a
        free slot of a batch) keeps its token nowhere (every rank writes it off). ``staged``:
        the step's ``(store, positions)`` already on the device, as :meth:`plan_step` returned
        and ``host.Staging`` sent them (the step's one copy); else they are copied here."""
        store = self.plan_step(active)
        if staged is None:
            staged = (
                store.to(torch.int64).to(self.device, non_blocking=True),
                torch.as_tensor(positions, dtype=torch.int64).expand(self.batch).to(self.device, non_blocking=True),
            )
        self.start_step(store, *staged)
        return store

    def plan_step(self, active=None) -> torch.Tensor:
        """The host's part of :meth:`begin_step`: place each sequence's new token (counts, the
        capacity, what the step views); ``store [B] bool`` (host): this rank keeps it."""
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
        """The device's part of :meth:`begin_step`: ``store`` (host, :meth:`plan_step`'s),
        ``store_dev [B]`` int64 and ``positions_dev [B]`` the same and the step's positions, on
        the device (device work only: nothing waits for it)."""
        self._store.copy_(store_dev, non_blocking=True)
        self.step_positions.copy_(positions_dev, non_blocking=True)
        # where each sequence's K/V goes: its next slot here, or the write-off slot
        torch.where(self._store.bool(), self.length, torch.full_like(self.length, self.capacity), out=self._slot)
        torch.add(self.length, self._store, out=self._kv_len)
        self.pos[self._rows, self._slot] = self.step_positions  # masks of this step need them
        self._store_host = store

    def update(self, layer: int, k_new, v_new):
        """Write this rank's share of the step's K/V (``k_new, v_new [B, H_kv, 1, d]``) and
        return ``(k, v [B, H_kv, L, d], kv_len [B])``, the shard this step attends to."""
        self._put(layer, (self._rows, slice(None), self._slot), k_new[:, :, 0], v_new[:, :, 0])
        L = self.capacity if self.static else self._view_len
        return self.k[layer][:, :, :L], self.v[layer][:, :, :L], self._kv_len

    def full(self, layer: int):
        """``(k, v [B, H_kv, capacity, d], pos [B, capacity])``: every sequence's whole view (a
        fixed-shape verify's; lengths mask it)."""
        L = self.capacity
        return self.k[layer][:, :, :L], self.v[layer][:, :, :L], self.pos[:, :L]

    def shard_lens(self) -> list[int]:
        """Every rank's longest sequence this step (host bookkeeping: no communication)."""
        return self.counts.max(0).values.tolist()

    def end_step(self) -> None:
        """Advance lengths after the last layer of the step."""
        self.length += self._store
        self.host_length += self._store_host.to(torch.int64)

    # -- several tokens per sequence (a batch's questions, verified drafts) -----------------
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

    def extension_view(self, layer: int, b: int):
        """``(k, v [1, H_kv, m, d], pos [m])``: the tokens of the extension under way that this
        rank keeps for sequence ``b`` (written by :meth:`extend`, not yet counted)."""
        start, m = int(self.host_length[b]), int(self._ext_added[b])
        return (
            self.k[layer][b : b + 1, :, start : start + m],
            self.v[layer][b : b + 1, :, start : start + m],
            self.pos[b, start : start + m],
        )

    def extension_scales(self, layer: int, b: int):
        """The fp8 scales of :meth:`extension_view`'s tokens: ``(k_scale, v_scale [1, H_kv, m, G])``."""
        start, m = int(self.host_length[b]), int(self._ext_added[b])
        return self.ks[layer][b : b + 1, :, start : start + m], self.vs[layer][b : b + 1, :, start : start + m]

    def view_rows(self, layer: int, rows, extended: bool = False):
        """``(k, v [R, H_kv, L, d], kv_len [R], pos [R, L])`` of sequences ``rows``, including
        the current extension's tokens (written but not yet counted) when ``extended``."""
        lens = self.host_length[rows] + (self._ext_added[rows] if extended else 0)
        L = int(lens.max()) if len(rows) else 0
        if list(rows) == list(range(self.batch)):
            k, v, pos = self.k[layer][:, :, :L], self.v[layer][:, :, :L], self.pos[:, :L]
        else:
            idx = torch.as_tensor(list(rows), dtype=torch.int64, device=self.device)
            k, v, pos = self.k[layer][idx, :, :L], self.v[layer][idx, :, :L], self.pos[idx, :L]
        return k, v, lens.to(self.device), pos

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

    def row_stored(self, layer: int, b: int) -> list[torch.Tensor]:
        """The tokens this rank keeps of sequence ``b``, as stored: ``k, v`` (and fp8 ``ks, vs``)
        ``[1, H_kv, m, X]`` (a kept answer folded into its document: ``append_stored``)."""
        m = int(self.host_length[b])
        return [t[layer][b : b + 1, :, :m] for t in (self.k, self.v, self.ks, self.vs) if t]

    def append_stored(self, positions, counts, layers) -> None:
        """Append tokens already in this cache's storage form (another cache's
        :meth:`row_stored`, copied as they are: fp8 rows keep their scales) to a batch-1 cache:
        ``positions [m]`` (global), ``counts [world]`` (every rank's new tokens), ``layers``:
        each layer's ``[k, v, (ks, vs)]`` ``[1, H_kv, m, X]``."""
        m, n = int(len(positions)), int(self.host_length[0])
        self.counts[0] += torch.as_tensor(counts, dtype=torch.int64)
        self.reserve(max(n + m, int(self.counts.max())))
        for layer, t in enumerate(layers):
            for x, store in zip(t, (self.k, self.v, self.ks, self.vs)):
                store[layer][:, :, n : n + m] = x
        self.pos[0, n : n + m] = torch.as_tensor(positions, device=self.device)
        self.length += m
        self.host_length += m
        self._ext_owners = [None] * self.batch

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

    # -- marks, and whole shards (saved caches) ---------------------------------------
    def mark(self):
        """A point to come back to: the lengths and counts now (host and device copies)."""
        return self.length.clone(), self.host_length.clone(), self.counts.clone()

    def rollback(self, mark) -> None:
        """Forget every token added since ``mark`` (nothing is copied: lengths move back and
        later tokens overwrite the slots). Every rank rolls back together."""
        length, host_length, counts = mark
        self.length.copy_(length)  # in place: a captured decode step reads this storage
        self.host_length.copy_(host_length)
        self.counts = counts.clone()
        self._ext_owners = [None] * self.batch

    def begin_fill(self, positions, counts) -> None:
        """Replace this rank's shard by one with global ``positions [n]`` (a loaded cache) and
        every rank's token counts ``[world]``; the layers follow with :meth:`fill_layer`, one at
        a time (a load holds one layer on the host, never the shard)."""
        n = int(positions.shape[-1])
        self.reserve(max(max(counts), n))  # like prefill: by the largest shard of any rank
        self.pos[:, :n] = torch.as_tensor(positions, device=self.device).expand(self.batch, n)
        self.length.fill_(n)
        self.host_length.fill_(n)
        self.set_counts(counts)
        self._ext_owners = [None] * self.batch

    def fill_layer(self, layer: int, k, v, slots=None, heads: slice = slice(None), scales=None) -> None:
        """Part of one layer of a :meth:`begin_fill`: ``k, v [B, h, m, d]`` into token slots
        ``slots [m]`` (default ``0 .. m - 1``) and KV heads ``heads`` of this rank's shard.
        ``scales``: ``(k_scale, v_scale [B, h, m])`` when ``k, v`` are already this fp8 cache's
        stored rows (``[B, h, m, G]``, copied as they are); else they are stored like fresh keys and values."""
        if slots is None:
            slots = slice(0, k.shape[2])
        index = (slice(None), heads, slots)
        if scales is None:
            self._put(layer, index, k, v)
            return
        for x, store in ((k, self.k), (v, self.v), (scales[0], self.ks), (scales[1], self.vs)):
            store[layer][index] = x.to(store[layer].device)

    def layer_tensors(self, layer: int) -> list[torch.Tensor]:
        """``k, v`` (and fp8 ``ks, vs``) of a layer, ``[B, H_kv, capacity + 1, X]`` (what a save reads)."""
        return [self.k[layer], self.v[layer]] + ([self.ks[layer], self.vs[layer]] if self.quant is not None else [])

    def view(self, layer: int):
        """``(k, v [B, H_kv, L, d], kv_len [B], pos [B, L])`` of this rank without a new token."""
        L = self.max_len
        return self.k[layer][:, :, :L], self.v[layer][:, :, :L], self.length.clone(), self.pos[:, :L]
