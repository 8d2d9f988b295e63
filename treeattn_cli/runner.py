"""``treeattn generate``: validate and prepare in the launching process, then what each rank does.

:func:`generate_command` checks every flag, resolves the model, tokenises the prompt and
checks it against the model's context before any rank starts; then it launches the ranks (or
joins torchrun's) and feeds rank 0's events to the presentation (``report.GenerateView``).
:func:`rank_generate` is one rank: load the model, build the communicator and the sharded
cache, run :class:`decode.Decoder`; only rank 0 sends events (``prefill`` progress, one
``token`` per new token, ``done`` with timings).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

import torch

from .attention import AttentionContext
from .cache import ShardedKVCache
from .comm import make_comm
from .decode import Decoder, Sampling, Timings
from .model import load_model, load_tokenizer, pick_dtype, shapes


@dataclass
class GenerateJob:
    model_dir: str
    prompt_ids: list[int]
    max_new_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    eos_ids: list[int] = field(default_factory=list)
    dtype: str = "auto"
    scheme: str = "allreduce"
    groups: list | None = None
    inner: str = "allreduce"
    outer: str = "tree"
    prefill_chunk: int | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False
    decode_method: str = "tree"  # "ring": the baseline, for bench
    static: bool | None = None  # fixed-shape decode step (default: on CUDA)
    cuda_graph: bool = True  # capture the static step in a CUDA graph (CUDA + NCCL)


def make_stop_check(job: GenerateJob, tokenizer):
    eos = set(job.eos_ids)

    def check(ids: list[int]):
        if ids[-1] in eos:
            return "eos"
        if job.stop:
            tail = tokenizer.decode(ids[-32:], skip_special_tokens=True)
            if any(s in tail for s in job.stop):
                return "stop"
        return None

    return check


def rank_generate(ctx, job: GenerateJob):
    """Entry point of every rank (``launch.run_local`` / ``run_torchrun``)."""
    device = torch.device(ctx.device)
    dtype = pick_dtype(job.dtype, device)
    model = load_model(job.model_dir, dtype, device, trust_remote_code=job.trust_remote_code,
                       allow_pickle=job.allow_pickle)
    sh = shapes(model.config)
    n = len(job.prompt_ids)
    comm = make_comm(job.scheme, job.groups, job.inner, job.outer)
    cap = math.ceil(n / ctx.world) + math.ceil(job.max_new_tokens / ctx.world) + 2
    static = job.static if job.static is not None else device.type == "cuda"
    cache = ShardedKVCache(sh["num_layers"], 1, sh["kv_heads"], sh["head_dim"], dtype=dtype,
                           device=device, rank=ctx.rank, world=ctx.world, capacity=cap, static=static)
    dec = Decoder(model, AttentionContext(comm, cache, decode_method=job.decode_method),
                  vocab_size=model.get_output_embeddings().weight.shape[0],
                  cuda_graph=job.cuda_graph and ctx.backend == "nccl" and job.decode_method == "tree")
    lead = ctx.rank == 0
    stop_check = make_stop_check(job, load_tokenizer(job.model_dir)) if lead else None
    timings = Timings()
    ids = torch.tensor([job.prompt_ids], dtype=torch.int64)
    progress = (lambda done, total: ctx.send("prefill", (done, total))) if lead else None
    reason, count = None, 0
    for tok, reason in dec.generate(ids, max_new_tokens=job.max_new_tokens, sampling=job.sampling,
                                    stop_check=stop_check, piece=job.prefill_chunk,
                                    on_progress=progress, timings=timings):
        count += 1
        if lead:
            ctx.send("token", tok)
    if not lead:
        return None
    summary = {
        "prompt_tokens": n, "new_tokens": count, "ttft_s": timings.ttft_s,
        "prefill_s": timings.prefill_s,
        "prefill_tokens_per_s": n / timings.prefill_s if timings.prefill_s else None,
        "decode_tokens_per_s": (count - 1) / timings.decode_s if count > 1 and timings.decode_s else None,
        "nproc": ctx.world, "shard_tokens": cache.counts[0].tolist(), "scheme": job.scheme,
        "stop_reason": reason, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "cuda_graph": dec.graph is not None,
    }
    if dec.graph_note:
        summary["note"] = dec.graph_note
    ctx.send("done", summary)
    return summary


# ---------------------------------------------------------------- the launching process

@dataclass
class GenerateOptions:
    """The flags of ``treeattn generate`` (see ``main.generate`` for their help)."""

    model: str | None = None
    prompt: str | None = None
    prompt_file: str | None = None
    chat: bool | None = None
    system: str | None = None
    max_new_tokens: int | None = None  # None: 256, or 96 for the demo
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: list = field(default_factory=list)
    prefill_chunk: int | None = None
    nproc: int | None = None
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    scheme: str = "auto"
    output: str | None = None
    json: bool = False
    timeout: float = 300.0
    allow_pickle: bool = False
    trust_remote_code: bool = False
    layout: str | None = None  # a profile (name or YAML path) for the layout choice


def _check_flags(o: GenerateOptions) -> None:
    from .comm import SCHEMES

    if o.max_new_tokens is not None and o.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {o.max_new_tokens}")
    if not o.temperature >= 0 or o.temperature != o.temperature:
        raise ValueError(f"--temperature must be >= 0, got {o.temperature}")
    if o.top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {o.top_k}")
    if not 0 < o.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {o.top_p}")
    if o.prefill_chunk is not None and o.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1, got {o.prefill_chunk}")
    if o.nproc is not None and o.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {o.nproc}")
    if not o.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {o.timeout}")
    for flag, val, choices in (("--backend", o.backend, ("auto", "nccl", "gloo")),
                               ("--device", o.device, ("auto", "cuda", "cpu")),
                               ("--dtype", o.dtype, ("auto", "float32", "bfloat16", "float16")),
                               ("--scheme", o.scheme, ("auto", *SCHEMES))):
        if val not in choices:
            raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {val!r}")


def plan_devices(device: str, backend: str, nproc: int | None):
    """(device kind, backend, nproc, per-rank device strings) after defaults and checks."""
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind = device if device != "auto" else ("cuda" if ngpu else "cpu")
    if kind == "cuda" and not ngpu:
        raise ValueError("--device cuda: no CUDA device is visible")
    be = backend if backend != "auto" else ("nccl" if kind == "cuda" else "gloo")
    if be == "nccl" and kind != "cuda":
        raise ValueError("--backend nccl needs --device cuda")
    n = nproc if nproc is not None else (ngpu if kind == "cuda" else 2)
    if kind == "cuda" and n > ngpu:
        raise ValueError(f"--nproc {n} needs {n} GPUs (one per rank); {ngpu} visible")
    devices = [f"cuda:{r}" for r in range(n)] if kind == "cuda" else ["cpu"] * n
    return kind, be, n, devices


def _eos_ids(model_dir, config, tokenizer) -> list[int]:
    ids = []
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_dir)
        ids.append(gen.eos_token_id)
    except Exception:
        pass
    ids += [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    flat = []
    for x in ids:
        flat += x if isinstance(x, (list, tuple)) else [x]
    return sorted({int(x) for x in flat if x is not None})


def _merge_plan(o: GenerateOptions, kind: str, n: int, config):
    """(scheme, groups, inner, outer): the layout ``treeattn topo`` would choose for this run
    (``--scheme auto``), or the scheme asked for; ``hierarchical`` takes the layout's groups
    (one group of every rank on a uniform fabric)."""
    from .layout import load_profile, plan_for_run
    from .model import shapes

    if o.scheme not in ("auto", "hierarchical"):
        if o.layout:
            load_profile(o.layout)  # still a usage error if it is bad
        return o.scheme, None, None, None
    sh = shapes(config)
    lay = plan_for_run(kind, n, heads=sh["heads"], head_dim=sh["head_dim"], layers=sh["num_layers"],
                       profile=o.layout)
    if o.scheme == "hierarchical" and lay.scheme != "hierarchical":
        return "hierarchical", [list(range(n))], lay.scheme, "tree"
    return lay.scheme, lay.groups, lay.inner, lay.outer


def prepare(o: GenerateOptions):
    """Everything checkable before a rank starts: (job, tokenizer, devices plan)."""
    from . import model as M
    from . import prompt as P

    _check_flags(o)
    kind, be, n, devices = plan_devices(o.device, o.backend, o.nproc)
    M.pick_dtype(o.dtype, torch.device(devices[0]))
    text = P.read_text(o.prompt, o.prompt_file)
    system = o.system
    chat = o.chat
    demo = text is None
    if demo:
        if o.model is not None:
            raise P.PromptError("no prompt: give --prompt, --prompt-file or pipe text to standard input")
        text, demo_system = P.demo_prompt()
        system = system if system is not None else demo_system
        chat = True if chat is None else chat
    o.max_new_tokens = o.max_new_tokens or (96 if demo else 256)
    model_dir = M.resolve(o.model, allow_pickle=o.allow_pickle)
    config = M.load_config(model_dir, o.trust_remote_code)
    tok = M.load_tokenizer(model_dir, o.trust_remote_code)
    ids = P.build_ids(tok, text, chat=bool(chat), system=system)
    ctx_len = M.context_length(config)
    if ctx_len and len(ids) + o.max_new_tokens > ctx_len:
        raise ValueError(f"the prompt is {len(ids)} tokens; with --max-new-tokens {o.max_new_tokens} "
                         f"that exceeds the model's context of {ctx_len} tokens")
    scheme, groups, inner, outer = _merge_plan(o, kind, n, config)
    job = GenerateJob(model_dir=str(model_dir), prompt_ids=ids, max_new_tokens=o.max_new_tokens,
                      sampling=Sampling(o.temperature, o.top_k, o.top_p, o.seed), stop=list(o.stop),
                      eos_ids=_eos_ids(model_dir, config, tok), dtype=o.dtype, scheme=scheme,
                      groups=groups, inner=inner or "allreduce", outer=outer or "tree",
                      prefill_chunk=o.prefill_chunk, trust_remote_code=o.trust_remote_code,
                      allow_pickle=o.allow_pickle)
    if demo:
        print(f"treeattn demo: the embedded SmolLM2-135M-Instruct on {n} {kind.upper()} rank(s) reads "
              f"treeattn_cli/data/demo_document.txt ({len(ids)} tokens with the chat template) and "
              f"answers:\n  {P.DEMO_QUESTION}", file=sys.stderr)
    return job, tok, (kind, be, n, devices)


def generate_command(o: GenerateOptions) -> int:
    """Run ``treeattn generate``; returns the exit code (0, 1 on a failed run, 130 on Ctrl-C)."""
    from . import launch
    from .report import GenerateView, write_atomic

    job, tok, (kind, be, n, devices) = prepare(o)
    torchrun = launch.under_torchrun()
    lead = not torchrun or int(os.environ["RANK"]) == 0
    view = GenerateView(tok, stream=not o.json and lead, progress=lead and sys.stderr.isatty())
    code, reason, error = 0, None, None
    try:
        if torchrun:
            local = int(os.environ.get("LOCAL_RANK", 0))
            launch.run_torchrun(rank_generate, job, backend=be, timeout_s=o.timeout,
                                device=f"cuda:{local}" if kind == "cuda" else "cpu",
                                on_event=view.on_event)
        else:
            launch.run_local(rank_generate, n, job, backend=be, devices=devices,
                             timeout_s=o.timeout, on_event=view.on_event)
    except KeyboardInterrupt:
        code, reason = 130, "interrupted"
    except launch.LaunchError as e:
        code, reason, error = 1, "error", e
    if not lead:
        return code
    record = view.finish(stop_reason=reason, as_json=o.json)
    if o.output:
        write_atomic(o.output, record["text"])
    if error is not None:
        print(f"treeattn: error: {error}", file=sys.stderr)
    return code
