"""``treeattn check``: prove, on this machine's devices and backend, every path it will take: the
kernels (``verify/kernels.py``, whose verdict ``generate`` consults), the merges and ring decode
across ranks and ``generate`` end to end (``verify/ranks.py``); with ``--kv-dtype``, how a lossy
KV cache moves the model's predictions on the user's document (``verify/fidelity.py``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..engine.job import plan_devices
from ..verify.kernels import kernel_checks, save_verdict, skipped
from ..verify.ranks import dist_rank, generate_checks


def check_command(*, nproc=None, device="auto", backend="auto", kernels_only=False, on_progress=None) -> list[dict]:
    """Run every check for this machine (``kernels_only``: the kernel part, as ``generate`` does
    on first use); caches the kernel verdict; returns the records."""
    import tempfile

    from ..parallel.forkserver import MANY_LAUNCHES
    from ..parallel.launch import run_local

    MANY_LAUNCHES["on"] = True  # its checks start ranks again and again
    kind, be, n, devices = plan_devices(device, backend, nproc)
    dev = torch.device(devices[0])
    t0 = time.perf_counter()
    told = on_progress or (lambda what: None)

    def say(what):  # each line says when it began: where a slow check spends its time
        told(f"[{time.perf_counter() - t0:.0f} s] {what}")

    say(f"kernels on {dev}")
    records = kernel_checks(dev, full=not kernels_only, say=say)
    save_verdict(dev, records)
    if kernels_only:
        return records
    say(f"merge schemes and ring decode on {n} {kind} rank(s) over {be}")
    try:
        records += run_local(dist_rank, n, 1234, backend=be, devices=devices, timeout_s=120)[0]
    except Exception as e:
        records.append({**skipped("merge/*", ""), "verdict": "FAIL", "note": str(e)[:200]})
    say("generate, tiny model, against transformers")
    with tempfile.TemporaryDirectory(prefix="treeattn-check-") as tmp:
        records += generate_checks(n, be, devices, Path(tmp))
    return records


def fidelity_command(
    *,
    kv_dtype: str,
    prompt_file: str | None,
    model: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    new_tokens: int = 32,
    max_tokens: int | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    on_progress=None,
) -> dict:
    """``check --kv-dtype K --prompt-file DOC``: the fidelity of storing the document's KV as K
    against the model's own dtype (``verify/fidelity.py``), on one device; recorded per model."""
    from ..model import load as M
    from ..storage.kvstore import model_identity
    from ..verify import fidelity
    from . import prompt as P
    from ..storage.kvdtypes import KV_DTYPES

    if kv_dtype not in KV_DTYPES or kv_dtype == "auto":
        raise ValueError(
            f"--kv-dtype must be one of {', '.join(k for k in KV_DTYPES if k != 'auto')}, got {kv_dtype!r}"
        )
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be one of auto, float32, bfloat16, float16, got {dtype!r}")
    if prompt_file is None:
        raise ValueError("check --kv-dtype measures on your document: give --prompt-file DOC")
    if new_tokens < 1 or (max_tokens is not None and max_tokens < 2):
        raise ValueError("--max-new-tokens must be >= 1 and --max-tokens >= 2")
    _, _, _, devices = plan_devices(device, "auto", 1)
    dev = torch.device(devices[0])
    model_dir = M.resolve(model, allow_pickle=allow_pickle)
    config = M.load_config(model_dir, trust_remote_code)
    tok = M.load_tokenizer(model_dir, trust_remote_code)
    text = P.read_text(None, prompt_file, context=M.context_length(config))
    ids = tok(text).input_ids[:max_tokens] if max_tokens else tok(text).input_ids
    if len(ids) < 2:
        raise ValueError(f"{prompt_file}: fewer than 2 tokens to measure on")
    dt = M.pick_dtype(dtype, dev)
    if kv_dtype == str(dt).replace("torch.", ""):
        raise ValueError(f"--kv-dtype {kv_dtype} is the model's own dtype here: nothing to compare")
    say = on_progress or (lambda what: None)
    say(f"{len(ids)} tokens of {prompt_file}, KV as {kv_dtype} against {dt} on {dev}")
    last = [0.0]

    def progress(done, n):
        if time.monotonic() - last[0] > 5 or done == n:
            last[0] = time.monotonic()
            say(f"prefill {done}/{n}")

    rec = fidelity.measure(
        model_dir,
        ids,
        kv_dtype=kv_dtype,
        dtype=dt,
        device=dev,
        new_tokens=new_tokens,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        on_progress=progress,
    )
    rec["model"] = str(model or "embedded demo model")
    rec["document"] = str(prompt_file)
    fidelity.save(model_identity(model_dir), rec, text)
    return rec
