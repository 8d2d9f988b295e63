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
