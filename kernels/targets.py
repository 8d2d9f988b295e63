"""GPU targets the kernels are built for, and the one place a Triton kernel is launched.

Every kernel launch of the project goes through :func:`launch`. Normally that is
``kernel[grid](*args, **kw)``; inside :func:`compile_only` (the offline compile of
``offline_compile.py``, with a stand-in driver naming the target) it compiles the very same
launch with ``kernel.warmup`` instead, without a GPU, and records the compiled kernel. The launch
parameters therefore come from the runtime's own code, never from a copy.

A :class:`Target` carries what the launch code needs to know of a device: its backend and
architecture (Triton's ``GPUTarget``), warp size, SM/CU count (to size the split grid) and the
most shared memory / LDS one program may use; and what the offline report needs to judge a
compiled kernel: the per-SM register file, shared memory and residency limits
(:func:`occupancy`), and the memory system's bandwidth and loaded latency (Little's law).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import torch

from .interpreted import quicken, round_as_gpus_do


@dataclass(frozen=True)
class Target:
    name: str  # "sm_90", "gfx942", "interpreter", ...
    backend: str  # "cuda" | "hip" | "interpreter"
    arch: object  # 90 (CUDA compute capability) or "gfx942"
    warp_size: int
    n_sms: int  # streaming multiprocessors / compute units
    max_shared: int  # bytes of shared memory (LDS) one program may use
    # What one SM / CU holds, for occupancy (CTAs or workgroups resident at once):
    shared_per_sm: int = 0  # bytes of shared memory (LDS) per SM / CU; 0: max_shared
    regs_per_sm: int = 65536  # 32-bit registers per SM (CUDA); per SIMD lane x 4 SIMDs (HIP: 512 x 4)
    max_warps_per_sm: int = 64  # resident warps (wavefronts) per SM / CU
    max_ctas_per_sm: int = 32  # resident CTAs (workgroups) per SM / CU
    # The memory system, for Little's law (bytes in flight = bandwidth x latency):
    mem_bw: float = 0.0  # peak DRAM bandwidth, bytes/s (0: unknown)
    mem_latency_s: float = 0.0  # DRAM latency under a bandwidth-saturating load, seconds

    @property
    def is_hip(self) -> bool:
        return self.backend == "hip"

    @property
    def sm_shared(self) -> int:
        return self.shared_per_sm or self.max_shared

    @property
    def bytes_in_flight_needed(self) -> float:
        """Little's law: the bytes the whole chip must have requested and not yet received to
        run at its DRAM bandwidth (0 when the target's memory figures are unknown)."""
        return self.mem_bw * self.mem_latency_s


# Published limits (CUDA C++ Programming Guide, "Compute Capabilities" / "Technical
# Specifications per Compute Capability"): 64K 32-bit registers, 64 resident warps and 32
# resident blocks per SM on 8.0 and 9.0; shared memory 164 KB per SM / 163 KB per block on 8.0,
# 228 KB per SM / 227 KB per block on 9.0 (plus 1 KB per block reserved for the system, see
# :func:`occupancy`). CDNA3 (LLVM AMDGPU backend, AMDGPUBaseInfo / llvm-calc-occupancy for
# gfx90a and gfx942): 4 SIMDs per CU, 512 unified VGPRs (+AGPRs) per lane per SIMD allocated in
# granules of 8, at most 8 waves per SIMD; 64 KiB of LDS per CU (AMD Instinct MI300 ISA guide).
# SM/CU counts: A100 108, H100 SXM 132, MI300X 304.
# Bandwidth: peak HBM bandwidth from the datasheets (A100 80GB SXM 2,039 GB/s; H100 SXM5
# 3.35 TB/s; MI300X 5.3 TB/s). Latency: an estimate of DRAM latency *under load*, not a
# datasheet figure. Pointer-chasing microbenchmarks put idle DRAM latency at several hundred
# nanoseconds on A100/H100 (e.g. Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU
# Architecture", arXiv:2402.13499; Chips and Cheese, "Nvidia's H100: Funny L2, and Tons of
# Bandwidth", 2023) and higher on MI300X, whose requests cross from the compute dies to the
# memory controllers of the I/O dies (Chips and Cheese, "Testing AMD's Giant MI300X", 2024);
# queueing at full bandwidth adds to that. The figures below (0.6 / 0.7 / 1.0 us) are meant
# as the pessimistic side (more bytes needed in flight); ``python -m
# treeattn_cli.bench.gpu_report`` measures the kernel against the copy bandwidth on a real GPU.
TARGETS = {
    "sm_80": Target("sm_80", "cuda", 80, 32, 108, 166912, shared_per_sm=167936, mem_bw=2.039e12, mem_latency_s=0.6e-6),
    "sm_90": Target("sm_90", "cuda", 90, 32, 132, 232448, shared_per_sm=233472, mem_bw=3.35e12, mem_latency_s=0.7e-6),
    "gfx942": Target(
        "gfx942",
        "hip",
        "gfx942",
        64,
        304,
        65536,
        shared_per_sm=65536,
        regs_per_sm=512 * 4,
        max_warps_per_sm=32,
        max_ctas_per_sm=32,
        mem_bw=5.3e12,
        mem_latency_s=1.0e-6,
    ),
}
INTERPRETER = Target("interpreter", "interpreter", None, 32, 4, 1 << 30)
RESERVED_SHARED_CUDA = 1024  # bytes of shared memory the system reserves per block (cc >= 8.0)


def occupancy(target: Target, regs: int, shared_bytes: int, num_warps: int) -> dict:
    """CTAs (workgroups) of a compiled kernel resident on one SM (CU) of ``target``, and what
    limits them: ``{"ctas", "by_regs", "by_shared", "by_warps"}``.

    CUDA: registers are allocated per warp in units of 256 (a thread's count rounded up to 8),
    and each of the 4 SM sub-partitions holds a quarter of the register file; a block also
    takes 1 KB of reserved shared memory. ROCm: one wavefront per SIMD per 4 waves of a
    workgroup; a SIMD holds ``512 // ceil8(VGPRs + AGPRs)`` waves (at most 8)."""
    regs = max(1, int(regs or 1))
    if target.is_hip:
        per_simd = min(8, (target.regs_per_sm // 4) // (-(-regs // 8) * 8))
        simds = 4
        by_regs = (per_simd * simds) // max(1, num_warps)
        need = shared_bytes
    else:
        per_warp = -(-(-(-regs // 8) * 8) * target.warp_size // 256) * 256
        by_regs = 4 * ((target.regs_per_sm // 4) // per_warp) // max(1, num_warps)
        need = shared_bytes + (RESERVED_SHARED_CUDA if target.backend == "cuda" else 0)
    by_shared = target.sm_shared // need if need > 0 else target.max_ctas_per_sm
    by_warps = target.max_warps_per_sm // max(1, num_warps)
    ctas = max(0, min(by_regs, by_shared, by_warps, target.max_ctas_per_sm))
    return {"ctas": ctas, "by_regs": by_regs, "by_shared": by_shared, "by_warps": by_warps}


_state: dict = {"offline": None, "compiled": None, "interpreted": None, "counted": None}
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
            known = TARGETS.get(arch)
            t = (
                replace(known, n_sms=props.multi_processor_count)
                if known
                else Target(
                    arch,
                    "hip",
                    arch,
                    64,
                    props.multi_processor_count,
                    65536,
                    shared_per_sm=65536,
                    regs_per_sm=512 * 4,
                    max_warps_per_sm=32,
                )
            )
        else:
            cc = props.major * 10 + props.minor
            known = TARGETS.get(f"sm_{cc}")
            if known:  # the same chip family: its limits; this board's SMs and memory (H100 PCIe, H200)
                t = replace(known, n_sms=props.multi_processor_count, mem_bw=_board_bandwidth(props) or known.mem_bw)
            else:
                t = Target(
                    f"sm_{cc}",
                    "cuda",
                    cc,
                    32,
                    props.multi_processor_count,
                    getattr(props, "shared_memory_per_block_optin", 49152),
                    shared_per_sm=getattr(props, "shared_memory_per_multiprocessor", 0),
                    regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
                    max_warps_per_sm=getattr(props, "max_threads_per_multi_processor", 2048) // 32,
                    mem_bw=_board_bandwidth(props),
                    mem_latency_s=0.7e-6,
                )
        _cuda_targets[idx] = t
    return _cuda_targets[idx]


def _board_bandwidth(props) -> float:
    """Peak DRAM bandwidth of a live board from its memory clock (kHz) and bus width (bits),
    double data rate; 0 when this torch does not expose them."""
    clock, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2.0 * clock * 1e3 * width / 8 if clock and width else 0.0


def launch(kernel, grid, *args, **kw):
    """``kernel[grid](*args, **kw)``, or, inside :func:`compile_only`, compile that launch for
    the stand-in target and record ``(kernel name, compiled kernel, grid)``."""
    if _state["compiled"] is not None:
        ck = kernel.warmup(*args, grid=grid, **kw)
        _state["compiled"].append((kernel.fn.__name__, ck, tuple(grid)))
        return ck
    if _state["interpreted"] is None:  # under Triton's interpreter: its helpers' calls made cheaper,
        interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"  # its conversions a GPU's
        _state["interpreted"] = interpreting and quicken()
        if interpreting:
            round_as_gpus_do()
    if _state["counted"] is not None:  # a census of launches (bench/census.py): one, whatever it runs
        _state["counted"].append(kernel.fn.__name__)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # (the interpreter's own tensor work is not the step's)
            return kernel[grid](*args, **kw)
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
