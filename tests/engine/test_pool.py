"""The paged KV pool (issue 35, first part): blocks, reference counts, chained keys, eviction by
block, block tables (append, fork with copy on write, truncate), and partial attention read
through block tables against the same keys held densely."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import assert_close
from treeattn_cli.engine.pool import BlockPool, BlockTable, PoolFull, chain_key, tables_tensor
from treeattn_kernels import partial_attention_paged_ref, partial_attention_ref


def _pool(blocks=8, page=4, layers=1, H_kv=2, d=8, quant=None):
    return BlockPool(layers, H_kv, d, page=page, num_blocks=blocks, quant=quant)


def _states(pool):
    """Every block is exactly one of used (held), cached (kept, with a key) or free."""
    used = {b for b in range(pool.num_blocks) if pool.refs[b] > 0}
    cached, free = set(pool._cached), set(pool._free)
    assert not (used & cached) and not (used & free) and not (cached & free)
    assert used | cached | free == set(range(pool.num_blocks))
    assert all(pool.key_of(b) is not None for b in cached)
    return used, cached, free


def test_random_operations_keep_every_block_in_one_state(seed):
    """Allocations, releases, shares, keys and matches in a random order, against a plain model
    of who holds what: no block is handed out twice, a full pool refuses and changes nothing,
    a cached block comes back by its key until it is evicted, least recently released first."""
    rnd = random.Random(seed)
    pool = _pool(blocks=12)
    held: list[int] = []  # one entry per reference a "table" holds
    keys: dict[bytes, int] = {}
    for step in range(400):
        op = rnd.choice(["alloc", "alloc", "release", "share", "publish", "match"])
        if op == "alloc":
            n = rnd.randint(0, 5)
            before = (pool.free, pool.cached, list(pool.refs))
            if n > pool.available():
                with pytest.raises(PoolFull, match=f"{n} blocks of 4 tokens needed"):
                    pool.allocate(n)
                assert (pool.free, pool.cached, list(pool.refs)) == before
                continue
            evict = max(0, n - pool.free)
            oldest = list(pool._cached)[:evict]
            got = pool.allocate(n)
            assert len(set(got)) == n and not set(got) & set(held)
            assert set(oldest) <= set(got)  # evicted least recently released first
            for b in oldest:
                keys = {k: v for k, v in keys.items() if v != b}
            held += got
        elif op == "release" and held:
            b = held.pop(rnd.randrange(len(held)))
            pool.release([b])
        elif op == "share" and held:
            b = rnd.choice(held)
            pool.acquire(b)
            held.append(b)
        elif op == "publish" and held:
            b = rnd.choice(held)
            k = chain_key(None, [step], [step])
            if pool.publish(b, k):
                keys[k] = b
        elif op == "match" and keys:
            k, b = rnd.choice(list(keys.items()))
            assert pool.match([k]) == [b]
            held.append(b)
        used, cached, free = _states(pool)
        assert used == set(held) and all(pool.refs[b] == held.count(b) for b in used)
    with pytest.raises(ValueError, match="released more often"):
        pool.release([next(iter(free))] if free else [0, 0] * (pool.refs[0] + 1))


def test_a_key_names_one_block_and_depends_on_the_whole_prefix():
    a1 = chain_key(None, [1, 2], [0, 1], salt="model-a")
    assert chain_key(None, [1, 2], [0, 1], salt="model-a") == a1
    assert chain_key(None, [1, 2], [0, 1], salt="model-b") != a1  # another model, another cache
    assert chain_key(None, [1, 2], [5, 6], salt="model-a") != a1  # the same tokens elsewhere
    assert chain_key(a1, [3, 4], [2, 3]) != chain_key(chain_key(None, [9, 2], [0, 1], "model-a"), [3, 4], [2, 3])
    pool = _pool()
    b, c = pool.allocate(2)
    assert pool.publish(b, a1) and not pool.publish(c, a1) and not pool.publish(b, b"other")
    pool.release([b, c])
    assert (pool.cached, pool.free) == (1, 7)  # the keyed block is kept, the other is free
    assert pool.match([a1, b"missing", a1]) == [b]  # the longest prefix found


def test_block_bytes_and_fp8_blocks_are_smaller():
    from treeattn_cli.storage.kvquant import KVQuant

    per = BlockPool.bytes_per_block(2, 2, 64, 16, torch.bfloat16)
    assert per == 2 * 2 * 2 * 16 * 64 * 2 + 8 * 16
    pool = BlockPool(2, 2, 64, page=16, num_blocks=10, dtype=torch.bfloat16)
    assert pool.nbytes() == (10 + 1) * per  # (and the write-off block)
    q = KVQuant(64, "cpu")
    fp8 = BlockPool(2, 2, 64, page=16, num_blocks=10, dtype=torch.bfloat16, quant=q)
    assert fp8.nbytes() == 11 * BlockPool.bytes_per_block(2, 2, 64, 16, q.dtype, q.groups)
    assert 10 * per // BlockPool.bytes_per_block(2, 2, 64, 16, q.dtype, q.groups) == 18  # 0.53x the bytes
    assert fp8.ks and fp8.k[0].dtype == q.dtype


def _prefix_table(pool, keys) -> BlockTable:
    """A table over the longest prefix of ``keys`` the pool has cached (shared blocks, as a
    document's shard adopts them: ``block_reuse.reuse``)."""
    blocks = pool.match(keys)
    return BlockTable(pool, blocks, len(blocks) * pool.page)


def _fill(pool, table, tokens, layer_values):
    """Append ``tokens`` (global positions) to ``table`` with each token's K/V drawn now, every
    layer; returns them ``[n, H_kv, d]`` per layer for the dense oracle."""
    slots = table.slots(len(tokens))
    pool.place(slots, torch.tensor(tokens))
    out = []
    for layer in range(pool.num_layers):
        k = torch.randn(len(tokens), pool.kv_heads, pool.head_dim)
        v = torch.randn(len(tokens), pool.kv_heads, pool.head_dim)
        pool.write(layer, slots, k, v)
        out.append((k, v))
    layer_values.append(out)
    return out


def _dense(parts, layer=0):
    """[H_kv, n, d] K and V of a table from the parts appended to it, in order."""
    k = torch.cat([p[layer][0] for p in parts]).transpose(0, 1)
    v = torch.cat([p[layer][1] for p in parts]).transpose(0, 1)
    return k, v


def test_tables_append_fork_with_copy_on_write_and_truncate():
    """A document, two questions forked from it (the shared partial block is copied on the first
    write), drafts cut back (blocks released, nothing copied): each table reads back exactly its
    own tokens, and the pool's counts follow."""
    from treeattn_kernels import gather_pages

    pool = _pool(blocks=16, page=4, layers=2)
    doc = BlockTable(pool)
    parts_doc: list = []
    _fill(pool, doc, list(range(10)), parts_doc)  # 3 blocks, the last one half full
    assert (len(doc.blocks), pool.used) == (3, 3)
    a, b = doc.fork(), doc.fork()
    assert pool.refs[doc.blocks[0]] == 3 and pool.used == 3
    pa, pb = list(parts_doc), list(parts_doc)
    _fill(pool, a, [10, 11, 12], pa)  # copies the partial block, then one more block
    _fill(pool, b, [10], pb)
    assert (
        a.blocks[:2] == doc.blocks[:2]
        and a.blocks[2] != doc.blocks[2]
        and b.blocks[2] not in (a.blocks[2], doc.blocks[2])
    )
    _fill(pool, b, [11, 12, 13, 14, 15, 16], pb)  # drafts
    used = pool.used
    b.truncate(12)  # rejected drafts: lengths and tables only
    assert len(b.blocks) == 3 and pool.used == used - 2  # 17 tokens held 5 blocks, 12 hold 3
    pb_kept = [[(torch.cat([p[i][0] for p in pb])[:12], torch.cat([p[i][1] for p in pb])[:12]) for i in range(2)]]
    for table, parts in ((doc, parts_doc), (a, pa), (b, pb_kept)):
        bt, kv_len = tables_tensor([table])
        for layer in range(2):
            k = gather_pages(pool.k[layer], bt)[0, :, : table.length]
            v = gather_pages(pool.v[layer], bt)[0, :, : table.length]
            wk, wv = _dense(parts, layer)
            assert torch.equal(k, wk) and torch.equal(v, wv)
        pos = gather_pages(pool.pos, bt)[0, : table.length]
        assert pos.tolist() == list(range(table.length))
    for t in (a, b, doc):
        t.free()
    assert (pool.used, pool.free) == (0, 16)


def test_a_table_that_does_not_fit_changes_nothing():
    pool = _pool(blocks=3, page=4)
    t = BlockTable(pool)
    t.slots(9)  # 3 blocks
    with pytest.raises(PoolFull):
        t.slots(4)
    assert (t.length, len(t.blocks), pool.free) == (9, 3, 0)
    other = t.fork()
    with pytest.raises(PoolFull):  # its copy on write needs a block too
        other.slots(1)
    assert other.blocks == t.blocks and other.length == 9


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_reference_equals_the_dense_reference(seed, fp8, window):
    """Rows of different sequences in one call: ragged tables (one empty), two rows sharing a
    document's blocks, fp8 blocks with their scales, a sliding window over the pool's positions,
    and sinks; each row equals the dense reference over the same keys."""
    from treeattn_cli.storage.kvquant import KVQuant
    from treeattn_kernels import gather_pages

    d, H_kv, G, page = 16, 2, 3, 4
    quant = KVQuant(d, "cpu") if fp8 else None
    pool = _pool(blocks=24, page=page, H_kv=H_kv, d=d, quant=quant)
    doc = BlockTable(pool)
    _fill(pool, doc, list(range(11)), [])
    q1, q2 = doc.fork(), doc.fork()
    _fill(pool, q1, [11, 12], [])
    _fill(pool, q2, [11, 12, 13, 14, 15], [])
    other = BlockTable(pool)  # another document
    _fill(pool, other, [100 + i for i in range(7)], [])
    empty = BlockTable(pool)
    tables = [q1, q2, other, empty]
    bt, kv_len = tables_tensor(tables)
    B, Q = len(tables), 2
    q = torch.randn(B, H_kv * G, Q, d)
    q_pos = torch.tensor([[t.length - 2 + i for i in range(Q)] for t in tables]) + torch.tensor([[0], [0], [100], [0]])
    sink = torch.randn(H_kv * G)
    kw = dict(window=window, softcap=20.0, sink=sink, q_pos=q_pos)
    scales = dict(k_scale=pool.ks[0], v_scale=pool.vs[0]) if fp8 else {}
    o, lse = partial_attention_paged_ref(q, pool.k[0], pool.v[0], bt, kv_len, pos_pool=pool.pos, **kw, **scales)
    for b, t in enumerate(tables):
        one = bt[b : b + 1, : max(1, len(t.blocks))]
        k, v = gather_pages(pool.k[0], one), gather_pages(pool.v[0], one)
        dense = dict(k_scale=gather_pages(pool.ks[0], one), v_scale=gather_pages(pool.vs[0], one)) if fp8 else {}
        wo, wl = partial_attention_ref(
            q[b : b + 1],
            k[:, :, : t.length],
            v[:, :, : t.length],
            k_pos=gather_pages(pool.pos, one)[:, : t.length],
            window=window,
            softcap=20.0,
            sink=sink,
            q_pos=q_pos[b : b + 1],
            **{n: x[:, :, : t.length] for n, x in dense.items()},
        )
        assert_close(o[b : b + 1], wo, torch.float32, f"row {b}")
        assert torch.allclose(lse[b : b + 1], wl, atol=1e-5)  # the empty shard's row: the sink alone
    with pytest.raises(ValueError, match="exceeds"):
        partial_attention_paged_ref(q, pool.k[0], pool.v[0], bt[:, :1], kv_len)


def test_eviction_takes_the_least_recently_released_cached_blocks():
    pool = _pool(blocks=6)
    blocks = pool.allocate(4)
    keys = [chain_key(None, [i], [i]) for i in range(4)]
    for b, k in zip(blocks, keys):
        assert pool.publish(b, k)
    for i in (3, 1, 2, 0):  # released in this order: 3 is the least recently used
        pool.release([blocks[i]])
    assert (pool.free, pool.cached) == (2, 4)
    got = pool.allocate(4)  # the 2 free blocks, then 2 evictions
    assert set(got) >= {blocks[3], blocks[1]} and blocks[2] not in got and blocks[0] not in got
    assert pool.match([keys[3]]) == [] and pool.match([keys[1]]) == []  # evicted: their keys are gone
    assert pool.match([keys[2]]) == [blocks[2]] and pool.match([keys[0]]) == [blocks[0]]
    assert pool.cached == 0 and pool.used == 6


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("window", [None, 20])
def test_the_triton_kernel_reads_through_block_tables(seed, dtype, fp8, window):
    """The split kernel with a block table per row (interpreted here): rows of two documents,
    two questions sharing one document's blocks (one forked at a partial block), an empty shard;
    several splits and two tiles a block, so tiles of one row come from blocks all over the pool
    and from both halves of a block; against the paged
    reference, fp8 blocks with their scales, a window and sinks."""
    from treeattn_cli.storage.kvquant import KVQuant
    from treeattn_kernels.partial_triton import partial_attention_triton_paged

    d, H_kv, G, page = 64, 2, 4, 32
    quant = KVQuant(d, "cpu") if fp8 else None
    pool = BlockPool(1, H_kv, d, page=page, num_blocks=40, quant=quant)
    noise = BlockTable(pool)  # blocks in between, so no table's blocks are contiguous
    doc = BlockTable(pool)
    for i in range(3):
        _fill(pool, doc, list(range(32 * i, 32 * i + 14 if i == 2 else 32 * (i + 1))), [])
        _fill(pool, noise, list(range(32 * i, 32 * i + 32)), [])
    a, b = doc.fork(), doc.fork()
    _fill(pool, a, [78, 79, 80], [])
    _fill(pool, b, list(range(78, 120)), [])
    other = BlockTable(pool)
    _fill(pool, other, [5 + i for i in range(33)], [])
    tables = [a, b, other, BlockTable(pool)]
    bt, kv_len = tables_tensor(tables)
    q = torch.randn(len(tables), H_kv * G, 2, d).to(dtype)
    q_pos = torch.tensor([[t.length - 2 + i for i in range(2)] for t in tables]) + torch.tensor([[0], [0], [5], [0]])
    kw = dict(q_pos=q_pos, pos_pool=pool.pos, window=window, softcap=30.0, sink=torch.randn(H_kv * G))
    if fp8:
        kw.update(k_scale=pool.ks[0], v_scale=pool.vs[0])
    o, lse = partial_attention_triton_paged(
        q, pool.k[0], pool.v[0], bt, kv_len, num_splits=3, block_n=16, **kw
    )  # 2 tiles a block
    ro, rl = partial_attention_paged_ref(q.float(), pool.k[0], pool.v[0], bt, kv_len, **kw)
    assert_close(o, ro, dtype, "paged o")
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))
    assert torch.allclose(
        lse.nan_to_num(0, neginf=0), rl.nan_to_num(0, neginf=0), atol=1e-2 if dtype != torch.float32 else 1e-5
    )
    with pytest.raises(ValueError, match="power of two"):
        BlockPool_small = BlockPool(1, H_kv, d, page=12, num_blocks=2)
        partial_attention_triton_paged(
            q, BlockPool_small.k[0], BlockPool_small.v[0], bt[:, :1], torch.zeros(4, dtype=torch.int64)
        )


