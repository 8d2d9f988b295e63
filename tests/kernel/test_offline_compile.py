"""Every Triton kernel compiles for real GPU targets (sm_80, sm_90, gfx942) without a GPU.

The interpreter that runs the other kernel tests accepts code no GPU compiler does (module
globals read inside a kernel, i32 offsets that wrap, tiles that exceed shared memory): here
each target's compiler is run for real, once per target in its own process, on every launch
configuration the runtime picks (``treeattn_kernels.offline_compile``), and the compiled
binaries are checked: no spills, shared memory / LDS within the target's limit, 64-bit base
offsets, and no recompiles while a shard grows.

And the decode launches of Llama-3.1-8B / -70B at tp 1 and 8 over 8K-128K keys per rank
(``decode_report``, issue 23): two K/V tiles in flight per CTA on CUDA at no loss of CTAs per
SM (H3), a grid that fills the machine and splits that follow the live length (H4), bytes in
flight against Little's law, and two workgroups per CU on gfx942 (H10). And the split kernel
over an fp8 cache (issue 27) on the targets that store one (sm_90, gfx942): the same rules at
no fewer CTAs per SM than bf16's, and about half the bytes per key. And what a step reads over
an fp8 cache when its queries are more than one row (issue 38: 8 sequences over one document,
a verify of 17 rows): at most 0.55x bf16's bytes, from the compiled key loop and the launches.
"""

from __future__ import annotations

import json

import pytest

from helpers import OFFLINE_TARGETS, Background, start_offline_compiles

pytest.importorskip("triton")

TARGETS = OFFLINE_TARGETS


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The three targets compile concurrently (each process is single-threaded), started when the
    session was collected (``conftest.pytest_collection_finish``), or now when it was not."""
    start_offline_compiles(tmp_path_factory.mktemp("offline"))  # those not started already (triton: see above)
    out = {}
    for t in TARGETS:
        stdout, stderr = Background.result(f"compile-{t}", timeout=900)
        assert stdout.strip(), f"{t}: offline compile printed nothing; stderr:\n{stderr[-3000:]}"
        out[t] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_every_configuration_compiles(compiled, target):
    res = compiled[target]
    assert res["configs"] > 2000  # head dims x groups x dtypes x lengths x flags, decode and prefill
    assert not res["errors"], res["errors"][:5]
    names = {k["kernel"] for k in res["kernels"]}
    assert names == {
        "_split_kernel",
        "_reduce_kernel",
        "_weigh_kernel",
        "_unweigh_kernel",
        "_gathered_kernel",
        "_rms_norm_kernel",  # the layer's fused norm and SiLU × up (issue 51)
        "_silu_mul_kernel",
        "_write_kernel",  # a step's keys and values into the pool, and the merge of its two partials
        "_merge_pair_kernel",
        "_reduce_pair_kernel",  # a step's two calls' splits in one launch, and a residual add with its norm
        "_add_rms_norm_kernel",
    }


@pytest.mark.parametrize("target", TARGETS)
def test_no_spills_and_shared_memory_fits(compiled, target):
    bad = [
        (k["first_config"], k["kernel"], k["regs"], k["spill_bytes"], k["shared_bytes"], k["max_shared"])
        for k in compiled[target]["kernels"]
        if not k["ok"]
    ]
    assert not bad, bad[:5]
    for k in compiled[target]["kernels"]:
        assert k["regs"] and k["regs"] > 0  # the report was read from the binary
        assert k["spill_bytes"] == 0, (k["kernel"], k["first_config"], k["spill_bytes"])


@pytest.mark.parametrize("target", TARGETS)
def test_base_offsets_are_64_bit(compiled, target):
    """b * stride_b and h * stride_h reach 2^31 elements at batch 3 x 1M tokens: every kernel
    offsets its tensors' base pointers by 64-bit products (checked in the compiled IR)."""
    narrow = [(k["kernel"], k["narrow_base_offsets"]) for k in compiled[target]["kernels"] if k["narrow_base_offsets"]]
    assert not narrow, narrow[:5]


