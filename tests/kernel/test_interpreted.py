"""Triton's interpreter with its helpers' re-patching skipped (``treeattn_kernels.interpreted``):
a launch patches ``triton.language`` once, its helpers' calls (ours and Triton's own: ``tl.max``,
``tl.cdiv``) patch nothing more, and the kernel's numbers are the bits of a launch that re-patches
at every helper call, as Triton ships it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

PROGRAM = """
import sys, torch
import triton.runtime.interpreter as interp
import treeattn_kernels.partial_triton as pt
import treeattn_kernels.targets as targets
if sys.argv[1] == "shipped":
    targets._state["interpreted"] = False  # the interpreter as Triton ships it
calls = []
patch = interp._patch_lang
interp._patch_lang = lambda fn: (calls.append(fn.__name__ if hasattr(fn, "__name__") else "every"), patch(fn))[1]
g = torch.Generator().manual_seed(7)
q, k, v = (torch.randn(s, generator=g) for s in ((2, 4, 3, 64), (2, 2, 70, 64), (2, 2, 70, 64)))
o, lse = pt.partial_attention_triton(q, k, v, kv_len=torch.tensor([70, 33]))
torch.save({"o": o, "lse": lse, "calls": calls, "on": bool(targets._state["interpreted"])}, sys.argv[2])
"""


def test_a_launch_patches_once_and_the_numbers_are_the_shipped_interpreters(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = {}
    for mode in ("quick", "shipped"):
        subprocess.run([sys.executable, "-c", PROGRAM, mode, str(tmp_path / mode)], env=env, check=True, timeout=300)
        out[mode] = torch.load(tmp_path / mode)
    quick, shipped = out["quick"], out["shipped"]
    assert quick["on"] and not shipped["on"]
    launches = quick["calls"].count("every")
    assert launches >= 2 and len(quick["calls"]) == launches, quick["calls"]  # a patch a launch, no more
    assert len(shipped["calls"]) > 10 * launches  # (the premise: as shipped, every helper's call patches)
    assert torch.equal(quick["o"], shipped["o"]) and torch.equal(quick["lse"], shipped["lse"])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # (numpy's fp16 cast of values past 65504: inf)
def test_the_interpreter_narrows_floats_as_a_gpu_does():
    """fp32 to bf16, fp16 and fp8 in an interpreted kernel round to nearest even, as torch and a GPU
    (fp8 saturated to its largest finite value, as ``cvt.rn.satfinite``): ties, subnormals and
    values past the largest included. As shipped (3.9) the interpreter drops bf16's extra bits."""
    import triton
    import triton.language as tl
    from treeattn_kernels.interpreted import round_as_gpus_do
    from treeattn_kernels.targets import launch

    @triton.jit
    def narrow(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, tl.load(X + i).to(Y.dtype.element_ty))

    g = torch.Generator().manual_seed(11)
    n = 4096
    x = torch.randn(n, generator=g) * torch.logspace(-45, 6, n)[torch.randperm(n, generator=g)]
    ties = torch.arange(1, 257, dtype=torch.float32) * 2**-8 + 2**-9  # bf16: halfway between neighbours
    x[: ties.numel()] = ties
    launch(narrow, (1,), x[:8], torch.empty(8, dtype=torch.bfloat16), N=8)  # (the first launch installs it)
    assert round_as_gpus_do()
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2):
        y = torch.empty(n, dtype=dtype)
        launch(narrow, (1,), x, y, N=n)
        want = (x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max) if dtype.itemsize == 1 else x).to(dtype)
        bits = torch.uint8 if dtype.itemsize == 1 else torch.int16
        assert torch.equal(y.view(bits), want.view(bits)), dtype
    # the conversions are the interpreter's own work: a dispatch mode around a launch (the census,
    # the CUDA-graph stand-in's capture) sees none of them (the combination run's seed 3004: a
    # captured fp8 step whose replay "differed" by the conversions' fresh tensors)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    y = torch.empty(n, dtype=torch.bfloat16)
    with Seen():
        launch(narrow, (1,), x, y, N=n)
    assert not [op for op in Seen.ops if op in ("lift_fresh", "clamp", "_to_copy", "view")], Seen.ops
