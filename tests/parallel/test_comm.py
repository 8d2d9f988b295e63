"""Distributed engine on CPU gloo ranks: schemes, ring decode and prefill vs one-rank oracles."""

from __future__ import annotations

import time

import pytest
from treeattn_cli.parallel.launch import LaunchError, run_local
import os
import signal
from pathlib import Path
import torch
from treeattn_cli.parallel.comm import Stats
from treeattn_cli.parallel.comm import make_comm
from treeattn_cli.engine.prefill import ring_prefill
from treeattn_cli.parallel.ring import chunk_bounds
from treeattn_cli.parallel.ring import ring_decode
from treeattn_kernels import partial_attention
from treeattn_kernels import partial_attention_ref

TOL_REL = {"float32": 1e-5, "bfloat16": 1e-2}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_scheme_and_ring_decode_equal_one_rank(world, seed):
    groups = [[0, 1], [2, 3]] if world == 4 else ([[0], [1, 2]] if world == 3 else None)
    per_rank = run_local(decode_schemes, world, seed & 0xFFFFFF, groups, timeout_s=60)
    methods = set()
    for rows in per_rank:
        for case, method, o_err, lse_err, same in rows:
            methods.add(method)
            tol = TOL_REL[case.split("-")[-1]]
            assert o_err <= tol, (world, case, method, o_err)
            assert lse_err <= 1e-5 if "float32" in case else lse_err <= 1e-2, (case, method, lse_err)
            assert same, f"{method} {case}: ranks disagree"
    assert {"allreduce", "allgather", "tree", "ring"} <= methods
    if groups:
        assert any(m.startswith("hier-") for m in methods)


def test_allreduce_counts_two_collectives_and_formula_bytes():
    B, H, d = 3, 8, 64
    for snap in run_local(allreduce_accounting, 2, B, H, d, timeout_s=60):
        assert snap["collectives"] == 2
        assert snap["by_op"] == {"all_reduce_max": 1, "all_reduce_sum": 1}
        assert snap["bytes_sent"] == 4 * B * H * (d + 2)


def test_ring_bytes_grow_with_shard_and_move_kv_heads_only():
    B, H_kv, N, d, p = 1, 2, 40, 32, 3
    for snap in run_local(ring_accounting, p, B, H_kv, N, d, timeout_s=60):
        block = 2 * B * H_kv * N * d * 4 + B * 8  # K and V (fp32, H_kv heads) and the lengths
        assert snap["bytes_sent"] == (p - 1) * block
        assert snap["peak_mem_bytes"] == 2 * block  # double buffer


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_prefill_equals_single_device_causal(world, seed):
    """Balanced and contiguous pieces, windows, prompts shorter than 2p and not divisible by it,
    with a cache before the segment (travelling, or visited by the queries)."""
    lengths = [1, world - 1, 2 * world - 1, 2 * world + 1, 37]
    for rows in run_local(prefill_cases, world, seed & 0xFFFFFF, lengths, timeout_s=60):
        assert len(rows) == len(lengths) * 12
        for n, sharding, window, cached, o_err, lse_err in rows:
            assert o_err <= 1e-5 and lse_err <= 1e-5, (world, n, sharding, window, cached, o_err, lse_err)


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_failing_rank_is_named_on_every_rank_within_timeout(how, tmp_path):
    """A rank that fails mid-merge is named on every rank, and the run ends within the
    collective timeout after the failure (counted from the failing rank's own stamp, not from
    the launch: start-up is not part of the promise), plus the launcher's grace and a generous
    allowance for a loaded 2-core machine's teardown."""
    timeout, stamp = 8.0, tmp_path / "failed-at"
    with pytest.raises(LaunchError) as ei:
        run_local(fail_mid_step, 3, 1, how, str(stamp), timeout_s=timeout)
    elapsed = time.time() - float(stamp.read_text())
    assert elapsed < timeout + 5 + 15, elapsed  # the timeout, the launcher's grace, teardown
    msg = str(ei.value)
    if how == "raise":
        assert "rank 1 failed: ValueError: boom in layer 3" in msg
    else:
        assert "rank 1 killed by SIGKILL" in msg
    victims = {r: v for r, v in ei.value.outcomes.items() if r != 1}
    for r, (kind, val) in victims.items():
        assert kind == "lost", (r, kind, val)
        assert "rank 1" in val[0], val[0]


