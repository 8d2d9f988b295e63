"""Triton's interpreter (``TRITON_INTERPRET=1``: the CPU tests, ``treeattn check`` on a CPU) without
its repeated patching of ``triton.language``.

A kernel's launch under the interpreter patches ``triton.language`` (its builtins, ``tensor``'s,
``math``'s) into host versions, runs every program of the grid, and restores it. Each call of a
``@triton.jit`` helper from inside the kernel patches it all again (``InterpretedFunction.__call__``
-> ``_patch_lang``, an ``inspect.getmembers`` over each module), though the launch around it has
done so already and nothing undoes it before the launch ends: measured on the paged kernel's
end-to-end test, 16 % of the interpreter's time (Triton 3.9). :func:`quicken` makes a helper's
call skip that when the running launch has patched every ``triton.language`` module the helper
sees; a launch still patches, and restores, as before. The same host functions run either way,
so the numbers are the interpreter's own; on a Triton whose interpreter is not shaped as this
expects, nothing changes.

:func:`round_as_gpus_do`: the interpreter (3.9) narrows fp32 to bf16 by dropping bits, and to fp8
by adding the first dropped bit (no ties to even, no saturation), where a GPU rounds to nearest
even (and, to fp8 on NVIDIA, saturates finite values: ``cvt.rn.satfinite``). A kernel's bf16 or
fp8 results on a CPU then differ from the same kernel's on a GPU, and from torch's, by one unit
in a few percent of the elements. It makes every float conversion between the dtypes torch knows
torch's own (round to nearest even; fp8 saturated as above), so an interpreted kernel can be
held to a reference bit for bit.
"""

from __future__ import annotations

import inspect
import threading
import types

import numpy as np

_state = threading.local()  # .launching: a launch is about to patch; .langs: ids of the modules it patched


def _langs(fn, tl) -> frozenset:
    # the modules _patch_lang patches for fn (triton.language and its core, as fn's module sees them)
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def quicken() -> bool:
    """Install the skip (once; idempotent). Returns whether it is in place."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    if getattr(interp, "_treeattn_quickened", False):
        return True
    if not all(hasattr(interp, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction")):
        return False
    patch, launch = interp._patch_lang, interp.GridExecutor.__call__
    _EVERY_LANG = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})  # what _patch_lang reads of a fn

    def patch_lang(fn):
        if getattr(_state, "launching", False):  # the launch's own patch, of every module a helper
            _state.launching = False  # may see (Triton's own helpers, tl.max, tl.cdiv, see tl.core)
            scope = patch(_EVERY_LANG)
            _state.langs = _langs(_EVERY_LANG, tl)
            return scope
        running = getattr(_state, "langs", None)
        if running is not None and _langs(fn, tl) <= running:
            return interp._LangPatchScope()  # a helper inside that launch: nothing to patch or undo
        return patch(fn)

    def launch_once_patched(self, *args, **kwargs):
        _state.launching, _state.langs = True, None
        try:
            return launch(self, *args, **kwargs)  # patches, runs the grid, restores
        finally:
            _state.launching, _state.langs = False, None

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = launch_once_patched
    interp._treeattn_quickened = True
    return True


def round_as_gpus_do() -> bool:
    """Install the faithful conversions (once; idempotent). Returns whether they are in place."""
    try:
        import torch
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    if getattr(interp, "_treeattn_rounding", False):
        return True
    if not callable(getattr(interp, "_convert_float", None)):
        return False
    original = interp._convert_float
    torch_of = {
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e4b8: torch.float8_e4m3fnuz,
        tl.float8e5: torch.float8_e5m2,
        tl.float8e5b16: torch.float8_e5m2fnuz,
    }
    bits = {8: (np.int8, torch.int8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32)}
    rtz = getattr(getattr(interp, "_ir", None), "ROUNDING_MODE", None)
    rtz = getattr(rtz, "RTZ", object())

    from torch.utils._python_dispatch import _disable_current_modes

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        src, dst = torch_of.get(input_dtype), torch_of.get(output_dtype)
        if src is None or dst is None or rounding_mode == rtz:
            return original(input, input_dtype, output_dtype, rounding_mode)
        with _disable_current_modes():  # (the interpreter's own work: no census, no graph capture sees it)
            return narrowed(input, input_dtype, output_dtype, src, dst)

    def narrowed(input, input_dtype, output_dtype, src, dst):
        a = np.ascontiguousarray(input).reshape(-1)
        np_in, t_in = bits[input_dtype.primitive_bitwidth]
        np_out, t_out = bits[output_dtype.primitive_bitwidth]
        x = torch.from_numpy(a.view(np_in).copy()).view(t_in).view(src)
        if dst.itemsize == 1 and src.itemsize > 1:  # saturated to the largest finite value
            big = torch.finfo(dst).max
            x = x.float().clamp(-big, big)
        y = x.to(dst).view(t_out).numpy().view(np_out)
        return y.view(getattr(np, f"uint{output_dtype.primitive_bitwidth}")).reshape(np.shape(input))

    interp._convert_float = convert_float
    interp._treeattn_rounding = True
    return True