def test_a_later_request_reuses_the_longest_cached_prefix():
    """Prefix reuse by block: a finished request's full blocks, keyed from its tokens, serve a
    later request whose tokens start the same (shared, not copied; its K/V read back equal),
    up to the first block that differs; a different model's keys find nothing; blocks evicted
    under pressure are not found."""
    from treeattn_cli.engine.pool import block_keys
    from treeattn_kernels import gather_pages

    pool = _pool(blocks=10, page=4)
    a = BlockTable(pool)
    ids_a = list(range(100, 110))
    parts: list = []
    _fill(pool, a, list(range(10)), parts)
    keys_a = block_keys(ids_a, list(range(10)), 4, salt="model-a")
    assert len(keys_a) == 2 and a.publish(keys_a) == 2
    first_two = list(a.blocks[:2])
    a.free()
    assert pool.cached == 2
    same = block_keys(ids_a[:8] + [7, 7, 7, 7], list(range(12)), 4, salt="model-a")
    b = _prefix_table(pool, same)
    assert b.blocks == first_two and b.length == 8 and pool.cached == 0
    k = gather_pages(pool.k[0], tables_tensor([b])[0])[0, :, :8]
    assert torch.equal(k, _dense(parts)[0][:, :8])
    _fill(pool, b, [8, 9, 10, 11], [])  # the request goes on in blocks of its own
    assert len(b.blocks) == 3 and b.blocks[2] not in first_two
    differs = block_keys(ids_a[:4] + [0] * 4, list(range(8)), 4, salt="model-a")
    c = _prefix_table(pool, differs)
    assert c.blocks == first_two[:1] and c.length == 4  # up to the first block that differs
    assert _prefix_table(pool, block_keys(ids_a, list(range(10)), 4, salt="model-b")).length == 0
    b.free()
    c.free()
    pool.allocate(pool.available())  # pressure: every cached block evicted
    assert _prefix_table(pool, same).length == 0


