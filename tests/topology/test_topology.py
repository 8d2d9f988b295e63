"""topo: parsers on saved tool outputs, layouts, profiles, probes with every source mocked."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from treeattn_cli.topology import layout as L
from treeattn_cli.topology import probe as T

from helpers import assert_usage_error, cli

FIX = Path(__file__).parents[1] / "fixtures" / "topology"
TREEATTN = str(Path(sys.executable).with_name("treeattn"))


def parse(name):
    return T.parse_topo_text((FIX / name).read_text())


def plan(topo, profile=None):
    return L.choose_layout(topo, L.load_profile(profile or L.default_profile_for(topo)))


# fixture, n, a link, groups, scheme
GOLDEN = [
    ("nvswitch_8x_h100_tabs.txt", 8, (0, 7, "NVSWITCH"), [list(range(8))], "tree"),
    ("nvswitch_8x_a100_spaces_mlx.txt", 8, (3, 4, "NVSWITCH"), [list(range(8))], "tree"),
    ("pcie_8x_pix_pxb_sys.txt", 8, (0, 2, "PXB"), [[0, 1], [2, 3], [4, 5], [6, 7]], "hierarchical"),
    ("pcie_8x4090_all_sys.txt", 8, (1, 5, "SYS"), [list(range(8))], "tree"),
    ("pcie_5x_phb_node_sys_spaces.txt", 5, (1, 3, "NODE"), [[0], [1, 2], [3, 4]], "hierarchical"),
    ("nvlink_2x_bridge.txt", 2, (0, 1, "NVLINK"), [[0, 1]], None),
    ("single_gpu.txt", 1, (0, 0, "X"), [[0]], None),
    ("rocm_8x_mi300x_xgmi.txt", 8, (2, 6, "XGMI"), [list(range(8))], "tree"),
    ("rocm_4x_pcie.txt", 4, (0, 2, "SYS"), [[0, 1], [2, 3]], "hierarchical"),
]


@pytest.mark.parametrize("name,n,link,groups,scheme", GOLDEN)
def test_parsers_and_layouts(name, n, link, groups, scheme):
    topo = parse(name)
    assert topo.n == n
    i, j, cls = link
    assert topo.links[i][j] == cls and topo.links[j][i] == cls
    assert all(topo.links[k][k] == "X" for k in range(n))
    lay = plan(topo)
    assert lay.groups == groups
    if scheme:
        assert lay.scheme == scheme
    assert lay.step_s >= 0


def test_tabs_spaces_and_nic_headers_agree():
    tabs, spaces = parse("nvswitch_8x_h100_tabs.txt"), parse("nvswitch_8x_a100_spaces_mlx.txt")
    assert tabs.links == spaces.links  # NV18 vs NV12: both an NVSwitch fabric
    assert tabs.nvlinks[0][1] == 18 and spaces.nvlinks[0][1] == 12
    assert [g.numa for g in tabs.gpus] == [0] * 4 + [1] * 4 == [g.numa for g in spaces.gpus]
    five = parse("pcie_5x_phb_node_sys_spaces.txt")  # no GPU NUMA ID column, no NIC
    assert [g.numa for g in five.gpus] == [0, 1, 1, 1, 1]


def test_two_nvlink_gpus_are_not_a_switch():
    t = parse("nvlink_2x_bridge.txt")
    assert t.links[0][1] == "NVLINK" and t.nvlinks[0][1] == 4


def test_rocm_xgmi_and_pcie_numa():
    x = parse("rocm_8x_mi300x_xgmi.txt")
    assert {c for r in x.links for c in r} == {"X", "XGMI"}
    p = parse("rocm_4x_pcie.txt")
    assert p.links[0][1] == "NODE" and p.links[1][2] == "SYS"


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "the file is empty"),
        ("   \n", "the file is empty"),
        ((FIX / "garbage.txt").read_text(), "not the output of 'nvidia-smi topo -m'"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV4\n", "expected rows GPU0..GPU1, found [0]"),  # GPU1 row missing
        ("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tFOO\t X \n", "unknown link 'FOO' between GPU0 and GPU1"),
    ],
)
def test_garbage_is_a_clear_error(text, needle):
    with pytest.raises(T.TopologyError) as e:
        T.parse_topo_text(text)
    assert needle in str(e.value), str(e.value)


def test_no_p2p_pairs_are_priced_as_staged():
    t = parse("pcie_8x4090_all_sys.txt")
    t.p2p = T.parse_nvidia_smi_p2p(
        "\n".join(
            ["\t" + "\t".join(f"GPU{j}" for j in range(8))]
            + [f"GPU{i}\t" + "\t".join("X" if i == j else "GNS" for j in range(8)) for i in range(8)]
        ),
        8,
    )
    assert t.p2p[0][1] is False
    assert L.effective_links(t)[0][1] == "STAGED"
    prof = L.load_profile("rtx4090-pcie")
    assert plan(t).step_s > L.choose_layout(parse("pcie_8x4090_all_sys.txt"), prof).step_s


# ---------------------------------------------------------------- the cost model


def test_alpha_beta_formulas_by_hand():
    link = L.Link(alpha_s=2e-6, beta_s=1e-9)
    msg = L.message_bytes(1, 8, 64)  # lse 32 B, packed 4*8*65 = 2080 B
    assert msg == {"lse": 32, "packed": 2080}
    p = 4
    ring = lambda m: 2 * (p - 1) * 2e-6 + 2 * (p - 1) / p * m * 1e-9  # noqa: E731
    # over 3+ ranks the allreduce scheme's sum is gathered and added in rank order (issue 49)
    assert L.scheme_cost_s("allreduce", p, msg, link) == pytest.approx(ring(32) + 3 * (2e-6 + 2080e-9))
    two = lambda m: 2 * 2e-6 + m * 1e-9  # noqa: E731  (two ranks: a SUM all-reduce)
    assert L.scheme_cost_s("allreduce", 2, msg, link) == pytest.approx(two(32) + two(2080))
    assert L.scheme_cost_s("tree", p, msg, link) == pytest.approx(2 * 2 * (2e-6 + 2080e-9))
    assert L.scheme_cost_s("allgather", p, msg, link) == pytest.approx(3 * (2e-6 + 2080e-9))
    assert L.scheme_cost_s("tree", 5, msg, link) == pytest.approx(2 * 3 * (2e-6 + 2080e-9))  # ceil(log2 5)


# ---------------------------------------------------------------- profiles


@pytest.mark.parametrize("name", ["dgx-h100", "mi300x", "rtx4090-pcie", "cpu-gloo"])
def test_builtin_profiles_load(name):
    p = L.load_profile(name)
    assert p.links and all(x.alpha_s > 0 and x.beta_s > 0 for x in p.links.values())
    assert "#" in L.profile_path(name).read_text().splitlines()[0]  # the source is noted


BAD_PROFILES = [
    ("links: {NVSWITCH: {alpha_us: 3, bandwidth_gbps: 300}}\ncolour: blue\n", "unknown key 'colour'"),
    ("links: {NVSWITCH: {alpha_us: fast, bandwidth_gbps: 300}}\n", "links.NVSWITCH.alpha_us"),
    ("links: {WARP: {alpha_us: 3, bandwidth_gbps: 300}}\n", "links.WARP"),
    ("links: {NVSWITCH: {alpha_us: 3}}\n", "links.NVSWITCH.bandwidth_gbps"),
    ("links: {NVSWITCH: {alpha_us: -1, bandwidth_gbps: 3}}\n", "links.NVSWITCH.alpha_us"),
    ("name: 5\nlinks: {NVSWITCH: {alpha_us: 3, bandwidth_gbps: 3}}\n", "'name'"),
    ("links: [1, 2\n", "not valid YAML"),
    ("just a string\n", "mapping"),
    ("name: x\n", "'links'"),
    ("!!python/object/apply:os.system ['true']\n", "not valid YAML"),  # safe_load refuses tags
]


@pytest.mark.parametrize("text,needle", BAD_PROFILES)
def test_bad_profiles_name_file_and_key(tmp_path, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(L.ProfileError) as e:
        L.load_profile(str(f))
    assert str(f) in str(e.value) and needle in str(e.value), str(e.value)
    r = subprocess.run([TREEATTN, "topo", "--profile", str(f)], capture_output=True, text=True, timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("treeattn: error:") and needle in lines[0], (
        r.stderr
    )


def test_unknown_profile_name():
    with pytest.raises(L.ProfileError, match="built-in"):
        L.load_profile("no-such-box")


# ---------------------------------------------------------------- probes (every source mocked)


def _fail(exc):
    def f(notes):
        raise exc

    return f


def test_every_source_absent_means_no_gpu(monkeypatch):
    monkeypatch.setattr(
        T,
        "PROBES",
        (
            ("nvml", _fail(RuntimeError("NVMLError_LibraryNotFound"))),
            ("nvidia-smi", _fail(FileNotFoundError("nvidia-smi not found"))),
            ("amdsmi", _fail(KeyError("libamd_smi.so"))),
            ("rocm-smi", _fail(subprocess.TimeoutExpired("rocm-smi", 10))),
        ),
    )
    t = T.probe(cpu_ranks=3)
    assert t.n == 0 and t.source == "none" and "no GPU found" in t.notes
    assert len(t.notes) == 5 and "KeyError" in t.notes[2]
    lay = L.plan_for_run("cpu", 3, heads=8, head_dim=64, layers=4, topo=t)
    assert lay.groups == [[0, 1, 2]]


def test_cli_on_this_machine_exits_zero():
    r = subprocess.run([TREEATTN, "topo", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    for key in ("gpus", "links", "groups", "scheme", "source"):
        assert key in rec
    if not rec["gpus"]:
        assert rec["groups"] == [[0, 1]] and "no GPU found" in rec["notes"]


def test_nvidia_smi_probe_without_shell(monkeypatch):
    text = (FIX / "pcie_8x_pix_pxb_sys.txt").read_text()
    p2p = "\n".join(
        ["\t" + "\t".join(f"GPU{j}" for j in range(8))]
        + [
            f"GPU{i}\t" + "\t".join("X" if i == j else ("OK" if i // 2 == j // 2 else "CNS") for j in range(8))
            for i in range(8)
        ]
    )
    calls = []

    def fake_run(cmd, **kw):
        calls.append((cmd, kw))
        out = {"-m": text, "-p2p": p2p}.get(cmd[2] if len(cmd) > 2 else "", "")
        if "--query-gpu=index,name,pci.bus_id" in cmd:
            out = "\n".join(f"{i}, NVIDIA GeForce RTX 4090, 00000000:{0x18 + i:02X}:00.0" for i in range(8))
        return types.SimpleNamespace(returncode=0, stdout=out, stderr="")

    monkeypatch.setattr(T, "PROBES", (("nvml", _fail(ImportError("no pynvml"))),) + T.PROBES[1:])
    monkeypatch.setattr(T.shutil, "which", lambda c: f"/usr/bin/{c}" if c == "nvidia-smi" else None)
    monkeypatch.setattr(T.subprocess, "run", fake_run)
    t = T.probe()
    assert t.source == "nvidia-smi topo -m" and t.n == 8
    assert t.gpus[3].name == "NVIDIA GeForce RTX 4090" and t.gpus[3].bus_id == "0000:1b:00.0"
    assert t.p2p[0][1] is True and t.p2p[0][2] is False
    assert all(kw.get("shell") is False and kw.get("timeout") for _, kw in calls)


class FakeNVML(types.ModuleType):
    """4 GPUs: NVLink pairs (0,1) and (2,3) with 2 links each; other pairs NODE within a
    socket, SYS across; P2P OK only on NVLink pairs. Rejects the tuple P2P index."""

    NVML_NVLINK_MAX_LINKS = 6

    class NVMLError(Exception):
        pass

    def __init__(self):
        super().__init__("pynvml")
        self.bus = [f"00000000:{0x18 + 0x10 * i:02X}:00.0".encode() for i in range(4)]

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 4

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA A100-PCIE-40GB"

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=self.bus[h])

    def nvmlDeviceGetNumaNodeId(self, h):
        return h // 2

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= 2:
            raise self.NVMLError("NotSupported")
        return 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return types.SimpleNamespace(busId=self.bus[h ^ 1])

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 40 if a // 2 == b // 2 else 50

    def nvmlDeviceGetP2PStatus(self, a, b, idx):
        if not isinstance(idx, int):
            raise TypeError("P2P caps index must be an int")
        return 0 if a // 2 == b // 2 else 1


def test_nvml_probe(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML())
    t = T.probe()
    assert t.source == "nvml" and t.n == 4
    assert t.links[0][1] == "NVLINK" and t.nvlinks[0][1] == 2 and t.links[1][2] == "SYS"
    assert t.p2p[0][1] is True and t.p2p[0][3] is False
    assert t.gpus[2].bus_id == "0000:38:00.0" and t.gpus[3].numa == 1
    lay = plan(t, "dgx-h100")
    assert lay.groups == [[0, 1], [2, 3]] and lay.scheme == "hierarchical"


# ---------------------------------------------------------------- measure


def test_measure_on_cpu_ranks_saves_a_usable_profile(tmp_path):
    out = tmp_path / "measured.yaml"
    r = cli("topo", "--measure", "--nproc", "3", "--save", str(out), "--json")
    assert r.exit_code == 0, (r.stderr, r.exception)
    rec = json.loads(r.stdout)
    assert set(rec["measured"]["pairs"]) == {"0-1", "0-2", "1-2"}
    assert all(v["alpha_us"] > 0 and v["bandwidth_gbps"] > 0 for v in rec["measured"]["pairs"].values())
    assert rec["measured"]["allreduce_us"]["0,1,2"] > 0
    prof = L.load_profile(str(out))
    assert set(prof.links) == {"LOOPBACK"}
    lay = L.plan_for_run("cpu", 3, heads=8, head_dim=64, layers=2, profile=str(out))
    assert lay.groups == [[0, 1, 2]]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--from-file", "/nonexistent/topo.txt"], "not found"),
        (["--from-file", str(FIX / "garbage.txt")], "not the output"),
        (["--from-file", "{empty}"], "{empty}: the file is empty"),
        (["--save", "/tmp/x.yaml"], "--measure"),
        (["--nproc", "0"], "--nproc"),
    ],
)
def test_topo_bad_input(args, needle, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    args = [a.replace("{empty}", str(empty)) for a in args]
    assert_usage_error(cli("topo", *args), needle.replace("{empty}", str(empty)))


def test_generate_uses_the_layout_topo_prints():
    from transformers import LlamaConfig

    from treeattn_cli.cli.options import GenerateOptions
    from treeattn_cli.cli.prepare import _merge_plan
    from treeattn_cli.cli.topo import TopoOptions, topo_command

    cfg = LlamaConfig(num_attention_heads=8, num_key_value_heads=2, hidden_size=256, num_hidden_layers=3)
    rec = topo_command(TopoOptions(nproc=3, heads=8, head_dim=32, layers=3))
    scheme, groups, _, _ = _merge_plan(GenerateOptions(), "cpu", 3, cfg)
    assert scheme == rec["scheme"]
    assert (groups or [[0, 1, 2]]) == rec["groups"]
