"""GPU targets the kernels are built for, and the one place a Triton kernel is launched.

Every kernel launch of the project goes through :func:`launch`. Normally that is
``kernel[grid](*args, **kw)``; inside :func:`compile_only` (the offline compile of
``offline_compile.py``, with a stand-in driver naming the target) it compiles the very same
launch with ``kernel.warmup`` instead, without a GPU, and records the compiled kernel. The launch
parameters therefore come from the runtime's own code, never from a copy.

A :class:`Target` carries what the launch code needs to know of a device: its backend and
architecture (Triton's ``GPUTarget``), warp size, SM/CU count (to size the split grid) and the
most shared memory / LDS one program may use.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    name: str  # "sm_90", "gfx942", "interpreter", ...
    backend: str  # "cuda" | "hip" | "interpreter"
    arch: object  # 90 (CUDA compute capability) or "gfx942"
    warp_size: int
    n_sms: int  # streaming multiprocessors / compute units
    max_shared: int  # bytes of shared memory (LDS) one program may use

    @property
    def is_hip(self) -> bool:
        return self.backend == "hip"


# Published limits: opt-in shared memory per block (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability": 163 KB on sm_80, 227 KB on sm_90); 64 KiB of LDS per
# workgroup on CDNA3 (AMD Instinct MI300 ISA guide). SM/CU counts: A100 108, H100 SXM 132,
# MI300X 304.
TARGETS = {
    "sm_80": Target("sm_80", "cuda", 80, 32, 108, 166912),
    "sm_90": Target("sm_90", "cuda", 90, 32, 132, 232448),
    "gfx942": Target("gfx942", "hip", "gfx942", 64, 304, 65536),
}
INTERPRETER = Target("interpreter", "interpreter", None, 32, 4, 1 << 30)

_state: dict = {"offline": None, "compiled": None}
_cuda_targets: dict = {}


def target_of(device) -> Target:
    """The target a tensor on ``device`` runs on: the GPU's, the offline compile's stand-in
    (``meta`` tensors), or Triton's CPU interpreter (4 "SMs", so the split path is exercised)."""
    device = torch.device(device)
    if device.type == "meta" and _state["offline"] is not None:
        return _state["offline"]
    if device.type != "cuda":
        return INTERPRETER
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _cuda_targets:
        props = torch.cuda.get_device_properties(idx)
        if torch.version.hip:
            arch = props.gcnArchName.split(":")[0]
            t = Target(arch, "hip", arch, 64, props.multi_processor_count, 65536)
        else:
            cc = props.major * 10 + props.minor
            known = TARGETS.get(f"sm_{cc}")
            shared = known.max_shared if known else getattr(props, "shared_memory_per_block_optin", 49152)
            t = Target(f"sm_{cc}", "cuda", cc, 32, props.multi_processor_count, shared)
        _cuda_targets[idx] = t
    return _cuda_targets[idx]


def launch(kernel, grid, *args, **kw):
    """``kernel[grid](*args, **kw)``, or, inside :func:`compile_only`, compile that launch for
    the stand-in target and record ``(kernel name, compiled kernel, grid)``."""
    if _state["compiled"] is not None:
        ck = kernel.warmup(*args, grid=grid, **kw)
        _state["compiled"].append((kernel.fn.__name__, ck, tuple(grid)))
        return ck
    return kernel[grid](*args, **kw)


class StandInDriver:
    """Enough of a Triton driver for ``JITFunction.warmup``: it names the target and a device;
    nothing is ever launched."""

    def __init__(self, target: Target):
        from triton.backends.compiler import GPUTarget

        self.gpu_target = GPUTarget(target.backend, target.arch, target.warp_size)

    def get_current_target(self):
        return self.gpu_target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("meta")


@contextlib.contextmanager
def compile_only(target: Target):
    """Inside: kernels launched on ``meta`` tensors compile for ``target`` instead of running;
    yields the list of ``(kernel name, compiled kernel, grid)`` they produced. One target per
    process: Triton keeps compiled kernels per device index, and the stand-in is always 0."""
    from triton.runtime import driver

    driver.set_active(StandInDriver(target))
    _state["offline"], _state["compiled"] = target, []
    try:
        yield _state["compiled"]
    finally:
        _state["offline"], _state["compiled"] = None, None
        try:
            driver.reset_active()
        except RuntimeError:  # no real driver on this machine: leave none active
            driver._active = None
