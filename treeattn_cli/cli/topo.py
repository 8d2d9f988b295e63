"""``treeattn topo``: probe (or parse a saved tool output), optionally measure, choose the layout.

The layout printed here is the one ``generate --scheme auto`` uses (``layout.plan_for_run``).
"""

from __future__ import annotations

import datetime
import platform
import statistics
from dataclasses import dataclass

from ..topology import layout as L
from ..topology.probe import TopologyError, cpu_topology, parse_topo_text, probe


@dataclass
class TopoOptions:
    from_file: str | None = None
    profile: str | None = None
    measure: bool = False
    save: str | None = None
    nproc: int | None = None
    batch: int = 1
    heads: int = 32
    head_dim: int = 128
    layers: int = 32
    iters: int = 20
    warmup: int = 5
    timeout: float = 120.0
    tp: int = 1  # tensor-parallel ranks per sequence shard: the merge runs over cp groups


def load_topology(o: TopoOptions):
    if o.from_file is None:
        return probe(cpu_ranks=o.nproc or 2)
    try:
        with open(o.from_file, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise TopologyError(f"file not found: {o.from_file}") from None
    except OSError as e:
        raise TopologyError(f"cannot read {o.from_file}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TopologyError(f"{o.from_file}: not text") from None
    try:
        topo = parse_topo_text(text)
    except TopologyError as e:
        raise TopologyError(f"{o.from_file}: {e}") from None
    topo.source = f"{topo.source} (file {o.from_file})"
    return topo


def measure(topo, o: TopoOptions, groups):
    """Measured (per-class link figures, raw) on this machine's ranks."""
    import torch

    from ..parallel.launch import run_local
    from ..topology.layout import message_bytes
    from ..topology.measure import measure_rank, pair_links

    if o.from_file:
        raise ValueError("--measure measures this machine: it cannot be combined with --from-file")
    if topo.n:
        n = o.nproc or topo.n
        if n > torch.cuda.device_count():
            raise ValueError(f"--nproc {n}: only {torch.cuda.device_count()} CUDA devices visible")
        devices, backend = [f"cuda:{i}" for i in range(n)], "nccl"
    else:
        n = o.nproc or 2
        devices, backend = ["cpu"] * n, "gloo"
    if n < 2:
        raise ValueError("--measure needs at least 2 ranks (--nproc)")
    msg = sum(message_bytes(o.batch, o.heads, o.head_dim).values())
    big = 64 << 20 if topo.n else 8 << 20
    res = run_local(
        measure_rank, n, groups, msg, big, o.iters, o.warmup, backend=backend, devices=devices, timeout_s=o.timeout
    )[0]
    per_pair = pair_links(res["pairs"], msg, big)
    by_class: dict[str, list] = {}
    for key, (alpha, bw) in per_pair.items():
        i, j = map(int, key.split("-"))
        cls = L.effective_links(topo)[i][j] if topo.n else "LOOPBACK"
        by_class.setdefault(cls, []).append((alpha, bw))
    links = {
        c: {
            "alpha_us": round(statistics.median(a for a, _ in v) * 1e6, 2),
            "bandwidth_gbps": round(statistics.median(b for _, b in v) / 1e9, 3),
        }
        for c, v in by_class.items()
    }
    return links, {
        "pairs": {k: {"alpha_us": a * 1e6, "bandwidth_gbps": b / 1e9} for k, (a, b) in per_pair.items()},
        "allreduce_us": {k: (v * 1e6 if v is not None else None) for k, v in res["allreduce_s"].items()},
        "nproc": n,
        "backend": backend,
        "message_bytes": msg,
    }


def save_profile(path: str, links: dict, raw: dict, base: L.Profile) -> None:
    import yaml

    from ..paths import write_atomic

    doc = {
        "name": f"measured-{platform.node() or 'host'}",
        "description": f"measured by treeattn topo --measure on {platform.node()} "
        f"({raw['nproc']} ranks, {raw['backend']})",
        "links": links,
        "measured": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "allreduce_us": raw["allreduce_us"],
            "message_bytes": raw["message_bytes"],
        },
    }
    if base.memory_bandwidth:
        doc["memory_bandwidth_gbps"] = base.memory_bandwidth / 1e9
    header = (
        "# Interconnect profile measured on this machine (treeattn topo --measure).\n"
        "# alpha: one-way latency of a merge-sized message; bandwidth: of a large message.\n"
    )
    write_atomic(path, header + yaml.safe_dump(doc, sort_keys=False))
    L.load_profile(path)  # what we wrote must load


def topo_command(o: TopoOptions) -> dict:
    """The record ``treeattn topo`` prints: topology, profile, chosen layout (and measurements)."""
    from ..parallel.mesh import Mesh

    topo = load_topology(o)
    nranks = o.nproc or (topo.n if topo.n else 2)
    if o.tp < 1 or nranks % o.tp or o.heads % o.tp:
        raise ValueError(f"--tp {o.tp} must divide --nproc ({nranks}) and --heads ({o.heads})")
    mesh = Mesh(nranks, o.tp)
    cp_ranks = mesh.cp_ranks(0)  # the merge runs over each cp group; they all look alike
    view = L.sub_topology(topo, nranks) if topo.n else cpu_topology(mesh.cp)
    if topo.n and o.tp > 1:
        view = L.select_topology(view, cp_ranks)
    if not topo.n:
        view.notes = topo.notes + view.notes
    profile = L.load_profile(o.profile or L.default_profile_for(view))
    kw = dict(batch=o.batch, heads=o.heads // o.tp, head_dim=o.head_dim, layers=o.layers, nranks=mesh.cp)
    lay = L.choose_layout(view, profile, **kw)
    record = {
        "gpus": [vars(g) for g in topo.gpus],
        "links": topo.links,
        "nvlinks": topo.nvlinks,
        "p2p": topo.p2p,
        "groups": lay.groups,
        "scheme": lay.scheme,
        "source": topo.source,
        "notes": topo.notes,
        "cpu_ranks": 0 if topo.n else nranks,
        "profile": profile.name,
        "profile_path": profile.path,
        "layout": lay.to_dict(),
        "shape": {"batch": o.batch, "heads": o.heads, "head_dim": o.head_dim, "layers": o.layers},
        "tp": o.tp,
        "cp": mesh.cp,
        "tp_groups": [mesh.tp_ranks(c) for c in range(mesh.cp)],
        "cp_groups": mesh.cp_parts(),
    }
    if o.measure:
        if o.tp > 1:
            raise ValueError("--measure measures the fabric of all ranks: leave out --tp")
        links, raw = measure(view, o, lay.groups)
        record["measured"] = raw
        measured = L.Profile(
            "measured",
            {c: L.Link(v["alpha_us"] * 1e-6, 1 / (v["bandwidth_gbps"] * 1e9)) for c, v in links.items()},
            profile.memory_bandwidth,
        )
        lay = L.choose_layout(view, measured, **kw)
        record.update(groups=lay.groups, scheme=lay.scheme, layout=lay.to_dict(), profile="measured")
        if o.save:
            save_profile(o.save, links, raw, profile)
            record["saved"] = o.save
    elif o.save:
        raise ValueError("--save writes a measured profile: add --measure")
    return record