def test_a_cached_prefix_taken_shorter_is_copied_or_loses_its_key_before_a_write():
    """A table that takes a cached (keyed) block only in part and writes there: when another
    table holds the block too, into a copy (``blocks_for`` counts it; the block keeps what its
    key names); when none does, into the block itself, which loses its key first (no extra
    block: a full pool still fits). A freed table releases its last block first, so pressure
    evicts the end of a cached prefix before its beginning; ``forget`` frees cached blocks by key."""
    pool = _pool(blocks=8, page=4)
    a = BlockTable(pool)
    _fill(pool, a, list(range(8)), [])
    keys = [chain_key(None, [i], [i]) for i in range(2)]
    assert a.publish(keys) == 2
    x0, x1 = a.blocks
    a.free()
    held = BlockTable(pool, pool.match(keys), 8)  # another table holds both blocks
    b = BlockTable(pool, pool.match(keys), 8)
    b.truncate(6)
    assert b.blocks == [x0, x1] and pool.refs[x1] == 2
    assert b.blocks_for(1) == 1 and b.blocks_for(3) == 2  # the copy, then one more block
    kept = pool.k[0][x1].clone()
    _fill(pool, b, [6, 7, 8], [])
    assert pool.copies == 1 and b.blocks[0] == x0 and x1 not in b.blocks
    assert torch.equal(pool.k[0][x1], kept) and pool.key_of(x1) == keys[1]  # what its key names, intact
    assert torch.equal(pool.k[0][b.blocks[1]][:, :2], kept[:, :2])  # the copy began as it
    held.free()
    b.free()
    d = BlockTable(pool, pool.match(keys), 8)
    d.truncate(6)  # x1 in part again, no other holder
    assert d.blocks == [x0, x1] and pool.refs[x1] == 1 and d.blocks_for(2) == 0
    _fill(pool, d, [6, 7], [])
    assert pool.copies == 1 and d.blocks == [x0, x1] and pool.key_of(x1) is None and pool.key_of(x0) == keys[0]
    assert pool.match(keys) == [x0]  # x1's key names nothing now: the prefix found ends before it
    pool.release([x0])
    d.free()
    assert pool.forget(keys) == 1 and pool.cached == 0 and pool.forget(keys) == 0
    c = BlockTable(pool)
    _fill(pool, c, list(range(12)), [])
    ckeys = [chain_key(None, [i], [i], salt="c") for i in range(3)]
    assert c.publish(ckeys) == 3
    c.free()
    free = pool.free
    pool.release(pool.allocate(free + 1))  # one eviction: the oldest cached block
    found = pool.match(ckeys)
    assert len(found) == 2, "the prefix lost its end, not its beginning"
    pool.release(found)
    assert pool.forget(ckeys) == 2 and pool.match(ckeys) == []


