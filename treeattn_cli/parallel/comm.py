"""Every torch.distributed call of treeattn lives here (docs/architecture.md §3).

* process-group set-up with a timeout, failure reporting through the rendezvous store, and a
  :class:`RankFailure` that names the lost rank instead of a bare gloo/NCCL error;
* :class:`Comm`: the merge schemes over a group — ``allreduce`` (MAX, then one SUM of the
  packed ``[o·w, w]``, over 3+ ranks gathered and added in rank order: :meth:`Comm.sum_in_rank_order`),
  ``allgather`` (one all_gather, local merge), ``tree`` (explicit binary
  tree of point-to-point sends, then back down) and ``hierarchical`` (a scheme inside each group,
  one across group leaders, a broadcast back inside groups) — plus the point-to-point shift that
  the ring paths (``ring.py``) use, and token/object broadcasts;
* :class:`Stats`: collectives, bytes handed to them and peak extra memory, per step.

Every scheme returns the bit-identical merged ``(o, lse)`` (fp32) on every rank of the group, and a
row's bits never depend on the other rows of the merge (its batch).
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .merge import merge_pair, merge_partials, unweigh, weigh
from .schemes import FLAT_SCHEMES, SCHEMES

_KEY = "treeattn"
_HEARTBEAT_S = 1.0


class RankFailure(RuntimeError):
    """Another rank of the group failed or was lost; the message names it."""


@dataclass
class Stats:
    """Counters read by ``bench``. Off by default; when off every hook is one attribute test.

    ``bytes_sent`` counts the payload this rank hands to each collective or send (the size of
    the all_reduce input, the all_gather contribution, the sent tensor), not wire bytes, which
    depend on the backend's algorithm.
    """

    enabled: bool = False
    collectives: int = 0
    bytes_sent: int = 0
    peak_mem_bytes: int = 0
    flops: int = 0  # attention FLOPs this rank computed (engine/prefill.py counts them)
    by_op: dict = field(default_factory=dict)
    _live: int = 0

    def add_flops(self, n: int) -> None:
        self.flops += n

    def count(self, op: str, nbytes: int) -> None:
        self.collectives += 1
        self.bytes_sent += nbytes
        self.by_op[op] = self.by_op.get(op, 0) + 1

    def hold(self, nbytes: int) -> None:
        """Note ``nbytes`` of temporary buffers alive (negative: released)."""
        self._live += nbytes
        self.peak_mem_bytes = max(self.peak_mem_bytes, self._live)

    def reset(self) -> None:
        self.collectives = self.bytes_sent = self.peak_mem_bytes = self._live = self.flops = 0
        self.by_op = {}

    def snapshot(self) -> dict:
        return {
            "collectives": self.collectives,
            "bytes_sent": self.bytes_sent,
            "peak_mem_bytes": self.peak_mem_bytes,
            "flops": self.flops,
            "by_op": dict(self.by_op),
        }


# ---------------------------------------------------------------- process group and failures


def make_store(port: int, world: int, *, host: str = "127.0.0.1", is_master: bool, timeout_s: float):
    """The rendezvous key-value store. The master (the launcher) listens on ``host`` only, on
    ``port`` (0: a free port the OS picks; read it back from ``.port``). TCPStore's own server
    binds every interface, so the master's socket is bound here and handed over: the store's
    server owns the descriptor from then on and closes it when the store is destroyed (closing
    it here as well would close whatever later reuses the number, e.g. the next run's store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    try:
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            world,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except Exception:
        sock.close()
        raise
    sock.detach()
    return store


_state = {"store": None, "rank": 0, "world": 1, "timeout_s": 300.0, "hb": None}


def init_process_group(
    backend: str, rank: int, world: int, store, timeout_s: float, device=None, heartbeat: bool = True
) -> None:
    """Join the default group through ``store`` (a c10d Store shared by all ranks; None: the
    ``env://`` rendezvous of torchrun).

    Every collective of the group fails after ``timeout_s``; a heartbeat thread lets the
    survivors name a rank that vanished (SIGKILL, OOM kill) rather than only time out.
    """
    kw = {}
    if device is not None and getattr(device, "type", None) == "cuda":
        kw["device_id"] = device
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout, **kw)
        store = dist.distributed_c10d._get_default_store()
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)
    _state.update(store=store, rank=rank, world=world, timeout_s=timeout_s)
    if heartbeat and world > 1:
        stop = threading.Event()
        t = threading.Thread(target=_beat, args=(store, rank, stop), daemon=True, name="treeattn-heartbeat")
        t.start()
        _state["hb"] = (stop, t)


