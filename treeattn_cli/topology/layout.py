"""From a Topology to a reduction layout: groups, a scheme per level, and its predicted cost.

Groups are GPUs joined by the fastest uniform link class (an NVSwitch domain, an XGMI hive, a
PCIe switch pair, a NUMA node). A uniform fabric is one flat level; a mixed one reduces inside
groups, then across group leaders, then back inside groups (``hierarchical``). The α–β model
(docs/architecture.md §3) prices each candidate with link figures from a profile (``profiles/*.yaml``);
pairs without P2P are priced as staged through host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..parallel.schemes import FLAT_SCHEMES
from .probe import GPU, LINK_CLASSES, Topology


def _profile_dir() -> Path:
    """The built-in profiles (``profiles/`` in the repository, ``treeattn_cli/profiles`` installed)."""
    from importlib import resources

    try:
        return Path(str(resources.files("treeattn_cli.profiles")))
    except (ModuleNotFoundError, TypeError):
        return Path(__file__).resolve().parents[2] / "profiles"  # treeattn_cli/topology/layout.py -> the repository


PROFILE_DIR = _profile_dir()
LINK_KEYS = set(LINK_CLASSES) | {"STAGED", "LOOPBACK"}
_TOP_KEYS = {
    "name": str,
    "description": str,
    "gpus_per_node": int,
    "memory_bandwidth_gbps": (int, float),
    "memory_gb": (int, float),
    "compute_tflops": (int, float),
    "links": dict,
    "measured": dict,
}
_LINK_FIELDS = {"alpha_us": (int, float), "bandwidth_gbps": (int, float)}


class ProfileError(ValueError):
    """A profile that cannot be used; names the file and the key."""


@dataclass
class Link:
    alpha_s: float  # per message
    beta_s: float  # per byte


@dataclass
class Profile:
    name: str
    links: dict[str, Link]
    memory_bandwidth: float | None = None  # bytes/s per device
    gpus_per_node: int | None = None
    path: str = ""
    memory_bytes: float | None = None  # device memory per GPU
    flops: float | None = None  # dense bf16 FLOP/s per GPU

    def link(self, cls: str) -> Link:
        if cls in self.links:
            return self.links[cls]
        # a class the profile does not list: price it as its nearest slower listed class
        order = list(LINK_CLASSES) + ["STAGED", "LOOPBACK"]
        for c in order[order.index(cls) if cls in order else 0 :]:
            if c in self.links:
                return self.links[c]
        return max(self.links.values(), key=lambda x: x.alpha_s)


def profile_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return PROFILE_DIR / f"{name_or_path}.yaml"


def load_profile(name_or_path: str) -> Profile:
    """Load and validate a profile (a built-in name like ``dgx-h100`` or a YAML path)."""
    path = profile_path(name_or_path)
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))
        raise ProfileError(f"profile not found: {name_or_path} (built-in: {known})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{where}: cannot read: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ProfileError(f"{where}: not valid YAML{at}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a mapping of keys, got {type(data).__name__}")
    for key, val in data.items():
        if key not in _TOP_KEYS:
            raise ProfileError(f"{where}: unknown key '{key}' (allowed: {', '.join(_TOP_KEYS)})")
        if not isinstance(val, _TOP_KEYS[key]) or isinstance(val, bool):
            raise ProfileError(f"{where}: key '{key}' must be {_tname(_TOP_KEYS[key])}, got {type(val).__name__}")
    if "links" not in data or not data["links"]:
        raise ProfileError(f"{where}: key 'links' is missing or empty")
    links = {}
    for cls, entry in data["links"].items():
        if cls not in LINK_KEYS:
            raise ProfileError(f"{where}: unknown link class 'links.{cls}' (allowed: {', '.join(sorted(LINK_KEYS))})")
        if not isinstance(entry, dict):
            raise ProfileError(f"{where}: key 'links.{cls}' must be a mapping, got {type(entry).__name__}")
        for f, val in entry.items():
            if f not in _LINK_FIELDS:
                raise ProfileError(f"{where}: unknown key 'links.{cls}.{f}' (allowed: alpha_us, bandwidth_gbps)")
            if not isinstance(val, _LINK_FIELDS[f]) or isinstance(val, bool) or not val > 0:
                raise ProfileError(f"{where}: key 'links.{cls}.{f}' must be a positive number, got {val!r}")
        for f in _LINK_FIELDS:
            if f not in entry:
                raise ProfileError(f"{where}: key 'links.{cls}.{f}' is missing")
        links[cls] = Link(entry["alpha_us"] * 1e-6, 1.0 / (entry["bandwidth_gbps"] * 1e9))
    mb = data.get("memory_bandwidth_gbps")
    mem, tf = data.get("memory_gb"), data.get("compute_tflops")
    return Profile(
        data.get("name", path.stem),
        links,
        mb * 1e9 if mb else None,
        data.get("gpus_per_node"),
        where,
        mem * 1e9 if mem else None,
        tf * 1e12 if tf else None,
    )


def _tname(t):
    t = t if isinstance(t, tuple) else (t,)
    return " or ".join(
        {"str": "a string", "int": "an integer", "float": "a number", "dict": "a mapping"}[x.__name__] for x in t
    )


# ---------------------------------------------------------------- costs (α–β)


def message_bytes(batch: int, heads: int, head_dim: int) -> dict:
    """Bytes of one merge per layer: the lse (MAX) and the packed partial ``[o·w, w]`` (fp32)."""
    return {"lse": 4 * batch * heads, "packed": 4 * batch * heads * (head_dim + 1)}


def ring_allreduce_s(p: int, m: int, link: Link) -> float:
    return 0.0 if p <= 1 else 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * m * link.beta_s


def tree_rounds(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def scheme_cost_s(scheme: str, p: int, msg: dict, link: Link, to_all: bool = True) -> float:
    """One merge on p ranks joined by ``link``."""
    if p <= 1:
        return 0.0
    m = msg["packed"]
    if scheme == "allreduce":  # over 3+ ranks its SUM is gathered, added in rank order (comm.sum_in_rank_order)
        return ring_allreduce_s(p, msg["lse"], link) + (
            ring_allreduce_s(p, m, link) if p <= 2 else (p - 1) * (link.alpha_s + m * link.beta_s)
        )
    if scheme == "allgather":
        return (p - 1) * (link.alpha_s + m * link.beta_s)
    if scheme == "tree":
        return (2 if to_all else 1) * tree_rounds(p) * (link.alpha_s + m * link.beta_s)
    raise ValueError(scheme)


def ring_decode_s(
    p: int, seq_len: int, kv_heads: int, head_dim: int, batch: int, dtype_bytes: int, link: Link
) -> float:
    """Ring attention decode: p-1 steps each moving one KV shard."""
    s_kv = 2 * batch * (seq_len / p) * kv_heads * head_dim * dtype_bytes
    return (p - 1) * (link.alpha_s + s_kv * link.beta_s)


# ---------------------------------------------------------------- grouping and choice


@dataclass
class Layout:
    groups: list[list[int]]
    scheme: str  # allreduce | allgather | tree | hierarchical
    inner: str | None = None
    outer: str | None = None
    inner_link: str = ""
    outer_link: str = ""
    per_layer_s: float = 0.0
    step_s: float = 0.0
    candidates: dict = field(default_factory=dict)  # name -> per-layer seconds

    def to_dict(self) -> dict:
        return {
            "groups": self.groups,
            "scheme": self.scheme,
            "inner": self.inner,
            "outer": self.outer,
            "inner_link": self.inner_link,
            "outer_link": self.outer_link,
            "predicted_step_us": self.step_s * 1e6,
            "predicted_layer_us": self.per_layer_s * 1e6,
            "candidates_us": {k: v * 1e6 for k, v in self.candidates.items()},
        }


def _rank(cls: str) -> int:
    return LINK_CLASSES.index(cls) if cls in LINK_CLASSES else len(LINK_CLASSES)


def effective_links(topo: Topology) -> list[list[str]]:
    """Link classes with pairs lacking P2P replaced by STAGED (host memory)."""
    out = [row[:] for row in topo.links]
    for i in range(topo.n):
        for j in range(topo.n):
            if i != j and topo.p2p and topo.p2p[i][j] is False and out[i][j] not in ("NVLINK", "NVSWITCH", "XGMI"):
                out[i][j] = "STAGED"
    return out


def find_groups(links: list[list[str]]) -> list[list[int]]:
    """Groups joined by the fastest uniform link class, or one group if the fabric is uniform."""
    n = len(links)
    classes = {links[i][j] for i in range(n) for j in range(n) if i != j}
    if len(classes) <= 1:
        return [list(range(n))]
    for cls in sorted(classes, key=_rank):
        comps = _components(n, lambda i, j: _rank(links[i][j]) <= _rank(cls))
        if (
            len(comps) > 1
            and any(len(c) > 1 for c in comps)
            and all(len({links[a][b] for a in c for b in c if a != b}) <= 1 for c in comps)
        ):
            return comps
    return [list(range(n))]


def _components(n, joined):
    seen, comps = set(), []
    for s in range(n):
        if s in seen:
            continue
        stack, comp = [s], []
        seen.add(s)
        while stack:
            i = stack.pop()
            comp.append(i)
            for j in range(n):
                if j not in seen and joined(i, j):
                    seen.add(j)
                    stack.append(j)
        comps.append(sorted(comp))
    return sorted(comps)


def _slowest(links, members):
    cls = [links[a][b] for a in members for b in members if a != b]
    return max(cls, key=_rank) if cls else "X"


def choose_layout(
    topo: Topology, profile: Profile, *, batch=1, heads=32, head_dim=128, layers=32, nranks: int | None = None
) -> Layout:
    """The cheapest layout for a decode step of ``layers`` merges of the given shape."""
    msg = message_bytes(batch, heads, head_dim)
    if topo.n == 0:  # CPU ranks: a uniform loopback fabric
        n = nranks or topo.cpu_ranks or 1
        links = [["X" if i == j else "LOOPBACK" for j in range(n)] for i in range(n)]
    else:
        links = effective_links(topo)
        n = topo.n
    groups = find_groups(links)
    cands = {}
    flat_link = _slowest(links, range(n))
    for s in FLAT_SCHEMES:
        cands[s] = scheme_cost_s(s, n, msg, profile.link(flat_link)) if n > 1 else 0.0
    best_flat = min(FLAT_SCHEMES, key=lambda s: cands[s])
    if len(groups) == 1:
        lay = Layout(groups, best_flat, inner_link=flat_link, per_layer_s=cands[best_flat])
    else:
        g_link = max((_slowest(links, g) for g in groups if len(g) > 1), key=_rank)
        leaders = [g[0] for g in groups]
        l_link = _slowest(links, leaders)
        gmax = max(len(g) for g in groups)
        best = None
        for inner in FLAT_SCHEMES:
            for outer in FLAT_SCHEMES:
                t = (
                    scheme_cost_s(inner, gmax, msg, profile.link(g_link), to_all=False)
                    + scheme_cost_s(outer, len(groups), msg, profile.link(l_link))
                    + tree_rounds(gmax) * (profile.link(g_link).alpha_s + msg["packed"] * profile.link(g_link).beta_s)
                )
                cands[f"hierarchical({inner},{outer})"] = t
                if best is None or t < best[0]:
                    best = (t, inner, outer)
        t, inner, outer = best
        lay = Layout(groups, "hierarchical", inner, outer, g_link, l_link, per_layer_s=t)
    lay.candidates = cands
    lay.step_s = lay.per_layer_s * layers
    return lay


def default_profile_for(topo: Topology) -> str:
    """A built-in profile matching the fabric: the best-known figures for its link classes."""
    if topo.n == 0:
        return "cpu-gloo"
    classes = {c for row in topo.links for c in row if c != "X"}
    if classes & {"NVSWITCH", "NVLINK"}:
        return "dgx-h100"
    if "XGMI" in classes:
        return "mi300x"
    return "rtx4090-pcie"


def sub_topology(topo: Topology, n: int) -> Topology:
    """The first ``n`` GPUs of ``topo`` (the devices a run of ``n`` ranks uses)."""
    if topo.n <= n:
        return topo
    return Topology(
        topo.gpus[:n],
        [r[:n] for r in topo.links[:n]],
        [r[:n] for r in topo.nvlinks[:n]],
        [r[:n] for r in topo.p2p[:n]],
        topo.source,
        topo.notes,
        topo.cpu_ranks,
    )


def select_topology(topo: Topology, idx: list[int]) -> Topology:
    """The GPUs ``idx`` of ``topo`` (e.g. one cp group of a (cp x tp) mesh), in that order."""
    pick = lambda rows: [[rows[i][j] for j in idx] for i in idx] if rows else rows  # noqa: E731
    return Topology(
        [topo.gpus[i] for i in idx],
        pick(topo.links),
        pick(topo.nvlinks),
        pick(topo.p2p),
        topo.source,
        topo.notes,
        topo.cpu_ranks,
    )


def plan_for_run(
    kind: str,
    nranks: int,
    *,
    heads: int,
    head_dim: int,
    layers: int,
    profile: str | None = None,
    topo: Topology | None = None,
) -> Layout:
    """The layout ``generate``/``bench`` use for ``nranks`` ranks on ``kind`` devices: the same
    choice ``treeattn topo`` prints. CPU ranks: a flat loopback fabric."""
    from .probe import cpu_topology, probe

    if topo is None:
        topo = probe(cpu_ranks=nranks) if kind == "cuda" else cpu_topology(nranks)
    topo = sub_topology(topo, nranks) if topo.n else cpu_topology(nranks)
    prof = load_profile(profile or default_profile_for(topo))
    return choose_layout(topo, prof, heads=heads, head_dim=head_dim, layers=layers, nranks=nranks)


def cp_layout(
    mesh,
    nodes: list[str],
    profile: str | None,
    *,
    heads: int,
    head_dim: int,
    layers: int,
    intra: str = "LOOPBACK",
    batch: int = 1,
):
    """The merge layout of the cp groups of ``mesh`` (``parallel.mesh.Mesh``) whose ranks span nodes
    (``nodes[r]``: rank r's node), in cp-local indices: links inside a node are ``intra`` (the
    local fabric's class), across nodes the profile's ``NET``; the cost model picks a flat
    scheme or hierarchical (inside nodes, then across leaders).
    Every rank computes the same layout (its inputs are the same everywhere)."""
    ranks = mesh.cp_ranks(0)  # every cp group has the same node pattern (tp groups sit in nodes)
    where = [nodes[r] for r in ranks]
    n = len(ranks)
    links = [["X" if i == j else (intra if where[i] == where[j] else "NET") for j in range(n)] for i in range(n)]
    topo = Topology(
        [GPU(i) for i in range(n)], links, [[0] * n for _ in range(n)], [[True] * n for _ in range(n)], "nodes"
    )
    prof = load_profile(profile or ("cpu-gloo" if intra == "LOOPBACK" else "dgx-h100"))
    return choose_layout(topo, prof, batch=batch, heads=heads // mesh.tp, head_dim=head_dim, layers=layers)