def test_only_comm_touches_torch_distributed():
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[2] / "treeattn_cli"
    offenders = [
        str(p.relative_to(pkg))
        for p in pkg.rglob("*.py")
        if p.relative_to(pkg).as_posix() != "parallel/comm.py"
        and ("torch.distributed" in p.read_text() or "import distributed" in p.read_text())
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("world", [3, 4])
def test_ring_decode_never_writes_its_inputs(world, seed):
    assert all(run_local(ring_leaves_inputs_alone, world, seed & 0xFFFFFF, timeout_s=60))


def test_store_descriptor_lives_exactly_as_long_as_the_store():
    """The launcher binds the store's listening socket itself (loopback only) and hands it to
    TCPStore's server, which owns it: destroying one store must not touch another's socket
    (a socket once closed behind the server's back was reused by the next run's store, which
    the late close then broke: ranks could not connect), and nothing leaks."""
    import gc
    import os

    from treeattn_cli.parallel.comm import make_store

    def fds():
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    def settles_to(limit, timeout=10.0):  # the store's server thread closes its handles soon after
        t0 = time.monotonic()
        while fds() > limit and time.monotonic() - t0 < timeout:
            time.sleep(0.05)
        return fds() <= limit

    def listening(port):  # the event of a store's teardown: its port no longer listens
        rows = []
        for f in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                rows += [ln.split() for ln in open(f).read().splitlines()[1:]]
            except OSError:
                pass
        return any(r[1].rsplit(":", 1)[1] == f"{port:04X}" and r[3] == "0A" for r in rows)

    warm = make_store(0, 2, is_master=True, timeout_s=5)  # one-time descriptors of the store library
    port = warm.port
    del warm
    t0 = time.monotonic()
    while listening(port) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not listening(port)
    base = fds()
    s1 = make_store(0, 2, is_master=True, timeout_s=5)
    s2 = make_store(0, 2, is_master=True, timeout_s=5)
    del s1
    client = make_store(s2.port, 2, is_master=False, timeout_s=5)
    client.set("k", "v")
    assert s2.get("k") == b"v"
    del client, s2
    assert settles_to(base), (fds(), base)


def test_a_failed_run_does_not_break_the_next_one():
    with pytest.raises(LaunchError) as ei:
        run_local(fail_mid_step, 2, 1, "raise", timeout_s=8)
    assert run_local(rank_and_world, 2, timeout_s=8) == [(0, 2), (1, 2)]  # timeout_s bounds it
    assert "rank 1 failed" in str(ei.value)


def test_host_numbers_travel_on_the_groups_device():
    """bench gathers every rank's timings: the numbers must travel in a tensor on the group's
    device (an NCCL group takes no CPU tensor: bench on >= 2 GPUs crashed), and come back on
    the host."""
    import torch

    from treeattn_cli.parallel.comm import Comm

    c = Comm.single()
    c.world, c.device = 2, torch.device("meta")  # stands for an NCCL group's GPU
    seen = []
    c.all_gather = lambda t: (seen.append((t.device.type, t.dtype)), torch.zeros(2, t.numel()))[1]
    assert c.all_gather_values([1, 2.5]).device.type == "cpu"
    assert seen == [("meta", torch.float64)]
    rows = run_local(gather_values, 3, timeout_s=30)
    assert all(r == [[0, 0, 7], [1, 0.5, 7], [2, 1.0, 7]] for r in rows)


def test_decisions_are_taken_together():
    """A CUDA-graph capture that fails on one rank makes every rank decode eagerly: the
    decision is ``Comm.all_true`` of the ranks' outcomes (here rank 2 vetoes)."""
    assert run_local(agree, 3, 2, timeout_s=30) == [(True, False)] * 3


def test_blocked_survivors_are_stopped_soon_after_a_rank_fails(tmp_path):
    """Under NCCL the survivors of a failed rank block in a collective for the whole timeout
    (~5 min) before noticing: the launcher stops them a few seconds after the failure (its
    grace, 5 s by default, 1 s here; bound here at 35 s after the failing rank's stamp, for a
    loaded machine: any bound far below the 300 s timeout shows the launcher did it)."""
    stamp = tmp_path / "failed-at"
    with pytest.raises(LaunchError) as ei:
        run_local(fail_while_others_block, 3, str(stamp), timeout_s=300, grace_s=1.0)
    assert time.time() - float(stamp.read_text()) < 35
    assert "rank 0 failed: RuntimeError: CUDA error" in str(ei.value)


def test_a_stopped_rank_is_lost_after_the_timeout_not_when_it_resumes():
    """A rank stopped (SIGSTOP, a frozen host) neither fails nor exits, and a survivor blocked in
    a send to it (gloo's send to a stopped peer waits past its timeout) never reports: the
    launcher reads the heartbeats, kills the silent rank after --timeout and names it (issue 53's
    SIGSTOP fault: before, the run waited until the rank was continued)."""
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as ei:
        run_local(stop_while_others_wait, 2, timeout_s=3, grace_s=1.0)  # (grace: the survivor's moment)
    assert "rank 1 stopped responding (no heartbeat for 3 s" in str(ei.value), str(ei.value)
    assert time.monotonic() - t0 < 60  # (the survivor sleeps 300 s: the launcher ended it)


def test_graph_mode_needs_torch_2_7_for_point_to_point_merges():
    """All-reduce merges could always be captured in a CUDA graph; the point-to-point sends of
    the tree merge only from torch 2.7 on: before that, graph mode is off (and the run says so)."""
    from types import SimpleNamespace

    from treeattn_cli.engine.decode import graph_capture_ok

    tree = SimpleNamespace(world=4, uses_p2p=lambda: True)
    flat = SimpleNamespace(world=4, uses_p2p=lambda: False)
    assert not graph_capture_ok(tree, "2.6.0+cu124") and graph_capture_ok(tree, "2.7.1")
    assert graph_capture_ok(tree, "2.13.0") and graph_capture_ok(flat, "2.5.1")
    assert graph_capture_ok(SimpleNamespace(world=1, uses_p2p=lambda: True), "2.5.0")


def test_ctrl_c_while_ranks_start_leaves_none_behind(monkeypatch):
    """Ctrl-C that lands while the ranks are being started (CI caught it once, as a rank's
    traceback: the launcher exited and unlinked the result queue's semaphores before a rank had
    read them). The signal waits until every rank is started, then stops them all before
    ``run_local`` returns."""
    import multiprocessing.context
    import os
    import signal
    from multiprocessing import forkserver

    from helpers import still_running

    real_start = multiprocessing.context.ForkServerProcess.start
    started = []

    def start_then_ctrl_c(self):
        real_start(self)
        started.append(self.pid)
        if len(started) == 1:  # between rank 0's start and rank 1's
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", start_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run_local(rank_and_world, 2, timeout_s=30)
    assert len(started) == 2  # held until the start loop ended: no rank half-made
    assert forkserver._forkserver._forkserver_pid is not None
    assert not still_running(started, within=3)  # stopped by run_local, not by its 30 s timeout


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


def shard_sizes(N, world, seed):
    """Uneven sizes summing to N; rank 1 (if any) holds zero tokens."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(world, generator=g) + 0.2
    if world > 1:
        w[1] = 0
    sizes = (w / w.sum() * N).floor().long()
    sizes[0] += N - sizes.sum()
    return sizes.tolist()


def rel_err(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)), "inf pattern differs"
    return ((a - b).abs()[fin].max() / max(1.0, b.abs()[fin].max())).item() if fin.any() else 0.0


def decode_schemes(ctx, seed, groups=None):
    """Every flat scheme, hierarchical (if groups) and ring decode vs the one-rank oracle.

    Returns rows (case, method, o_err, lse_err, o_bits_digest)."""
    comms = {s: make_comm(s) for s in ("allreduce", "allgather", "tree")}
    if groups:
        for inner in ("allreduce", "tree", "allgather"):
            for outer in ("tree", "allreduce"):
                comms[f"hier-{inner}-{outer}"] = make_comm("hierarchical", groups, inner, outer)
    rows = []
    for B in (1, 3):
        for G in (1, 4):
            for dtype in (torch.float32, torch.bfloat16):
                case = f"B{B}-G{G}-{str(dtype)[6:]}"
                gen = torch.Generator().manual_seed(seed + B * 100 + G * 10 + (dtype == torch.bfloat16))
                H_kv, d, N = 2, 64, 67
                q = torch.randn(B, G * H_kv, 1, d, generator=gen).to(dtype)
                k = torch.randn(B, H_kv, N, d, generator=gen).to(dtype)
                v = torch.randn(B, H_kv, N, d, generator=gen).to(dtype)
                o_ref, lse_ref = partial_attention_ref(q, k, v)
                sizes = shard_sizes(N, ctx.world, seed)
                a = sum(sizes[: ctx.rank])
                ks, vs = k[:, :, a : a + sizes[ctx.rank]], v[:, :, a : a + sizes[ctx.rank]]
                o_i, lse_i = partial_attention(q, ks, vs)
                outs = {name: c.merge(o_i, lse_i) for name, c in comms.items()}
                outs["ring"] = ring_decode(comms["allreduce"], q, ks, vs)
                for name, (o, lse) in outs.items():
                    every = comms["allgather"].all_gather(torch.cat([o, lse[..., None]], -1))
                    same = all(torch.equal(every[0], e) for e in every)
                    rows.append((case, name, rel_err(o.to(dtype), o_ref), rel_err(lse, lse_ref), same))
    return rows


def allreduce_accounting(ctx, B, H, d):
    stats = Stats(enabled=True)
    c = make_comm("allreduce", stats=stats)
    o, lse = torch.randn(B, H, 1, d), torch.randn(B, H, 1)
    stats.reset()
    c.merge(o, lse)
    return stats.snapshot()


def ring_accounting(ctx, B, H_kv, N, d):
    stats = Stats(enabled=True)
    c = make_comm("allreduce", stats=stats)
    q, k, v = torch.randn(B, 4 * H_kv, 1, d), torch.randn(B, H_kv, N, d), torch.randn(B, H_kv, N, d)
    stats.reset()
    ring_decode(c, q, k, v, shard_lens=[N] * ctx.world)
    return stats.snapshot()


def prefill_cases(ctx, seed, lengths):
    """Ring prefill (pass-KV) of prompts of each length, balanced and contiguous pieces, with and
    without a window, vs single-device causal attention; and after a cache (the cache travelling
    with pass-KV, or the queries with pass-Q). Rows (n, sharding, window, cached, o_err, lse_err)."""
    from treeattn_cli.engine.prefill import positions, ring_pass_q, shard
    from treeattn_cli.parallel.merge import merge_pair

    c = make_comm("allreduce")
    rows = []
    for n in lengths:
        for sharding in ("balanced", "contiguous"):
            for window in (None, 5):
                for cached in (0, 1, 9):  # 1: most ranks hold no cached token
                    gen = torch.Generator().manual_seed(seed + n)
                    B, H_kv, G, d = 2, 2, 3, 64
                    N = cached + n
                    q = torch.randn(B, G * H_kv, N, d, generator=gen)
                    k = torch.randn(B, H_kv, N, d, generator=gen)
                    v = torch.randn(B, H_kv, N, d, generator=gen)
                    pos = torch.arange(N)
                    o_ref, lse_ref = partial_attention_ref(q, k, v, q_pos=pos, k_pos=pos, window=window)
                    pieces = shard(cached, n, ctx.world, balanced=sharding == "balanced")
                    mine = positions(pieces[ctx.rank])
                    cb = chunk_bounds(cached, ctx.world)  # the cache: contiguous shards of the first tokens
                    ck, cv = k[:, :, cb[ctx.rank] : cb[ctx.rank + 1]], v[:, :, cb[ctx.rank] : cb[ctx.rank + 1]]
                    lens = [cb[i + 1] - cb[i] for i in range(ctx.world)]
                    travel = cached and window is None
                    o, lse = ring_prefill(
                        c,
                        q[:, :, mine],
                        k[:, :, mine],
                        v[:, :, mine],
                        pieces,
                        window=window,
                        cache=(ck, cv) if travel else None,
                        cache_lens=lens if travel else None,
                    )
                    if cached and not travel:
                        kpos = torch.arange(cb[ctx.rank], cb[ctx.rank + 1]).expand(B, -1)
                        po, pl = ring_pass_q(
                            c, q[:, :, mine], ck, cv, torch.full((B,), ck.shape[2]), pieces, k_pos=kpos, window=window
                        )
                        o, lse = merge_pair(o, lse, po, pl)
                    err = (
                        (rel_err(o, o_ref[:, :, mine]), rel_err(lse, lse_ref[:, :, mine])) if len(mine) else (0.0, 0.0)
                    )
                    rows.append((n, sharding, window, cached, *err))
    return rows


def fail_mid_step(ctx, bad_rank, how, stamp=None):
    """Merge once fine, then ``bad_rank`` raises (or is SIGKILLed) while the others merge;
    ``stamp``: a file where it writes the time it fails (the event a deadline counts from)."""
    c = make_comm("allreduce")
    o, lse = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1)
    c.merge(o, lse)
    if ctx.rank == bad_rank:
        if stamp is not None:
            Path(stamp).write_text(repr(time.time()))
        if how == "raise":
            raise ValueError("boom in layer 3")
        os.kill(os.getpid(), signal.SIGKILL)
    c.merge(o, lse)
    c.merge(o, lse)
    return "survived"


def ring_leaves_inputs_alone(ctx, seed):
    """Ring decode must not write into the caller's K/V/lengths (they may be the cache)."""
    from treeattn_cli.parallel.comm import make_comm

    c = make_comm("allreduce")
    g = torch.Generator().manual_seed(seed + ctx.rank)
    k, v = torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    kv_len = torch.tensor([9 - ctx.rank])
    before = (k.clone(), v.clone(), kv_len.clone())
    ring_decode(
        c,
        torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(seed)),
        k,
        v,
        kv_len,
        shard_lens=[9] * ctx.world,
    )
    return all(torch.equal(a, b) for a, b in zip(before, (k, v, kv_len)))


def rank_and_world(ctx):
    return ctx.rank, ctx.world


def gather_values(ctx):
    from treeattn_cli.parallel.comm import make_comm

    return make_comm("allreduce").all_gather_values([ctx.rank, 0.5 * ctx.rank, 7]).tolist()


def agree(ctx, veto_rank):
    """``Comm.all_true``: one rank's False decides for every rank."""
    c = make_comm("allreduce")
    return c.all_true(True), c.all_true(ctx.rank != veto_rank)


def fail_while_others_block(ctx, stamp=None):
    """Rank 0 raises; the others sit still, as ranks blocked in an NCCL collective do (they
    never notice on their own before the collective timeout). ``stamp``: as in fail_mid_step."""
    if ctx.rank == 0:
        if stamp is not None:
            Path(stamp).write_text(repr(time.time()))
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    time.sleep(600)


def stop_while_others_wait(ctx):
    """Rank 1 stops itself (SIGSTOP) once the group is up; rank 0 waits as if blocked in a send."""
    import os
    import signal

    if ctx.rank == 1:  # (the group and its heartbeats are up before this function runs)
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(300)
