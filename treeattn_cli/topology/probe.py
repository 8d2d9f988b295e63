"""Probe the machine's interconnect into one :class:`Topology`; parse saved tool outputs.

Sources, best first: NVML (``nvidia-ml-py``), ``nvidia-smi topo -m`` (+ ``topo -p2p r``),
``amdsmi``, ``rocm-smi --showtopo``. Each failure degrades to the next source with a note;
with none of them the topology says "no GPU found" and describes CPU ranks instead. Never
imported by the decode path: ``layout.py`` turns a Topology into a plan.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field

# Link classes, fastest first. NET: between machines.
LINK_CLASSES = ("NVSWITCH", "NVLINK", "XGMI", "PIX", "PXB", "PHB", "NODE", "SYS", "NET")
_SMI_TIMEOUT_S = 10


class TopologyError(ValueError):
    """Saved tool output that cannot be parsed; one line for the user."""


@dataclass
class GPU:
    index: int
    name: str = ""
    bus_id: str = ""
    numa: int | None = None


@dataclass
class Topology:
    """GPUs and, for every pair, the link class (``"X"`` on the diagonal), the NVLink count
    (0 if none) and P2P support (None: unknown)."""

    gpus: list[GPU] = field(default_factory=list)
    links: list[list[str]] = field(default_factory=list)
    nvlinks: list[list[int]] = field(default_factory=list)
    p2p: list[list[bool | None]] = field(default_factory=list)
    source: str = "none"
    notes: list[str] = field(default_factory=list)
    cpu_ranks: int = 0  # with no GPU: how many CPU ranks a run would use

    @property
    def n(self) -> int:
        return len(self.gpus)

    def to_dict(self) -> dict:
        return asdict(self)


def _square(n, fill):
    return [
        [("X" if fill == "link" else fill) if i == j else (None if fill == "link" else fill) for j in range(n)]
        for i in range(n)
    ]


def _finish(gpus, links, nvlinks=None, p2p=None, source="", notes=None) -> Topology:
    n = len(gpus)
    nvlinks = nvlinks or [[0] * n for _ in range(n)]
    p2p = p2p or [[None if i != j else True for j in range(n)] for i in range(n)]
    _promote_nvswitch(links, nvlinks)
    return Topology(gpus, links, nvlinks, p2p, source, list(notes or []))


def _promote_nvswitch(links, nvlinks):
    """All pairs of more than 4 GPUs on NVLink with one link count: an NVSwitch fabric
    (NV# then counts links into the switch, not links dedicated to the pair; no direct
    all-to-all NVLink mesh exists beyond 4 GPUs)."""
    n = len(links)
    off = [(i, j) for i in range(n) for j in range(n) if i != j]
    if n > 4 and off and all(links[i][j] == "NVLINK" for i, j in off) and len({nvlinks[i][j] for i, j in off}) == 1:
        for i, j in off:
            links[i][j] = "NVSWITCH"


# ---------------------------------------------------------------- nvidia-smi topo -m

_NV_CELL = re.compile(r"^NV(\d+)$")
_PCI_CELLS = {"PIX", "PXB", "PHB", "NODE", "SYS", "SOC"}  # SOC: older drivers' name for SYS


def _cell_class(cell: str):
    m = _NV_CELL.match(cell)
    if m:
        return "NVLINK", int(m.group(1))
    if cell in _PCI_CELLS:
        return ("SYS" if cell == "SOC" else cell), 0
    if cell == "X":
        return "X", 0
    return None, 0


def parse_nvidia_smi_topo(text: str) -> Topology:
    """Parse ``nvidia-smi topo -m`` output: TAB or space aligned, NIC columns or raw
    ``mlx5_N`` headers, with or without CPU/NUMA affinity and ``GPU NUMA ID`` columns."""
    lines = [ln.rstrip("\n") for ln in text.splitlines()]
    header_i = next((i for i, ln in enumerate(lines) if _is_header(ln.split())), None)
    if header_i is None:
        raise TopologyError("no GPU matrix header (a line of GPU0 GPU1 ...) found")
    head = lines[header_i].split()
    gpu_cols = [t for t in head if re.fullmatch(r"GPU\d+", t)]
    ng = len(gpu_cols)
    if [int(c[3:]) for c in gpu_cols] != list(range(ng)):
        raise TopologyError("GPU columns are not GPU0..GPUn in order")
    rows = {}
    for ln in lines[header_i + 1 :]:
        tok = ln.split()
        if not tok:
            if rows:
                break
            continue
        if tok[0] in ("Legend:", "NIC"):
            break
        if re.fullmatch(r"GPU\d+", tok[0]):
            rows[int(tok[0][3:])] = tok[1:]
    if sorted(rows) != list(range(ng)):
        raise TopologyError(f"expected rows GPU0..GPU{ng - 1}, found {sorted(rows)}")
    links = [[None] * ng for _ in range(ng)]
    nvl = [[0] * ng for _ in range(ng)]
    gpus = []
    for i in range(ng):
        cells = rows[i]
        if len(cells) < ng:
            raise TopologyError(f"row GPU{i} has {len(cells)} cells for {ng} GPUs")
        for j in range(ng):
            cls, count = _cell_class(cells[j])
            if cls is None:
                raise TopologyError(f"unknown link '{cells[j]}' between GPU{i} and GPU{j}")
            if (cls == "X") != (i == j):
                raise TopologyError(f"bad diagonal at GPU{i}/GPU{j}: '{cells[j]}'")
            links[i][j], nvl[i][j] = cls, count
        gpus.append(GPU(i, numa=_numa_from_cells(cells[ng:])))
    for i in range(ng):
        for j in range(ng):
            if links[i][j] != links[j][i]:
                raise TopologyError(f"matrix not symmetric at GPU{i}/GPU{j}")
    return _finish(gpus, links, nvl, source="nvidia-smi topo -m")


def _is_header(tok: list[str]) -> bool:
    """The header names GPU0 followed by another column name; a data row GPU0 by a link cell."""
    if "GPU0" not in tok:
        return False
    k = tok.index("GPU0")
    return k + 1 >= len(tok) or _cell_class(tok[k + 1])[0] is None


def _numa_from_cells(rest: list[str]):
    """After the GPU (and NIC) link cells: CPU affinity, NUMA affinity, GPU NUMA ID."""
    rest = [c for c in rest if not _cell_class(c)[0]]  # drop NIC link cells
    for c in rest[1:2]:  # NUMA affinity: "0", "0-1", "N/A"
        if re.fullmatch(r"\d+", c):
            return int(c)
    return None


def parse_nvidia_smi_p2p(text: str, n: int):
    """``nvidia-smi topo -p2p r``: a GPU matrix of OK / CNS / GNS / TNS / NS / DR / U."""
    p2p = [[None] * n for _ in range(n)]
    for ln in text.splitlines():
        tok = ln.split()
        if tok and re.fullmatch(r"GPU\d+", tok[0]) and len(tok) >= n + 1:
            i = int(tok[0][3:])
            if i < n:
                for j, c in enumerate(tok[1 : n + 1]):
                    p2p[i][j] = True if c in ("OK", "X") else False if c in ("CNS", "GNS", "TNS", "NS", "DR") else None
    return p2p


# ---------------------------------------------------------------- rocm-smi --showtopo


def parse_rocm_smi_topo(text: str) -> Topology:
    """Parse ``rocm-smi --showtopo``: weight, hops and link-type matrices plus NUMA lines.
    XGMI pairs are XGMI; PCIe pairs are NODE within a NUMA node and SYS across nodes."""
    sections = {}
    current = None
    for ln in text.splitlines():
        s = ln.strip()
        if s.startswith("=") and s.endswith("="):
            title = s.strip("= ").lower()
            current = (
                "weight"
                if "weight" in title
                else "hops"
                if "hops" in title
                else "type"
                if "link type" in title
                else "numa"
                if "numa" in title
                else None
            )
            if current:
                sections[current] = []
            continue
        if current and s:
            sections[current].append(s)
    if "type" not in sections:
        raise TopologyError("no 'Link Type between two GPUs' section found")

    def matrix(rows):
        head = [t for t in rows[0].split() if re.fullmatch(r"GPU\d+", t)]
        out = {}
        for r in rows[1:]:
            tok = r.split()
            if tok and re.fullmatch(r"GPU\d+", tok[0]):
                out[int(tok[0][3:])] = tok[1 : 1 + len(head)]
        return len(head), out

    n, types = matrix(sections["type"])
    if n == 0 or sorted(types) != list(range(n)):
        raise TopologyError("link-type matrix rows do not match its GPU columns")
    _, weights = matrix(sections["weight"]) if "weight" in sections else (0, {})
    numa = {}
    for r in sections.get("numa", []):
        m = re.match(r"GPU\[(\d+)\].*Numa Node:\s*(-?\d+)", r)
        if m:
            numa[int(m.group(1))] = int(m.group(2))
    gpus = [GPU(i, numa=numa.get(i)) for i in range(n)]
    links = [[None] * n for _ in range(n)]
    notes = []
    for i in range(n):
        for j in range(n):
            c = types[i][j].upper()
            if i == j:
                links[i][j] = "X"
            elif c == "XGMI":
                links[i][j] = "XGMI"
                w = weights.get(i, [None] * n)[j]
                if w is not None and w.isdigit() and int(w) > 15:
                    notes.append(f"GPU{i}-GPU{j}: XGMI over {int(w) // 15} hops (weight {w})")
            elif c == "PCIE":
                same = gpus[i].numa is not None and gpus[i].numa == gpus[j].numa
                links[i][j] = "NODE" if same else "SYS"
            else:
                raise TopologyError(f"unknown link type '{types[i][j]}' between GPU{i} and GPU{j}")
    return _finish(gpus, links, source="rocm-smi --showtopo", notes=notes[:4])


def parse_topo_text(text: str) -> Topology:
    """Detect the format of saved tool output and parse it."""
    if not text.strip():
        raise TopologyError("the file is empty")
    if "Link Type between two GPUs" in text or "ROCm System Management" in text:
        return parse_rocm_smi_topo(text)
    if re.search(r"(^|\s)GPU0(\s|$)", text):
        return parse_nvidia_smi_topo(text)
    raise TopologyError("not the output of 'nvidia-smi topo -m' or 'rocm-smi --showtopo'")


# ---------------------------------------------------------------- live probes


def _probe_nvml(notes):
    import pynvml as nv  # optional dependency: nvidia-ml-py

    nv.nvmlInit()
    try:
        n = nv.nvmlDeviceGetCount()
        if n == 0:
            raise RuntimeError("NVML sees no GPU")
        hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        gpus = []
        bus = []
        for i, h in enumerate(hs):
            b = nv.nvmlDeviceGetPciInfo(h).busId
            b = (b.decode() if isinstance(b, bytes) else b).lower()
            bus.append(_norm_bus(b))
            try:
                numa = nv.nvmlDeviceGetNumaNodeId(h)
            except Exception:
                numa = None
            gpus.append(GPU(i, nv.nvmlDeviceGetName(h), bus[-1], numa))
        links = _square(n, "link")
        nvl = [[0] * n for _ in range(n)]
        p2p = [[True if i == j else None for j in range(n)] for i in range(n)]
        switch = [False] * n
        for i, h in enumerate(hs):
            for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if nv.nvmlDeviceGetNvLinkState(h, link) != 1:
                        continue
                except Exception:
                    continue
                try:
                    if nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) == 2:
                        switch[i] = True
                        continue
                except Exception:
                    pass
                try:
                    rb = nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
                    rb = _norm_bus((rb.decode() if isinstance(rb, bytes) else rb).lower())
                    if rb in bus:
                        nvl[i][bus.index(rb)] += 1
                except Exception:
                    continue
        levels = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                if switch[i] and switch[j]:
                    links[i][j] = "NVSWITCH"
                elif nvl[i][j]:
                    links[i][j] = "NVLINK"
                else:
                    links[i][j] = levels.get(int(nv.nvmlDeviceGetTopologyCommonAncestor(hs[i], hs[j])), "SYS")
                try:  # NVML_P2P_CAPS_INDEX_READ is the tuple (0,) in nvidia-ml-py: pass the int
                    p2p[i][j] = nv.nvmlDeviceGetP2PStatus(hs[i], hs[j], 0) == 0
                except Exception:
                    pass
        topo = _finish(gpus, links, nvl, p2p, source="nvml", notes=notes)
        return topo
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass


def _norm_bus(b: str) -> str:
    """``00000000:18:00.0`` / ``0000:18:00.0`` -> ``0000:18:00.0``."""
    dom, _, rest = b.partition(":")
    return f"{int(dom, 16):04x}:{rest}" if rest else b


def _run(cmd):
    """A tool's stdout, without a shell and with a timeout; raises on any failure."""
    exe = shutil.which(cmd[0])
    if exe is None:
        raise FileNotFoundError(f"{cmd[0]} not found")
    r = subprocess.run(
        [exe, *cmd[1:]], capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, shell=False, check=False
    )
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[:120]}")
    return r.stdout


