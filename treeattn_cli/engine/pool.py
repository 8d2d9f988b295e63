"""One rank's KV memory as a pool of fixed-size blocks, and the block tables of the sequences
that live in it (docs/architecture.md §12; issue 35: the documents of a batch live here, ``paged_shard.PagedShard``).

A block holds ``page`` tokens of every layer: ``k[layer][block] [H_kv, page, d]`` (the storage
dtype; fp8 with ``ks``/``vs`` scales per row, per block), and each token's global position in
``pos[block] [page]`` (-1: empty). The storage is head-major, ``[H_kv, blocks, page, d]``, and
``k[layer]`` its ``[blocks, H_kv, page, d]`` view (the kernels take strides): a run of consecutive
blocks is then one strided ``[H_kv, tokens, d]`` view of a sequence's keys, read in place where a
kernel needs them dense (:meth:`BlockPool.dense`), where a block-major pool had to be copied. A sequence's shard on this rank is a :class:`BlockTable`: an
ordered list of blocks and a length; its first ``length`` slots in table order are its tokens.

Host bookkeeping, per block: a reference count (tables that hold it), and for a full block
whose contents are final, a key chained from the start of its sequence (:func:`chain_key`), so
a later request with the same prefix finds it (:meth:`BlockPool.match`). A block no table holds
is free, or, when it has a key, cached: it keeps its contents and is evicted least recently
released first when an allocation needs room. Nothing is copied when a table shrinks (rollback,
rejected drafts): blocks past the new length are released. Nothing reserves memory per
sequence: the pool is sized once (``pool_sizing.make_pool``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch
from treeattn_kernels import write_kv


class PoolFull(RuntimeError):
    """An allocation the pool cannot serve even after evicting every cached block."""

    def __init__(self, needed: int, free: int, cached: int, total: int, page: int):
        super().__init__(
            f"the KV pool is full: {needed} blocks of {page} tokens needed, {free} free and {cached} cached of {total}"
        )
        self.needed, self.free, self.cached, self.total = needed, free, cached, total


def chain_key(parent: bytes | None, ids, positions, salt: str = "", scope: bytes = b"") -> bytes:
    """The key of a full block: its tokens and their global positions, chained to the key of the
    block before it in its sequence (``parent``; None for a sequence's first block on this rank)
    and ``salt`` (the model's identity, the rank's place in its mesh); ``scope``: a digest of
    whatever else its contents depend on (a sequence-sharded shard's keys and values depend on
    the tokens other ranks hold too: ``documents`` passes the digest of every token up to the
    end of the prefill segment that computed the block). Equal keys mean equal contents."""
    h = hashlib.sha256(parent or salt.encode())
    h.update(scope)
    h.update(torch.as_tensor(list(ids), dtype=torch.int64).numpy().tobytes())
    h.update(torch.as_tensor(list(positions), dtype=torch.int64).numpy().tobytes())
    return h.digest()


def token_bytes(num_layers: int, kv_heads: int, head_dim: int, dtype, quant=None) -> int:
    """Bytes one token's KV takes on a rank, every layer (fp8: its bf16 scales included)."""
    per = head_dim * torch.empty(0, dtype=dtype).element_size()
    if quant is not None:
        per += 2 * quant.groups
    return num_layers * 2 * kv_heads * per


@dataclass(frozen=True)
class KVFormat:
    """How this rank stores KV: the shapes and storage every shard and pool of the engine share
    (``dtype``: the stored one, fp8's with ``quant``)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    quant: object
    device: torch.device

    def bytes_per_token(self) -> int:
        return token_bytes(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.quant)


class BlockPool:
    """``num_blocks`` blocks of ``page`` tokens for every layer of one rank (see the module)."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        page: int,
        num_blocks: int,
        dtype=torch.float32,
        device="cpu",
        quant=None,
    ):
        if page < 1 or num_blocks < 1:
            raise ValueError(f"a pool needs page >= 1 and blocks >= 1, got page={page}, blocks={num_blocks}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.page, self.num_blocks = page, num_blocks
        self.device = torch.device(device)
        self.quant = quant  # kvquant.KVQuant: fp8 rows in a rotated basis, bf16 scales per row
        self.dtype = quant.dtype if quant is not None else dtype
        # one more block than the pool hands out: the write-off block, where a fixed-shape step writes
        # what no sequence keeps (a batch's tail: tokens other ranks keep, idle slots), never read
        self.write_off = num_blocks

        def store(width, dtype, fill):  # head-major storage, seen block-major: [blocks + 1, H_kv, page, width]
            return [
                torch.full((kv_heads, num_blocks + 1, page, width), fill, dtype=dtype, device=self.device).transpose(
                    0, 1
                )
                for _ in range(num_layers)
            ]

        self.k, self.v = store(head_dim, self.dtype, 0), store(head_dim, self.dtype, 0)
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []
        if quant is not None:
            self.ks, self.vs = store(quant.groups, torch.bfloat16, 1), store(quant.groups, torch.bfloat16, 1)
        self.pos = torch.full((num_blocks + 1, page), -1, dtype=torch.int64, device=self.device)
        # host bookkeeping
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids first
        self._cached: OrderedDict[int, None] = OrderedDict()  # released blocks with a key, oldest first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.copies = 0  # blocks copied on write (a shared partial block a table extends)

    # -- sizing -------------------------------------------------------------------------
    @staticmethod
    def bytes_per_block(num_layers: int, kv_heads: int, head_dim: int, page: int, dtype, quant_groups: int = 0) -> int:
        """Bytes one block takes: K and V rows of every layer, their fp8 scales, the positions."""
        row = head_dim * torch.empty(0, dtype=dtype).element_size() + 2 * quant_groups
        return 2 * num_layers * kv_heads * page * row + 8 * page

    def bytes_per_token(self) -> int:
        """Bytes one token takes in this pool, every layer (fp8: its scales included)."""
        return token_bytes(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.quant)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """Fresh keys or values ``x`` as this pool will hold them, in ``x``'s dtype: a prefill
        segment attends its own tokens as stored, so every attention of a run sees the same
        numbers whichever route it takes."""
        if self.quant is not None:
            return self.quant.roundtrip(x)
        if self.dtype != x.dtype:
            return x.to(self.dtype).to(x.dtype)
        return x

    def nbytes(self) -> int:
        return (
            sum(t.numel() * t.element_size() for t in self.k + self.v + self.ks + self.vs)
            + self.pos.numel() * self.pos.element_size()
        )

    # -- blocks -------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def cached(self) -> int:
        return len(self._cached)

    @property
    def used(self) -> int:
        return self.num_blocks - self.free - self.cached

    def available(self) -> int:
        """Blocks an allocation can get now: free ones, and cached ones it would evict."""
        return self.free + self.cached

    def stats(self) -> dict:
        return {
            "blocks": self.num_blocks,
            "page": self.page,
            "used": self.used,
            "cached": self.cached,
            "free": self.free,
        }

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for a table (reference count 1, positions cleared), free ones first, then
        the least recently released cached ones (their keys forgotten). All or nothing: raises
        :class:`PoolFull` and changes nothing when there are not enough."""
        if n > self.available():
            raise PoolFull(n, self.free, self.cached, self.num_blocks, self.page)
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._block_of[self._key_of.pop(b)]
            self.refs[b] = 1
            out.append(b)
        if out:
            self.pos[torch.tensor(out, device=self.device)] = -1
        return out

    def acquire(self, block: int) -> None:
        """One more table holds ``block`` (a cached block comes back into use)."""
        if self.refs[block] == 0:
            if block not in self._cached:
                raise ValueError(f"block {block} is free: nothing to share")
            del self._cached[block]
        self.refs[block] += 1

    def release(self, blocks) -> None:
        """Tables no longer hold ``blocks``: one reference less each; a block nobody holds is
        cached when it has a key (its contents kept, most recently released last), else free."""
        for b in blocks:
            if self.refs[b] < 1:
                raise ValueError(f"block {b} released more often than it was held")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self._key_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def publish(self, block: int, key: bytes) -> bool:
        """Give a full block whose contents are final its chained key, so later requests with the
        same prefix find it. False (and nothing changes) when another block has the key already or
        this one has a key: the first stays the one found."""
        if key in self._block_of or block in self._key_of:
            return False
        self._key_of[block], self._block_of[key] = key, block
        return True

    def match(self, keys) -> list[int]:
        """The blocks of the longest prefix of ``keys`` (a sequence's chained keys, in order) the
        pool holds, each acquired for the caller's table."""
        out = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            self.acquire(b)
            out.append(b)
        return out

    def unpublish(self, block: int) -> None:
        """``block`` no longer stands for its key (a table that holds it alone writes into it)."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]

    def forget(self, keys) -> int:
        """Cached blocks under ``keys`` become free (a document deleted for good); blocks a table
        holds keep their keys. Returns how many were freed."""
        n = 0
        for key in keys:
            b = self._block_of.get(key)
            if b is not None and self.refs[b] == 0:
                del self._cached[b], self._block_of[key], self._key_of[b]
                self._free.append(b)
                n += 1
        return n

    def key_of(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    # -- contents -----------------------------------------------------------------------
    @staticmethod
    def dense(store: torch.Tensor, blocks, n: int) -> torch.Tensor:
        """The first ``n`` tokens of ``blocks`` (a table's ids, in order) of a layer's ``store``
        (``k``, ``v``, ``ks`` or ``vs``) as ``[1, H_kv, n, X]``: a view of the storage when the
        blocks are consecutive ids (a ``(first, count)`` pair), else one copy (``blocks`` a
        device tensor of ids)."""
        hm = store.transpose(0, 1)  # [H_kv, blocks, page, X]: the storage's own order
        x = hm[:, blocks[0] : blocks[0] + blocks[1]] if isinstance(blocks, tuple) else hm.index_select(1, blocks)
        return x.reshape(x.shape[0], -1, x.shape[-1])[None, :, :n]

    @staticmethod
    def gather(store: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """A layer's ``store [blocks, H_kv, page, X]`` (``k``, ``v``, ``ks`` or ``vs``) at flat slots
        ``flat [R, L]`` (``block * page + offset``) as ``[R, H_kv, L, X]``: one copy."""
        R, L = flat.shape
        hm = store.transpose(0, 1)  # [H_kv, blocks, page, X]: the storage's own order
        x = hm.reshape(hm.shape[0], -1, hm.shape[-1]).index_select(1, flat.reshape(-1))
        return x.view(x.shape[0], R, L, x.shape[-1]).transpose(0, 1)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values ``k, v [n, H_kv, d]`` of ``n`` tokens into flat ``slots [n]``
        (``block * page + offset``): cast to the storage dtype, or rounded to fp8 with scales."""
        scales = (self.ks[layer], self.vs[layer], self.quant.r) if self.quant is not None else ()
        write_kv(self.k[layer], self.v[layer], slots, k, v, *scales)  # (one launch on a GPU)

    def place(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Record the global positions of the tokens at ``slots`` (every layer shares them)."""
        self.pos[slots // self.page, slots % self.page] = positions.to(self.pos.device)

    def copy_block(self, src: int, dst: int, n: int) -> None:
        """The first ``n`` tokens of block ``src`` into block ``dst`` (a table's private copy of a
        shared partial block, before it writes there)."""
        self.copies += 1
        for store in (self.k, self.v, self.ks, self.vs):
            for t in store:
                t[dst, :, :n] = t[src, :, :n]
        self.pos[dst, :n] = self.pos[src, :n]


def block_keys(ids, positions, page: int, salt: str = "", scopes=None, tail: bool = False) -> list[bytes]:
    """The chained key of every full block of a shard holding tokens ``ids`` at global
    ``positions`` (in shard order), ``page`` a block: block i's key covers tokens
    ``[i * page, (i + 1) * page)`` and, through its parent, everything before them; ``scopes[i]``
    (optional) is block i's ``scope`` (:func:`chain_key`). ``tail``: the last, partial block
    too (a sequence nothing will extend: its key names fewer positions, so it never stands for
    a full block of a longer sequence)."""
    keys, parent = [], None
    n = -(-len(ids) // page) if tail else len(ids) // page
    for i in range(n):
        parent = chain_key(
            parent,
            ids[i * page : (i + 1) * page],
            positions[i * page : (i + 1) * page],
            salt,
            scopes[i] if scopes is not None else b"",
        )
        keys.append(parent)
    return keys


class BlockTable:
    """One sequence's shard on this rank: blocks of ``pool`` in order, and how many tokens."""

    def __init__(self, pool: BlockPool, blocks=(), length: int = 0):
        self.pool, self.blocks, self.length = pool, list(blocks), length

    def publish(self, keys) -> int:
        """Offer this table's blocks to later requests under ``keys`` (:func:`block_keys` of its
        tokens whose contents are final: full blocks, and a last partial one nothing will write
        to); returns how many blocks now carry a key (the first block with a key stays the one
        found)."""
        n = min(len(keys), len(self.blocks))
        for b, k in zip(self.blocks[:n], keys[:n]):
            self.pool.publish(b, k)
        return sum(self.pool.key_of(b) is not None for b in self.blocks[:n])

    def __len__(self) -> int:
        return self.length

    def slots(self, n: int) -> torch.Tensor:
        """Flat slots for ``n`` more tokens (allocating blocks as needed, all or nothing), and the
        length grows by ``n``. A partial last block another table holds is copied first (copy on
        write); one with a key that only this table holds (a cached prefix it took shorter) loses
        its key instead, its contents being about to change."""
        page = self.pool.page
        cow = self._cow(n)
        new = self.pool.allocate(self.blocks_for(n))
        if n and self.length % page and not cow:
            self.pool.unpublish(self.blocks[-1])
        if cow:  # the partial last block is another table's too: write into a private copy
            own = new.pop()
            self.pool.copy_block(self.blocks[-1], own, self.length % page)
            self.pool.release([self.blocks[-1]])
            self.blocks[-1] = own
        self.blocks += new
        self.length += n
        return self.flat(self.length - n, self.length)

    def flat(self, start: int, end: int) -> torch.Tensor:
        """The flat pool slots (``block * page + offset``) of tokens ``[start, end)``: ``[end - start]``."""
        page = self.pool.page
        idx = torch.arange(start, end)
        return torch.tensor(self.blocks, dtype=torch.int64)[idx // page] * page + idx % page

    def _cow(self, n: int) -> bool:
        tail = self.length % self.pool.page
        return bool(n and tail and self.pool.refs[self.blocks[-1]] > 1)

    def blocks_for(self, n: int) -> int:
        """Blocks :meth:`slots` takes from the pool for ``n`` more tokens (a copied last block too)."""
        return max(0, -(-(self.length + n) // self.pool.page) - len(self.blocks)) + self._cow(n)

    def truncate(self, keep: int) -> None:
        """Keep the first ``keep`` tokens; the blocks past them are released (nothing copied)."""
        if not 0 <= keep <= self.length:
            raise ValueError(f"cannot keep {keep} of {self.length} tokens")
        n = -(-keep // self.pool.page)
        self.pool.release(self.blocks[n:][::-1])  # the last block first: a cached prefix loses its end first
        del self.blocks[n:]
        self.length = keep

    def fork(self) -> "BlockTable":
        """Another table over the same tokens (a question after a document): every block shared;
        the first write to a shared partial block copies it (:meth:`slots`)."""
        for b in self.blocks:
            self.pool.acquire(b)
        return BlockTable(self.pool, self.blocks, self.length)

    def free(self) -> None:
        self.truncate(0)

    def tensor(self, width: int | None = None, device=None) -> torch.Tensor:
        """The block ids as ``[width]`` int32 (padded with 0: past ``length`` nothing is read)."""
        width = len(self.blocks) if width is None else width
        out = torch.zeros(width, dtype=torch.int32)
        out[: len(self.blocks)] = torch.tensor(self.blocks, dtype=torch.int32)
        return out.to(device or self.pool.device)


def tables_tensor(tables: list[BlockTable], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_tables [B, max blocks] int32, kv_len [B] int64)`` of a batch of tables."""
    width = max([len(t.blocks) for t in tables] + [1])
    dev = device or (tables[0].pool.device if tables else "cpu")
    bt = torch.stack([t.tensor(width, dev) for t in tables]) if tables else torch.zeros(0, 1, dtype=torch.int32)
    return bt, torch.tensor([t.length for t in tables], dtype=torch.int64, device=dev)