def _beat(store, rank, stop):
    while not stop.is_set():
        try:
            store.set(f"{_KEY}/hb/{rank}", repr(time.time()))
        except Exception:  # the store is gone: the run is ending
            return
        stop.wait(_HEARTBEAT_S)


def destroy_process_group() -> None:
    """Leave the group (idempotent)."""
    if _state["hb"] is not None:
        # stop the heartbeat and wait for it: a thread still inside a store call while the
        # interpreter shuts down can abort the process ("terminate called without an active
        # exception", seen under torchrun)
        stop, t = _state["hb"]
        stop.set()
        t.join(timeout=5)
        _state["hb"] = None
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def report_failure(exc: BaseException) -> None:
    """Tell the other ranks through the store why this rank is failing (best effort)."""
    store = _state["store"]
    if store is None or isinstance(exc, RankFailure):
        return
    try:
        store.set(f"{_KEY}/failed/{_state['rank']}", f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    except Exception:
        pass


def silent_ranks(store, world: int, for_s: float) -> list[int]:
    """Ranks whose heartbeat is older than ``for_s`` seconds: alive but not running (SIGSTOP, a
    frozen host), which no collective of theirs will ever report. The launcher's view, from the
    store it hosts."""
    out, now = [], time.time()
    for r in range(world):
        key = f"{_KEY}/hb/{r}"
        try:
            if store.check([key]) and now - float(store.get(key).decode()) > for_s:
                out.append(r)
        except Exception:  # noqa: BLE001 - a store going away: nothing to say
            pass
    return out


def _scan(store, me, world):
    """(failed messages, ranks whose heartbeat is stale) as seen in the store now."""
    failed, lost = [], []
    now = time.time()
    for r in range(world):
        if r == me:
            continue
        if store.check([f"{_KEY}/failed/{r}"]):
            failed.append(f"rank {r} failed: {store.get(f'{_KEY}/failed/{r}').decode()}")
        elif store.check([f"{_KEY}/hb/{r}"]):
            if now - float(store.get(f"{_KEY}/hb/{r}").decode()) > 2.5 * _HEARTBEAT_S:
                lost.append(r)
    return failed, lost


def _explain(op: str, exc: BaseException) -> RankFailure:
    """Turn a backend error into a message naming the failed or lost rank(s).

    A rank that raised wrote why to the store before exiting. One that vanished (SIGKILL)
    stops beating: the survivors watch the heartbeats for a few seconds to name it.
    """
    store, me, world = _state["store"], _state["rank"], _state["world"]
    failed, lost = [], []
    if store is not None:
        deadline = time.monotonic() + 3.5 * _HEARTBEAT_S
        try:
            while True:
                failed, lost = _scan(store, me, world)
                if failed or lost or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
        except Exception:  # the store itself is gone (the launcher died): say what we know
            pass
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    if failed:
        return RankFailure("; ".join(failed))
    if lost:
        who = ", ".join(str(r) for r in lost)
        return RankFailure(f"lost rank {who} (process gone) during {op}: {detail}")
    return RankFailure(
        f"rank {me}: {op} failed or timed out after {_state['timeout_s']:g}s waiting for the other ranks: {detail}"
    )


def _guarded(what: str, fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except RankFailure:
        raise
    except Exception as e:  # gloo/NCCL errors: timeouts, closed connections
        raise _explain(what, e) from e


# ---------------------------------------------------------------- the communicator


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """A process group and the merge scheme used on it.

    ``Comm(scheme=...)`` on the default group; :func:`make_comm` builds the sub-groups of a
    hierarchical plan. ``Comm.single()`` is the one-rank oracle (no torch.distributed at all).
    """

    def __init__(
        self,
        group=None,
        scheme: str = "allreduce",
        stats: Stats | None = None,
        inner: "Comm | None" = None,
        leaders: "Comm | None" = None,
        inner_scheme: str = "allreduce",
        outer_scheme: str = "tree",
        _single=False,
    ):
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
        self.group = group
        self.scheme = scheme
        self.eager_scheme: str | None = None  # steps not captured in a CUDA graph merge with this (fewest launches)
        self.stats = stats or Stats()
        self.inner, self.leaders = inner, leaders
        self.inner_scheme, self.outer_scheme = inner_scheme, outer_scheme
        if _single:
            self.rank, self.world, self._ranks = 0, 1, [0]
            self.device = torch.device("cpu")
        else:
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
            self._ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
            # where this group's collectives take their tensors (NCCL: only the GPU's)
            nccl = dist.get_backend(group) == "nccl"
            self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @classmethod
    def single(cls, scheme="allreduce", stats=None) -> "Comm":
        return cls(scheme=scheme, stats=stats, _single=True)

    def uses_p2p(self) -> bool:
        """Whether a merge on this communicator sends point to point (the ``tree`` scheme, at
        any level of a hierarchical merge)."""
        if self.scheme == "hierarchical":
            return any(
                c is not None and c.world > 1 and s == "tree"
                for c, s in ((self.inner, self.inner_scheme), (self.leaders, self.outer_scheme))
            )
        return self.world > 1 and self.scheme == "tree"

    # -- primitives (each counts itself) ------------------------------------------------
    def _count(self, op, t):
        if self.stats.enabled:
            self.stats.count(op, _nbytes(t))

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world == 1:
            return t
        self._count(f"all_reduce_{op}", t)
        rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        _guarded(f"all_reduce({op})", dist.all_reduce, t, op=rop, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[world, *t.shape]`` of every rank's ``t``."""
        if self.world == 1:
            return t[None]
        self._count("all_gather", t)
        out = t.new_empty(self.world * t.numel())  # flat: the form every backend accepts
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        _guarded("all_gather", gather, out, t.contiguous().view(-1), group=self.group)
        return out.view(self.world, *t.shape)

    def all_gather_values(self, values) -> torch.Tensor:
        """Every rank's list of host numbers: ``[world, len(values)]`` float64 on the host. The
        numbers travel in a tensor on this group's device (NCCL takes no CPU tensors)."""
        t = torch.tensor([float(x) for x in values], dtype=torch.float64, device=self.device)
        return self.all_gather(t).cpu()

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` is true on every rank (a decision all ranks must take together)."""
        if self.world == 1:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        return bool(self.all_reduce(t, "min")[0])

    def all_min(self, n: int) -> int:
        """The least of every rank's ``n`` (how far all ranks can go together)."""
        if self.world == 1:
            return int(n)
        t = torch.tensor([int(n)], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, "min")[0])

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place from group rank ``src``."""
        if self.world == 1:
            return t
        if self.rank == src:
            self._count("broadcast", t)
        _guarded("broadcast", dist.broadcast, t, src=self._ranks[src], group=self.group)
        return t

    def broadcast_object(self, obj, src: int = 0):
        if self.world == 1:
            return obj
        box = [obj]
        _guarded("broadcast_object", dist.broadcast_object_list, box, src=self._ranks[src], group=self.group)
        return box[0]

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._count("send", t)
        _guarded(f"send to rank {self._ranks[dst]}", dist.send, t.contiguous(), dst=self._ranks[dst], group=self.group)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        _guarded(f"recv from rank {self._ranks[src]}", dist.recv, t, src=self._ranks[src], group=self.group)
        return t

    def shift(self, send: list, recv: list, dst: int | None, src: int | None) -> "Pending":
        """Start sending ``send`` tensors to ``dst`` and receiving into ``recv`` from ``src``
        (either may be None); returns a handle whose ``wait()`` completes both."""
        ops = []
        if dst is not None:
            for t in send:
                self._count("isend", t)
                ops.append(dist.P2POp(dist.isend, t, self._ranks[dst], self.group))
        if src is not None:
            ops += [dist.P2POp(dist.irecv, t, self._ranks[src], self.group) for t in recv]
        works = _guarded("batch_isend_irecv", dist.batch_isend_irecv, ops) if ops else []
        return Pending(works)

    def barrier(self) -> None:
        if self.world > 1:
            _guarded("barrier", dist.barrier, group=self.group)

    # -- the merge schemes --------------------------------------------------------------
    def merge(self, o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor | None = None, eager: bool = False):
        """Merge this rank's partial ``(o [..., d], lse [...])`` with every other rank's.

        Returns ``(o [..., d] fp32, lse [...] fp32)``, bit-identical on every rank; with
        ``out`` (any strides and dtype, e.g. the layer's ``[B, T, H, d]`` output seen as
        ``[B, H, T, d]``) the merged ``o`` is written there and ``out`` is returned instead.
        On CUDA the ``allreduce`` scheme packs and finishes with two fused kernels, the
        ``allgather`` scheme merges in one. ``eager``: a step that is not captured in a CUDA
        graph (a verify, a step that cites, any step on a CPU), which merges with :attr:`eager_scheme`
        where one is set.
        """
        scheme = self.eager_scheme if eager and self.eager_scheme else self.scheme
        if self.world > 1 and scheme in ("allreduce", "allgather") and o.is_cuda and o.dim() == 4 and _fused():
            from treeattn_kernels.merge_triton import merge_gathered_fused, unweigh_fused, weigh_fused

            dtype = out.dtype if out is not None else torch.float32
            if scheme == "allgather":  # one collective, one launch
                every = self.all_gather(torch.cat([o.float(), lse.float()[..., None]], dim=-1))  # [p, ..., d + 1]
                return merge_gathered_fused(every, out=out, dtype=dtype)
            m = self.all_reduce(lse.float().clone(), "max")
            packed = self.sum_in_rank_order(weigh_fused(o, lse, m))  # [..., d + 1]
            return unweigh_fused(packed, m, out=out, dtype=dtype)
        if self.world == 1:
            o, lse = o.float(), lse.float()
        elif scheme == "hierarchical":
            o, lse = self._merge_hierarchical(o, lse)
        else:
            o, lse = self._merge_flat(scheme, o, lse)
        if out is not None:
            out.copy_(o)
            return out, lse
        return o, lse

    def _merge_flat(self, scheme, o, lse, to_all=True):
        if scheme == "allreduce":
            return self._merge_allreduce(o, lse)
        if scheme == "allgather":
            return self._merge_allgather(o, lse)
        return self._merge_tree(o, lse, to_all=to_all)

    def _merge_allreduce(self, o, lse):
        m = self.all_reduce(lse.float().clone(), "max")  # [...]
        packed = self.sum_in_rank_order(weigh(o, lse, m))  # [..., d + 1] = [Σ o·w, Σ w]
        return unweigh(packed, m)

    def sum_in_rank_order(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the group, each element's bits independent of the tensor's size and
        of the element's place in it (issue 49: a row's merge must not depend on its batch). Two
        ranks: one SUM all-reduce (a + b either way). More: a SUM all-reduce adds in an order its
        algorithm sets by the message's size and the element's segment of it (a ring's chunks),
        so the parts are gathered and added in rank order instead (the bytes of an all-gather)."""
        if self.world <= 2:
            return self.all_reduce(t, "sum")
        every = self.all_gather(t)  # [world, ...]
        acc = every[0].clone()
        for r in range(1, self.world):
            acc += every[r]
        return acc

    def _merge_allgather(self, o, lse):
        packed = torch.cat([o.float(), lse.float()[..., None]], dim=-1)  # [..., d + 1]
        every = self.all_gather(packed)  # [world, ..., d + 1]
        if self.stats.enabled:
            self.stats.hold(_nbytes(every))
            self.stats.hold(-_nbytes(every))
        return merge_partials(every[..., :-1], every[..., -1])

    def _merge_tree(self, o, lse, to_all=True):
        """Binary tree: at level s, rank r (r % 2s == 0) merges rank r + s's partial, left to
        right; the result of group rank 0 then travels back down the same edges."""
        p, r = self.world, self.rank
        acc = torch.cat([o.float(), lse.float()[..., None]], dim=-1)  # [..., d + 1]
        buf = torch.empty_like(acc)
        levels = [1 << i for i in range(math.ceil(math.log2(p)))]
        for s in levels:
            if r % (2 * s) == s:
                self.send(acc, r - s)
                break
            if r + s < p:
                self.recv(buf, r + s)
                mo, ml = merge_pair(acc[..., :-1], acc[..., -1], buf[..., :-1], buf[..., -1])
                acc = torch.cat([mo, ml[..., None]], dim=-1)
        if to_all:
            for s in reversed(levels):
                if r % (2 * s) == 0 and r + s < p:
                    self.send(acc, r + s)
                elif r % (2 * s) == s:
                    self.recv(acc, r - s)
        return acc[..., :-1], acc[..., -1]

    def _merge_hierarchical(self, o, lse):
        inner, leaders = self.inner, self.leaders
        if inner.world > 1:  # 1. inside my group; the leader (group rank 0) holds the result
            o, lse = inner._merge_flat(self.inner_scheme, o, lse, to_all=False)
        if leaders is not None and leaders.world > 1:  # 2. across group leaders
            o, lse = leaders._merge_flat(self.outer_scheme, o, lse)
        if inner.world == 1:
            return o.float(), lse.float()
        packed = torch.cat([o.float(), lse.float()[..., None]], dim=-1)  # 3. back inside the group
        inner.broadcast(packed, src=0)
        return packed[..., :-1], packed[..., -1]


def _fused() -> bool:
    """The Triton merge kernels can run (checked once) and are trusted (``use_reference``)."""
    from treeattn_kernels import reference_only

    if reference_only():
        return False
    if "fused" not in _state:
        try:
            from treeattn_kernels import merge_triton  # noqa: F401

            _state["fused"] = True
        except Exception:
            _state["fused"] = False
    return _state["fused"]


class Pending:
    """Handle of started point-to-point transfers."""

    def __init__(self, works):
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            _guarded("point-to-point transfer", w.wait)
        self._works = []


def subgroup(
    ranks: list[int], scheme: str = "allreduce", stats: Stats | None = None, timeout_s: float | None = None
) -> "Comm | None":
    """A communicator on ``ranks`` of the default group (every rank must call this, with the
    same ranks); None on ranks outside it."""
    timeout = datetime.timedelta(seconds=timeout_s or _state["timeout_s"])
    pg = dist.new_group(sorted(ranks), timeout=timeout)
    return Comm(pg, scheme, stats) if dist.get_rank() in ranks else None


def make_comm(
    scheme: str = "allreduce",
    groups: list[list[int]] | None = None,
    inner_scheme: str = "allreduce",
    outer_scheme: str = "tree",
    stats: Stats | None = None,
    timeout_s: float | None = None,
    parts: list[list[int]] | None = None,
    group=None,
) -> Comm:
    """The communicator of a plan (call on every rank, same arguments).

    ``parts``: disjoint lists of global ranks covering the world, each its own communicator
    (the cp groups of a (cp × tp) mesh, ``mesh.Mesh.cp_parts``); a rank gets the one it is in.
    Default: one part, the whole default group. ``group``: this rank's part as an existing
    process group (``grid_mesh``'s), so it is not created twice. A part of one rank gets no
    process group at all (``Comm.single``).
    ``groups`` (hierarchical only): a partition of a part's ranks by their index in the part,
    e.g. ``[[0, 1], [2, 3]]``; the first of each group is its leader.
    """
    flat = scheme if scheme != "hierarchical" else "allreduce"
    if not (dist.is_available() and dist.is_initialized()):
        return Comm.single(flat, stats)
    stats = stats or Stats()
    world, me = dist.get_world_size(), dist.get_rank()
    parts = [list(p) for p in (parts or [list(range(world))])]
    if sorted(r for p in parts for r in p) != list(range(world)):
        raise ValueError(f"parts {parts} must partition ranks 0..{world - 1}")
    mine = next(p for p in parts if me in p)
    if len(mine) == 1:
        return Comm.single(flat, stats)
    whole = parts == [list(range(world))]
    if scheme != "hierarchical" and whole:
        return Comm(None, scheme, stats)
    timeout = datetime.timedelta(seconds=timeout_s or _state["timeout_s"])

    def new_group(ranks):  # every rank creates every group, in the same order
        return None if ranks == list(range(world)) else dist.new_group(ranks, timeout=timeout)

    own = group
    if own is None:
        for part in parts:
            pg = new_group(part)
            if me in part:
                own = pg
    if scheme != "hierarchical":
        return Comm(own, scheme, stats)
    size = len(mine)
    groups = [list(g) for g in (groups or [list(range(size))])]
    if sorted(i for g in groups for i in g) != list(range(size)) or any(not g for g in groups):
        raise ValueError(f"hierarchical groups {groups} must partition ranks 0..{size - 1}")
    for s in (inner_scheme, outer_scheme):
        if s not in FLAT_SCHEMES:
            raise ValueError(f"inner/outer scheme must be one of {', '.join(FLAT_SCHEMES)}, not {s!r}")
    inner = leaders = None
    for part in parts:
        for g in groups:
            ranks = [part[i] for i in g]
            if len(ranks) == 1:  # a group of one: no process group
                if me in ranks:
                    inner = Comm.single(inner_scheme, stats)
                continue
            pg = new_group(ranks)
            if me in ranks:
                inner = Comm(pg, inner_scheme, stats)
        lead = [part[g[0]] for g in groups]
        if len(lead) == 1:
            if me in lead:
                leaders = Comm.single(outer_scheme, stats)
            continue
        pg = new_group(lead)
        if me in lead:
            leaders = Comm(pg, outer_scheme, stats)
    return Comm(
        own, "hierarchical", stats, inner=inner, leaders=leaders, inner_scheme=inner_scheme, outer_scheme=outer_scheme
    )


def node_of_this_rank() -> str:
    """This rank's node: torchrun's node rank where there is one (two agents on one machine
    are two nodes), else the host name."""
    import os
    import socket

    host = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    return f"{host}/{group}" if group is not None else host


def nodes_of_all_ranks() -> list[str]:
    """Every rank's node, exchanged once (``[node of rank 0, node of rank 1, ...]``)."""
    me = node_of_this_rank()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [me]
    out = [None] * dist.get_world_size()
    _guarded("all_gather_object", dist.all_gather_object, out, me)
    return out


def grid_mesh(device_type: str, cp: int, tp: int):
    """The (cp × tp) grid as a device mesh: ``(tp_mesh, cp_group)`` of this rank, each tp group
    ``T`` contiguous ranks (see mesh.py). Two process groups per rank and no more: the tensor-
    parallel one (transformers' loader shards the weights over ``tp_mesh``) and the sequence-
    shard one, which the merge reuses (``make_comm(group=...)``) instead of creating its twin."""
    from torch.distributed.device_mesh import init_device_mesh

    grid = init_device_mesh(device_type, (cp, tp), mesh_dim_names=("cp", "tp"))
    return grid["tp"], (grid.get_group("cp") if cp > 1 else None)


# ---------------------------------------------------------------- requests to a running engine


def post_request(store, seq: int, payload: dict) -> None:
    """The launcher's ``seq``-th request to the ranks of a persistent engine (JSON, through the
    rendezvous store it hosts: ranks idle between requests without sitting in a collective
    whose timeout would expire while a person types)."""
    import json

    store.set(f"{_KEY}/req/{seq}", json.dumps(payload))


def post_interrupt(store, seq: int) -> None:
    """Ask the engine to stop answering request ``seq`` (Ctrl-C in ``chat``)."""
    store.set(f"{_KEY}/int/{seq}", "1")
    store.add(f"{_KEY}/news", 1)


def news() -> int:
    """How many interrupts, joins and cancellations the launcher has posted: one look at the store
    tells rank 0 whether there is anything to read (a running batch asks once a step)."""
    store = _state["store"]
    return store.add(f"{_KEY}/news", 0) if store is not None else 0


def next_request(seq: int, poll_s: float = 0.02) -> dict:
    """Wait (as long as it takes) for the launcher's ``seq``-th request; every rank reads the
    same requests in the same order, so all stay in lock step."""
    import json

    store = _state["store"]
    key = f"{_KEY}/req/{seq}"
    try:
        while not store.check([key]):  # a non-blocking look: no timeout, no log line per poll
            time.sleep(poll_s)
        return json.loads(store.get(key))
    except Exception as e:  # the store is gone: the launcher died
        raise RankFailure(f"the launcher is gone: {str(e).splitlines()[0][:120]}") from e


def interrupted(seq: int) -> bool:
    """Whether the launcher asked to stop request ``seq`` (rank 0 checks once per token)."""
    store = _state["store"]
    return store is not None and store.check([f"{_KEY}/int/{seq}"])


def post_join(store, seq: int, j: int, questions: list) -> None:
    """The launcher's ``j``-th addition of ``questions`` to the open batch request ``seq``."""
    import json

    store.set(f"{_KEY}/batch/{seq}/join/{j}", json.dumps(questions))
    store.add(f"{_KEY}/news", 1)


def post_cancel(store, seq: int, c: int, indices: list[int]) -> None:
    """The launcher's ``c``-th cancellation: questions ``indices`` of batch ``seq`` end now."""
    import json

    store.set(f"{_KEY}/batch/{seq}/cancel/{c}", json.dumps(indices))
    store.add(f"{_KEY}/news", 1)


class BatchFeed:
    """Rank 0's view of an open batch: the joins and cancellations the launcher posted since the
    last look, in order (one key check each per step)."""

    def __init__(self, seq: int):
        self.seq, self.taken, self._cancels = seq, 0, 0

    def _next(self, kind: str, i: int):
        import json

        key = f"{_KEY}/batch/{self.seq}/{kind}/{i}"
        store = _state["store"]
        return json.loads(store.get(key)) if store is not None and store.check([key]) else None

    def joins(self) -> list:
        out = []
        while (got := self._next("join", self.taken)) is not None:
            out += got
            self.taken += 1
        return out

    def cancels(self) -> list[int]:
        out = []
        while (got := self._next("cancel", self._cancels)) is not None:
            out += got
            self._cancels += 1
        return out