@pytest.mark.parametrize("target", TARGETS)
def test_eager_decode_does_not_recompile_as_the_shard_grows(compiled, target):
    """Split counts and lengths are runtime values: one split and one reduce kernel serve a
    shard growing from 1 to 8192 keys (the split count used to be a compile-time constant:
    a new kernel every 256 tokens)."""
    assert compiled[target]["decode_growth_kernels"] == 2


def test_plan_rules():
    """The tile rules the compiled kernels were checked with (Llama-3.1-8B's shape: every call
    the decode step's tile, 16 rows on 4 warps, two 64-key K/V tiles in flight on H100, 32-key
    tiles on A100 and MI300X; fp32 on gfx942 single-buffered), and the splits fixed by key index
    (issue 49): at least a pipeline's tiles each, at most two waves of them."""
    import torch

    import treeattn_kernels.partial_triton as pt
    from treeattn_kernels.targets import TARGETS as T

    plan = pt.plan_split(1, 8, 4, 1, 1 << 20, 128, torch.bfloat16, T["sm_90"])
    assert (plan.block_m, plan.block_n, plan.num_warps, plan.num_stages, plan.depth) == (16, 64, 4, 3, 2)
    assert (plan.splits, plan.split_len, plan.split_min, plan.split_cap) == (264, 0, 128, 264)
    tail = pt.plan_split(32, 8, 4, 1, 4096, 128, torch.bfloat16, T["sm_90"], fixed_splits=True)
    assert (tail.splits, tail.split_len) == (32, 128)
    assert pt.plan_split(1, 8, 4, 1, 1 << 17, 128, torch.bfloat16, T["sm_80"]).block_n == 32
    amd = pt.plan_split(1, 8, 4, 1, 1 << 17, 128, torch.bfloat16, T["gfx942"])
    assert (amd.block_n, amd.num_stages) == (32, 3)
    hip = pt.plan_split(1, 8, 4, 1, 4096, 256, torch.float32, T["gfx942"])
    assert hip.num_stages == 1 and hip.block_n == 32
    assert [pt.tile_rows(G) for G in (1, 3, 4, 16, 32)] == [16, 16, 16, 16, 32]
    verify = pt.plan_split(1, 8, 4, 4, 1 << 20, 128, torch.bfloat16, T["sm_90"])
    assert verify == plan  # four positions of four heads: the decode step's tile
    # through a block table on CUDA (issue 51): 5 stages, the table's entry a level of its own,
    # so the same two tiles in flight and the same splits (four rows of a batch over a document
    # too: the same compiled kernel); ROCm keeps its stages
    for t in ("sm_90", "sm_80"):
        dense, paged = (pt.plan_split(1, 8, 4, 1, 1 << 20, 128, torch.bfloat16, T[t], paged=p) for p in (False, True))
        assert (paged.num_stages, paged.levels, paged.depth) == (5, 2, 2), paged
        assert (paged.splits, paged.split_min, paged.block_n) == (dense.splits, dense.split_min, dense.block_n)
    assert pt.plan_split(1, 8, 4, 4, 1 << 20, 128, torch.bfloat16, T["sm_90"], paged=True).num_stages == 5
    assert pt.plan_split(1, 8, 4, 1, 1 << 17, 128, torch.bfloat16, T["gfx942"], paged=True) == amd


