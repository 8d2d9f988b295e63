"""Issue 51's two GPU measurement commands run here first, on the CPU (Triton's interpreter, a
small model of the step's structure): a GPU's minutes are not spent finding that a script no
longer fits the code it measures (the desk's scripts had drifted: a kernel helper renamed, the
dense cache gone from the engine)."""

from __future__ import annotations

import torch

from treeattn_cli.bench import gpu_kernels, gpu_step


class Records(list):
    def __call__(self, **r):
        self.append(r)

    def kinds(self):
        return [r["kind"] for r in self]


def test_the_kernel_run_measures_every_lever_and_the_paged_kernel_equals_the_dense():
    out = Records()
    gpu_kernels.run([128], torch.device("cpu"), out)
    kinds = out.kinds()
    for kind in ("bf16", "bf16-stages2", "fp8", "paged-bf16", "paged-fp8", "rows-bf16", "rows-fp8", "verify17-fp8"):
        assert kind in kinds, kind
    assert kinds.count("fp8-splits") == 3 and kinds.count("fp8-cfg") == 3 and kinds[-1] == "done"
    # the same keys through a shuffled block table give the dense kernel's output: bit for bit as
    # shipped (the same splits), within rounding at 3 stages (its own splits, another order of sums)
    shipped, three = (r["max_abs_diff"] for r in out if r["kind"] == "paged-bf16")
    assert shipped == 0.0 and three < 1e-2
    assert all(r["us"] > 0 and r["frac_copy"] >= 0 for r in out if "us" in r)


def test_the_step_run_steps_the_engines_batch_loop_in_bf16_and_fp8():
    out = Records()
    seen = []
    real = gpu_step.census

    def census(*a, **kw):  # the census ran, over which cache
        seen.append(kw.get("quant") is not None)
        return real(*a, **kw)

    gpu_step.census = census
    try:
        gpu_step.run([192], torch.device("cpu"), out)
    finally:
        gpu_step.census = real
    assert seen == [False, True]
    steps = [r for r in out if r["kind"] == "step"]
    assert [r["kv"] for r in steps] == ["bf16", "fp8"] and not any("error" in r for r in out)
    assert all(r["synced_ms"] > 0 and r["floor_ms"] > 0 and r["replayed"] is False for r in steps)
    census_recs = [r for r in out if r["kind"] == "census"]
    assert all(r["per_step"]["gemm"]["kernels"] > 0 for r in census_recs)
    # the step's weight shapes: a CPU keeps the projections apart (a GPU's step reads qkv and gate_up)
    assert {r["name"] for r in out if r["kind"] == "gemv"} == {"q", "k", "o", "gate", "down", "lm_head"}
