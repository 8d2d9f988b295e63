"""A batch's tail in the rank's block pool (issue 35 item 1): ``paged_tail.PagedTail`` holds
the numbers the dense reference (``dense_tail.DenseTail``) holds through every operation a batch makes
(questions entering slots, decode steps, drafts verified and cut back, the fixed-shape verify's
writes), each slot's blocks taken when it is admitted and given back when it ends."""

from __future__ import annotations

import random

import pytest
import torch

from dense_tail import DenseTail
from treeattn_cli.storage.kvquant import KVQuant
from treeattn_cli.engine.paged_tail import PagedTail, fewest_first, most_here
from treeattn_cli.engine.pool import BlockPool, PoolFull
from treeattn_kernels import gather_pages

L_, H, D, PAGE = 2, 2, 16, 8


def test_most_here_is_where_the_fewest_tokens_rule_puts_n_tokens():
    """The closed form admission uses against the rule every cache places tokens by."""
    rng = random.Random(5)
    for _ in range(300):
        world = rng.randint(1, 5)
        beside = [rng.randint(0, 9) for _ in range(world)]
        n = rng.randint(0, 40)
        owners = fewest_first(torch.tensor(beside), n)  # the placement itself, a token at a time
        assert [most_here(beside, n, r) for r in range(world)] == [owners.count(r) for r in range(world)]


def _same(a, b, lens):
    """Two views ``[R, H, L, X]`` agree on every row's first ``lens[r]`` tokens, bit for bit."""
    for r, n in enumerate(lens):
        assert torch.equal(a[r, :, :n], b[r, :, :n]), r


