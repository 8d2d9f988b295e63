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
"""

from __future__ import annotations

import inspect
import threading
import types

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
