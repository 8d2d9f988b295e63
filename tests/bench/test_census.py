"""The decode step's kernel census (issue 51, item 1): ``treeattn bench --census`` counts the
device operations one batched decode step dispatches, per layer and per step. This test holds
the count of the engine's step on CPU: it fails when a change adds operations to a layer or to
the step, so a fusion that removes some lowers the numbers here (and they are lowered with it)."""

from __future__ import annotations

from helpers import assert_usage_error, cli

# Llama-3.1-8B's heads (32 query, 8 KV) at head dim 16, bf16, the CPU's own step on one rank
# (its torch attention; the CPU keeps its projections apart, model/fused.py). 123 and 45
# before the norms, the MLP's silu × up and the rotary embedding became one operation each;
# 103 and 40 before the step's pool slots were looked up once a step, 102 before each residual
# add and the norm after it became one operation (2026-11-29).
# The GPU's branches (the census's default, Triton interpreted: minutes) are BENCHMARKS.md's.
PER_LAYER, OUTSIDE = 100, 39


def test_the_census_counts_a_decode_step_and_the_count_does_not_grow(tmp_path):
    from treeattn_cli.bench.census import census

    r = census("llama-3.1-8b", tmp_path, head_dim=16, gpu=False)  # (the GPU's branches: interpreted, minutes)
    assert r["layer_ops"].get("linear") == 7, r["layer_ops"]  # q, k, v, o, gate, up, down: the step ran its layers
    ops = r["layer_ops"]
    # one operation each: the two residual adds with the norms after them, silu x up, the rotation
    assert (ops.get("add_rms_norm"), ops.get("rms_norm"), ops.get("silu_mul"), ops.get("rope")) == (2, None, 1, 1), ops
    assert r["kernels_per_layer"] <= PER_LAYER and r["model_level"] <= OUTSIDE, r
    assert r["kernels_per_step"] == r["model_level"] + 32 * r["kernels_per_layer"]
    assert r["kernels_per_layer"] == sum(r["layer_ops"].values())


def test_bench_census_refuses_a_shape_it_does_not_know():
    """``treeattn bench --census`` with an unknown ``--model-shape``: one line, exit 2."""
    assert_usage_error(
        cli("bench", "--census", "--model-shape", "llama-3.1-9b", "--json"), "--model-shape must be one of"
    )