def _tables_name(pool, layer, tables, lens, k, v, pos, scales=None):
    """Block tables ``[R, nb]`` read through the pool (what the paged kernel reads, positions
    included) give the dense views' first ``lens[r]`` tokens of every row, bit for bit."""
    assert tables.dtype == torch.int32 and tables.shape[1] * pool.page >= max(list(lens) + [0])
    _same(gather_pages(pool.k[layer], tables), k, lens), _same(gather_pages(pool.v[layer], tables), v, lens)
    _same(gather_pages(pool.pos, tables)[:, None, :, None], pos[:, None, :, None], lens)
    if scales is not None:
        _same(gather_pages(pool.ks[layer], tables), scales[0], lens)
        _same(gather_pages(pool.vs[layer], tables), scales[1], lens)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_a_pooled_tail_holds_what_a_dense_tail_holds(seed, fp8, static):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    S, world, rank = 3, 3, 1
    quant = KVQuant(D, "cpu") if fp8 else None
    pool = BlockPool(L_, H, D, page=PAGE, num_blocks=48, quant=quant)
    dense = DenseTail(L_, S, H, D, rank=rank, world=world, capacity=4, static=static, quant=quant)
    paged = PagedTail(pool, S, rank=rank, world=world, capacity=4, static=static)
    caches = (dense, paged)
    assert pool.used == 0
    at = [0] * S  # each slot's next global position
    budget = [0] * S  # tokens each slot may still take (its admission)

    def kv(R, T):
        return [torch.randn(R, H, T, D, generator=gen) for _ in range(2)]

    def compare_rows(rows, extended):
        for layer in range(L_):
            a, b = (c.view_rows(layer, rows, extended=extended) for c in caches)
            lens = a[2].tolist()
            assert lens == b[2].tolist()
            _same(a[0], b[0], lens), _same(a[1], b[1], lens)
            for r, n in enumerate(lens):
                assert torch.equal(a[3][r, :n], b[3][r, :n])
            sa = None
            if fp8:
                sa, sb = (c.scales(layer, a[0].shape[2], rows) for c in caches)
                _same(sa[0], sb[0], lens), _same(sa[1], sb[1], lens)
            tables, kv_len = paged.rows_tables(rows, extended=extended)  # the GPU's read
            assert kv_len.tolist() == lens
            _tables_name(pool, layer, tables, lens, a[0], a[1], a[3], sa)

    def extend(rows, feeds):
        T = max(feeds)
        pos = torch.full((len(rows), T), -1, dtype=torch.int64)
        for i, (b, n) in enumerate(zip(rows, feeds)):
            pos[i, T - n :] = torch.arange(at[b], at[b] + n)  # left-padded, as a question's prefill
            at[b] += n
            budget[b] -= n
        for c in caches:
            c.begin_extend(rows, pos)
        for layer in range(L_):
            k, v = kv(len(rows), T)
            for c in caches:
                c.extend(layer, k, v)
            for b in rows:
                ea, eb = (c.extension_view(layer, b) for c in caches)
                assert all(torch.equal(x, y) for x, y in zip(ea, eb))
        compare_rows(rows, extended=True)
        for c in caches:
            c.end_extend()

    for step in range(40):
        op = rng.random()
        free = [b for b in range(S) if budget[b] <= 0]
        if free and op < 0.3:  # a question takes a slot: admitted, then prefilled
            b = rng.choice(free)
            beside = [rng.randint(20, 23) for _ in range(world)]  # its document on every rank
            at[b], budget[b] = sum(beside), 24
            paged.release(b)
            for c in caches:
                c.reset_rows([b], [beside])
            paged.admit(b, most_here(beside, budget[b], rank))
            extend([b], [rng.randint(1, 6)])
        elif op < 0.6 and any(budget[b] > 0 for b in range(S)):  # one decode step
            going = [budget[b] > 0 for b in range(S)]
            pos = torch.tensor([at[b] for b in range(S)])
            for b in range(S):
                at[b] += going[b]
                budget[b] -= going[b]
            for c in caches:
                store = c.plan_step(active=going)
                c.start_step(store, store.to(torch.int64), pos)
            for layer in range(L_):
                k, v = kv(S, 1)
                (ka, va, la), (kb, vb, lb) = (c.update(layer, k, v) for c in caches)
                assert torch.equal(la, lb)
                _same(ka, kb, la.tolist()), _same(va, vb, la.tolist())
                tables, kv_len = paged.step_tables(layer, k, v)  # the GPU's read (the same writes again)
                assert torch.equal(kv_len, la) and tables.shape[1] == -(-ka.shape[2] // PAGE)
                sa = dense.scales(layer, ka.shape[2]) if fp8 else None
                _tables_name(pool, layer, tables, la.tolist(), ka, va, dense.pos[:, : ka.shape[2]], sa)
            for c in caches:
                c.end_step()
        elif any(budget[b] > 4 for b in range(S)):  # drafts verified, some cut back
            rows = [b for b in range(S) if budget[b] > 4]
            feeds = [rng.randint(1, 4) for _ in rows]
            extend(rows, feeds)
            for b, n in zip(rows, feeds):
                keep = rng.randint(1, n)
                for c in caches:
                    c.truncate_extension(b, keep=keep)
                at[b] -= n - keep
                budget[b] += n - keep
        for b in range(S):
            for layer in range(L_):
                ra, rb = (c.row_stored(layer, b) for c in caches)
                assert len(ra) == len(rb) and all(torch.equal(x, y) for x, y in zip(ra, rb))
    compare_rows(list(range(S)), extended=False)
    # the fixed-shape verify: every row's tokens written (here or to the write-off slot), whole views
    T = 2
    pos = torch.stack([torch.arange(at[b], at[b] + T) for b in range(S)])
    ok = all(budget[b] >= T for b in range(S))
    if ok:
        for c in caches:
            c.begin_extend(list(range(S)), pos)
        slots = [dense.extension_slots(i, T) for i in range(S)]
        assert slots == [paged.extension_slots(i, T) for i in range(S)]
        lens = dense.extended_lengths()
        for layer in range(L_):
            k, v = kv(S, T)
            for c in caches:
                c.put_rows(layer, torch.tensor(slots).reshape(-1), k, v)
            (ka, va, pa), (kb, vb, pb) = (c.full(layer) for c in caches)
            _same(ka, kb, lens), _same(va, vb, lens), _same(pa[:, None], pb[:, None], lens)
            sa = dense.scales(layer, ka.shape[2]) if fp8 else None
            _tables_name(pool, layer, paged.full_tables(), lens, ka, va, pa, sa)
        for c in caches:
            c.end_extend()
    assert pool.used == paged.held() > 0
    paged.release_all()
    assert pool.used == 0


def test_a_slot_is_admitted_whole_or_not_at_all():
    """Admission takes all of a slot's blocks or none (the batch asks every rank first), and a
    slot admitted again gives back what it held."""
    pool = BlockPool(L_, H, D, page=PAGE, num_blocks=4)
    tail = PagedTail(pool, 2, rank=0, world=1)
    tail.admit(0, 3 * PAGE)
    assert pool.used == 3
    with pytest.raises(PoolFull):
        tail.admit(1, 2 * PAGE)
    assert pool.used == 3 and tail.blocks[1] == []
    tail.admit(0, PAGE)  # again, smaller: the old blocks go back
    assert pool.used == 1
    tail.admit(1, 3 * PAGE)
    assert pool.used == 4