def test_split_counts_fill_the_machine():
    """H4 on the plan alone (no compiler): for every decode shape of the report and every
    target, a full wave of CTAs, or (a shard too short for one: 8K keys at tp 8) splits no
    longer than the kernel's pipeline, so the whole shard is requested at once; from 32K keys
    per rank on, always a full wave. A row's splits are its own length's (issue 49)."""
    import torch

    import treeattn_kernels.partial_triton as pt
    from treeattn_kernels.offline_compile import decode_shapes
    from treeattn_kernels.targets import TARGETS as T

    for t in T.values():
        for model, tp, N, H, H_kv, d in decode_shapes():
            plan = pt.plan_split(1, H_kv, H // H_kv, 1, N, d, torch.bfloat16, t)
            split = max(plan.split_min, -(-(-(-N // plan.split_cap)) // plan.block_n) * plan.block_n)  # the kernel's
            splits = -(-N // split)
            assert splits <= plan.splits, (t.name, model, tp, N, plan)
            ctas = H_kv * splits
            assert ctas >= t.n_sms or split // plan.block_n <= plan.depth, (t.name, model, tp, N, plan)
            if N >= 32768:
                assert ctas >= t.n_sms, (t.name, model, tp, N, plan)


def _decode(compiled, target, window=False, kv="bf16"):
    recs = [r for r in compiled[target]["decode"] if bool(r["window"]) == window and r["kv_dtype"].startswith(kv)]
    assert recs
    return recs


def test_decode_report_covers_the_shapes(compiled):
    for target in TARGETS:
        got = {(r["model"], r["tp"], r["keys"]) for r in _decode(compiled, target)}
        assert got == {
            (m, tp, n) for m in ("llama-3.1-8b", "llama-3.1-70b") for tp in (1, 8) for n in (8192, 32768, 131072)
        }
        assert len(_decode(compiled, target, window=True)) == 1


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_decode_keeps_two_tiles_in_flight(compiled, target):
    """H3: the K/V loads are software-pipelined two tiles deep (two buffers in the TTGIR,
    cp.async copies whose wait leaves the next tile's groups outstanding in the SASS), at no
    fewer CTAs per SM than the single-buffered kernel had (plain decode and window layers)."""
    from treeattn_kernels.offline_compile import BASELINE_CTAS

    for window in (False, True):
        for r in _decode(compiled, target, window):
            assert r["tiles_in_flight"] >= 2, r
            assert r["async_copies"] > 0 and r["max_outstanding_groups"] >= 2, r
            assert r["ctas_per_sm"] >= BASELINE_CTAS[target][window], (r["ctas_per_sm"], r["occupancy"])
            assert r["checks"]["tiles"]


@pytest.mark.parametrize("target", TARGETS)
def test_decode_grid_fills_the_machine(compiled, target):
    """H4: at least one full wave of CTAs over the SMs, or, where the shard is too short (8K keys
    at tp 8), runs that fit the pipeline, so the whole shard is in flight at once; and under a
    CUDA graph planned on twice the length, every split still has work (split lengths follow
    the live length on the device)."""
    for r in _decode(compiled, target):
        assert r["grid_ctas"] >= r["n_sms"] or r["blocks_per_split"] <= r["tiles_in_flight"], r
        if r["keys"] >= 32768:
            assert r["grid_ctas"] >= r["n_sms"], r
        assert r["graph_live_splits"] == r["graph_splits"], r
        assert r["checks"]["grid"]


@pytest.mark.parametrize("target", TARGETS)
def test_decode_bytes_in_flight_meet_littles_law(compiled, target):
    """Bytes in flight (resident CTAs x tiles in flight x K+V tile) cover the memory system's
    bandwidth x latency, or the whole shard when it is smaller than that."""
    for r in compiled[target]["decode"]:
        assert r["bytes_needed"] > 0 and r["littles_margin"] >= 1.0, r
        assert r["spill_bytes"] == 0 and r["checks"]["spills"], r


def test_gfx942_fits_two_workgroups_per_cu(compiled):
    """H10: the decode split kernel takes at most 32 KiB of LDS on MI300X (64 KiB per CU), so
    two workgroups share a CU, without spills."""
    for r in compiled["gfx942"]["decode"]:
        assert r["shared_bytes"] <= 32768 and r["ctas_per_sm"] >= 2 and r["spill_bytes"] == 0, r
        assert r["tiles_in_flight"] >= 2, r


def test_fp8_kernels_compile_where_fp8_is_stored(compiled):
    """The split kernel reading fp8 K/V and their scales compiles for sm_90 (e4m3fn) and gfx942
    (e4m3fnuz) at every head dim, group, dtype and flag of ``fp8_calls``, without spills (the
    kernels are in the no-spill check above); sm_80 stores no fp8 (the engine refuses it)."""
    for target, name in (("sm_90", "fp8_e4m3fn"), ("gfx942", "fp8_e4m3fnuz")):
        fp8 = [k for k in compiled[target]["kernels"] if "fp8" in k["first_config"]]
        assert fp8 and all(name in k["first_config"] for k in fp8), target
        assert any(k["constexprs"].get("SCALE_G", 0) > 0 for k in fp8), target  # scales read in the kernel
        assert all(k["spill_bytes"] == 0 for k in fp8), [(k["first_config"], k["spill_bytes"]) for k in fp8]
    assert not [k for k in compiled["sm_80"]["kernels"] if "fp8" in k["first_config"]]


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_fp8_decode_keeps_the_rules_and_halves_the_bytes(compiled, target):
    """Decode over an fp8 cache (Llama-3.1-8B and -70B: GQA groups of 4 and 8, tp 1 and 8,
    plain and window layers): every rule of the report holds, at least two tiles in flight, no
    fewer CTAs resident at once than the bf16 kernel of the same shape (or the whole shard in
    flight at once: 8K keys at tp 8), and a key costs at most 0.55x bf16's bytes, scales
    included."""
    for window in (False, True):
        recs = _decode(compiled, target, window, kv="fp8")
        models = {(m, tp) for m in ("llama-3.1-8b", "llama-3.1-70b") for tp in (1, 8)}
        assert {(r["model"], r["tp"]) for r in recs} == ({("llama-3.1-8b", 1)} if window else models)
        for r in recs:
            assert all(r["checks"].values()), r
            assert r["tiles_in_flight"] >= 2 and r["spill_bytes"] == 0, r
            assert r["resident_floor"] > 0, r
            assert r["resident_ctas"] >= r["resident_floor"] or r["bytes_in_flight"] == r["shard_bytes"], r
            assert r["bytes_per_key_vs_bf16"] <= 0.55, r


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_fp8_steps_of_many_rows_read_about_half_of_bf16s_bytes(compiled, target):
    """Issue 38: over an fp8 cache, one sequence's decode, 8 sequences' rows over one document
    and a verify of 17 rows (Llama-3.1-8B's and -70B's heads: d = 128, GQA groups of 4 and 8)
    make as many launches as over bf16 (slices of the decode step's tile, issue 49), and each
    launch's compiled key loop reads K and V once, with their scales:
    a step reads at most 0.55x bf16's bytes (expanding each row per scale group used to cut 8
    sequences into 2-4 launches and a verify into 5-9: 1.06-2.1x). No spills, and at least two
    K/V tiles in flight."""
    from treeattn_kernels.offline_compile import STEP_BYTES_BOUND, STEP_KINDS

    recs = compiled[target]["steps"]
    fp8 = [r for r in recs if r["kv_dtype"].startswith("fp8")]
    bf16 = {(r["model"], r["kind"]): r for r in recs if r["kv_dtype"] == "bf16"}
    assert (
        {(r["model"], r["kind"]) for r in fp8}
        == set(bf16)
        == {(m, k) for m in ("llama-3.1-8b", "llama-3.1-70b") for k, _, _ in STEP_KINDS}
    )
    for r in fp8:
        b = bf16[(r["model"], r["kind"])]
        Q = {k: q for k, q, _ in STEP_KINDS}[r["kind"]]
        per_slice = r["block_m"] // (r["rows"] // Q)  # positions a tile holds (16 rows: 4 at G = 4, 2 at G = 8)
        assert r["launches"] == b["launches"] == -(-Q // per_slice) and r["block_m"] == b["block_m"] == 16, (r, b)
        assert r["bytes_per_step"] <= STEP_BYTES_BOUND * b["bytes_per_step"] and r["vs_bf16"] <= 0.55, (r, b)
        assert r["bytes_per_key"] == 2 * (128 + 2 * 4) + (8 if r["kind"] == "verify 17" else 0), r  # + positions
        assert all(r["checks"].values()) and r["spill_bytes"] == 0, r
        assert r["tiles_in_flight"] >= 2, r
    assert all(all(r["checks"].values()) for r in recs)


@pytest.mark.parametrize("target", TARGETS)
def test_the_paged_split_kernel_compiles(compiled, target):
    """The split kernel reading through block tables (issue 35): compiled for every target with
    64-key blocks (no spills, shared memory within the limit, 64-bit offsets: the tests above),
    over fp8 pools where the target stores fp8, and the causal verify a batch's pooled tail takes.
    On CUDA a decode step's K/V tiles are in flight two at a time, as the dense kernel's (issue
    51, item 4: 5 stages, the table's entry a pipeline level of its own, ``plan_split(paged=True)``;
    calls reading positions through the table, a window's or a verify's, keep 3 stages and one tile:
    at 5 they spill)."""
    paged = [k for k in compiled[target]["kernels"] if k["kernel"] == "_split_kernel" and k["constexprs"].get("PAGE")]
    assert {k["constexprs"]["PAGE"] for k in paged} == {64}
    assert {k["constexprs"]["HEAD_D"] for k in paged} >= {64, 128}
    assert any(k["constexprs"].get("SCALE_G") for k in paged) == (target != "sm_80")
    # a pooled tail's fixed-shape verify: 8 tokens of a row (x 4 query heads a KV head), causal by
    # position, in slices of the decode step's tile (issue 49)
    assert any(k["constexprs"].get("HAS_POS") and k["first_config"].startswith("paged-verify") for k in paged), paged
    assert {k["constexprs"]["BLOCK_M"] for k in paged} == {16}
    dense = [
        k for k in compiled[target]["kernels"] if k["kernel"] == "_split_kernel" and not k["constexprs"].get("PAGE")
    ]
    assert dense  # the dense kernel is compiled apart (PAGE = 0 compiles the table out)
    if target.startswith("sm_"):  # a decode step's (no positions read: a window's and a verify's keep 3 stages)
        step = [k for k in paged if not k["constexprs"].get("HAS_POS")]
        assert len(step) >= 4 and all(k["tiles_in_flight"] >= 2 for k in step), [
            (k["first_config"], k["tiles_in_flight"], k["num_stages"]) for k in step
        ]


@pytest.mark.parametrize("target", TARGETS)
def test_the_block_lse_variant_keeps_the_plain_kernels_tiles(compiled, target):
    """The split kernel writing block_lse (issue 37, runs of 1 and 16 keys) compiles for every
    target beside the plain kernel of the same launch (Llama-3.1-8B decode, a window layer, a
    verify block, fp8 where the target stores it, a paged step): no spills, shared memory
    within the limit, the plain kernel's K/V tiles in flight, one kernel with or without
    lse_rows; and the plain kernels compile it out (LSE_BLOCK = 0)."""
    recs = compiled[target]["block_lse"]
    kinds = {r["kind"].split()[0] for r in recs}
    assert kinds == {"dense", "verify", "paged"} | ({"fp8"} if target != "sm_80" else set())
    assert {r["lse_block"] for r in recs} == {1, 16}
    for r in recs:
        assert all(r["checks"].values()), r
        assert r["plain"]["lse_block"] == 0 and r["lse"]["lse_block"] == r["lse_block"], r
        assert r["lse"]["spill_bytes"] == 0 and r["lse"]["tiles_in_flight"] == r["plain"]["tiles_in_flight"], r
        assert r["same_kernel_with_lse_rows"], r
    split = [k for k in compiled[target]["kernels"] if k["kernel"] == "_split_kernel"]
    lse = [k for k in split if k["constexprs"].get("LSE_BLOCK")]
    assert {k["constexprs"]["LSE_BLOCK"] for k in lse} == {1, 16}  # in the sweep: spills and offsets checked above
    assert all(k["first_config"].startswith("block_lse") for k in lse)


def test_a_share_of_the_configurations_warms_the_cache(tmp_path):
    """``--warm I/N`` compiles every N-th configuration from the I-th into Triton's cache (the
    worker processes ``treeattn check`` starts on a GPU so its compile row finds its kernels
    there): exactly its share, none failing; and the share is what compile_all compiles. A
    target the table does not know, or one worker, starts no process."""
    import os
    import subprocess
    import sys

    from treeattn_kernels.offline_compile import launches, start_warming
    from treeattn_kernels.targets import TARGETS, Target

    t = TARGETS["sm_90"]
    labels = [label for label, _ in launches(t)]
    assert len(labels) == len(set(labels)) > 2000
    shares, share = 600, 7
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "treeattn_kernels.offline_compile", "--target", "sm_90", "--warm", f"{share}/{shares}"],
        env={**env, "TRITON_CACHE_DIR": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["compiled"] == len(labels[share::shares]) and got["failed"] == 0, got
    assert any((tmp_path / "cache").rglob("*.cubin"))  # compiled for real, into the cache named
    assert start_warming(t, workers=1) == []
    assert start_warming(Target("sm_89", "cuda", 89, 32, 128, 101376), workers=4) == []