@pytest.mark.parametrize("spec", [{"pool_fraction": 0.5, "page": 16}, {"pool": 1 << 20, "page": 16}])
def test_every_rank_makes_a_pool_of_the_same_blocks(spec):
    """``--kv-memory`` as a fraction of each rank's free memory, or bytes: the ranks agree on
    the smallest rank's count of blocks, so admission counts one pool size."""
    from treeattn_cli.parallel.launch import run_local

    per = BlockPool.bytes_per_block(2, 2, 16, 16, torch.float32)
    free = [3_000 * per, 1_000 * per]  # rank 1 has a third of rank 0's free memory
    made = run_local(pool_agreement, 2, spec, free, timeout_s=60)
    want = 500 if "pool_fraction" in spec else (1 << 20) // per
    assert [m["blocks"] for m in made] == [want, want]
    assert [m["free"] for m in made] == free and made[0]["bytes"] == want * per


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_a_shard_of_consecutive_blocks_is_read_in_place(fp8):
    """A document's shard whose blocks are consecutive (a fresh pool hands out the lowest ids
    first) is read as a view of the pool's head-major storage, nothing copied per step (issue
    35: gathering it cost a pooled chat answer on CPU 1.5x the step of one over a plain cache);
    another shard's blocks, out of order, are gathered. Both hold exactly the tokens written,
    in order, scales and positions included."""
    from treeattn_cli.storage.kvquant import KVQuant
    from treeattn_cli.engine.paged_shard import PagedShard
    from treeattn_kernels import gather_pages

    quant = KVQuant(16, "cpu") if fp8 else None
    pool = _pool(blocks=10, page=4, layers=2, d=16, quant=quant)
    a, b = PagedShard(pool, rank=0, world=1), PagedShard(pool, rank=0, world=1)
    rows = {}
    for shard, n, chunks in ((a, 10, (6, 4)), (b, 7, (3, 4))):  # b's 2nd piece: blocks after a's 2nd
        k = torch.randn(1, 2, n, 16)
        rows[id(shard)] = k
        start = 0
        for c in chunks:
            for layer in range(2):
                shard.append_chunk(
                    layer,
                    k[:, :, start : start + c] * (layer + 1),
                    -k[:, :, start : start + c],
                    torch.arange(start, start + c) + 100,
                )
            start += c
    assert a.table.blocks == [0, 1, 2] and b.table.blocks == [3, 4]  # 6 + 4 tokens in order; 3 then 4
    for shard, n in ((a, 10), (b, 7)):
        k, v, kv_len, pos = shard.view(1)
        want = gather_pages(pool.k[1], tables_tensor([shard.table])[0])[:, :, :n]
        assert torch.equal(k, want) and k.shape == (1, 2, n, 16) and kv_len.tolist() == [n]
        assert torch.equal(pos, torch.arange(n)[None] + 100)
        if fp8:
            ks, _ = shard.scales(1, n)
            assert torch.equal(ks, gather_pages(pool.ks[1], tables_tensor([shard.table])[0])[:, :, :n])
        else:
            assert_close(k, rows[id(shard)] * 2, torch.float32)
        shares = k.untyped_storage().data_ptr() == pool.k[1].untyped_storage().data_ptr()
        assert shares, "a shard of consecutive blocks was copied"
    c = PagedShard(pool, rank=0, world=1)  # blocks 5 and then 6..: made non-consecutive by hand
    c.adopt([], 0, [0])
    c.table.blocks = [6, 5]
    c.table.length = c.n = 8
    c._slots = c.table.flat(0, 8)
    c._refresh()
    k, _, _, _ = c.view(0)
    assert torch.equal(k, gather_pages(pool.k[0], tables_tensor([c.table])[0]))
    assert k.untyped_storage().data_ptr() != pool.k[0].untyped_storage().data_ptr()  # gathered: a copy


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


def pool_agreement(ctx, spec, free_by_rank):
    """``Documents.make_pool(spec)`` on every rank, each rank told it has ``free_by_rank[rank]``
    bytes free; returns what each rank made (``{blocks, page, bytes, free}``)."""
    from types import SimpleNamespace

    from treeattn_cli.engine import documents as D
    from treeattn_cli.engine import pool_sizing
    from treeattn_cli.engine.pool import KVFormat
    from treeattn_cli.parallel import comm as C

    world = C.Comm()
    kv = KVFormat(2, 2, 16, torch.float32, None, torch.device("cpu"))
    pool_sizing.free_memory = lambda device, ranks=1: free_by_rank[ctx.rank]
    docs = D.Documents(SimpleNamespace(kv=kv, world=world))
    made = docs.make_pool(spec)
    assert docs.pool.num_blocks == made["blocks"] and docs.make_pool({"pool": 1}) == made  # made once
    return made