def _probe_nvidia_smi(notes):
    topo = parse_nvidia_smi_topo(_run(["nvidia-smi", "topo", "-m"]))
    try:
        topo.p2p = parse_nvidia_smi_p2p(_run(["nvidia-smi", "topo", "-p2p", "r"]), topo.n)
    except Exception as e:
        notes.append(f"nvidia-smi topo -p2p r: {_short(e)}")
    try:
        names = _run(["nvidia-smi", "--query-gpu=index,name,pci.bus_id", "--format=csv,noheader"])
        for line in names.splitlines():
            idx, name, b = [x.strip() for x in line.split(",")[:3]]
            if int(idx) < topo.n:
                topo.gpus[int(idx)].name, topo.gpus[int(idx)].bus_id = name, _norm_bus(b.lower())
    except Exception as e:
        notes.append(f"nvidia-smi --query-gpu: {_short(e)}")
    topo.notes = notes + topo.notes
    return topo


def _probe_amdsmi(notes):
    import amdsmi as a  # raises KeyError (not ImportError) without libamd_smi.so

    a.amdsmi_init()
    try:
        hs = a.amdsmi_get_processor_handles()
        if not hs:
            raise RuntimeError("amdsmi sees no GPU")
        n = len(hs)
        gpus = [
            GPU(i, "AMD GPU", str(a.amdsmi_get_gpu_device_bdf(h)).lower(), a.amdsmi_topo_get_numa_node_number(h))
            for i, h in enumerate(hs)
        ]
        links = _square(n, "link")
        p2p = [[True if i == j else None for j in range(n)] for i in range(n)]
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                t = a.amdsmi_topo_get_link_type(hs[i], hs[j])
                kind = int(t["type"]) if isinstance(t, dict) else int(t)
                if kind == 2:
                    links[i][j] = "XGMI"
                else:
                    same = gpus[i].numa is not None and gpus[i].numa == gpus[j].numa
                    links[i][j] = "NODE" if same else "SYS"
                try:
                    p2p[i][j] = bool(a.amdsmi_is_P2P_accessible(hs[i], hs[j]))
                except Exception:
                    pass
        return _finish(gpus, links, p2p=p2p, source="amdsmi", notes=notes)
    finally:
        try:
            a.amdsmi_shut_down()
        except Exception:
            pass


def _probe_rocm_smi(notes):
    topo = parse_rocm_smi_topo(_run(["rocm-smi", "--showtopo"]))
    topo.notes = notes + topo.notes
    return topo


PROBES = (
    ("nvml", _probe_nvml),
    ("nvidia-smi", _probe_nvidia_smi),
    ("amdsmi", _probe_amdsmi),
    ("rocm-smi", _probe_rocm_smi),
)


def _short(e: BaseException) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {s}"[:160] if s else type(e).__name__


def probe(cpu_ranks: int = 2) -> Topology:
    """The best topology any source gives; never raises. No source: "no GPU found"."""
    notes: list[str] = []
    for name, fn in PROBES:
        try:
            return fn(notes)
        except BaseException as e:  # noqa: BLE001 - KeyError from amdsmi, NVMLError_*, timeouts
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            notes.append(f"{name}: {_short(e)}")
    notes.append("no GPU found")
    return Topology(source="none", notes=notes, cpu_ranks=cpu_ranks)


def cpu_topology(nranks: int) -> Topology:
    """CPU ranks as a uniform fabric (shared memory, loopback gloo): one flat level."""
    return Topology(source="cpu", cpu_ranks=nranks, notes=["CPU ranks over gloo (loopback)"])
