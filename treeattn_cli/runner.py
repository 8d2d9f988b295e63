"""``treeattn generate``: validate and prepare in the launching process, then run the ranks.

:func:`prepare_run` settles what ``generate`` and ``chat`` share before any rank starts (flags,
devices, model, tokenizer, the mesh's validity, the merge plan, the kernel verdict) and
:func:`prepare` adds ``generate``'s prompt (and a saved cache to continue); then
:func:`generate_command` launches the ranks (or joins torchrun's) and feeds rank 0's events to
the presentation (``report.GenerateView``). Each rank runs the persistent engine
(``engine.py``) on ``generate``'s requests: append the prompt, decode.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

from .decode import Sampling
from .mesh import check_tp
from .model import shapes
from .options import GenerateOptions, check_flags
from .probe import probe_model


@dataclass
class GenerateJob:
    """What every rank needs: the engine's spec (model, mesh, plan) and ``generate``'s request."""

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
    reference: bool = False  # the fast kernels failed their self-check here: the torch reference
    tp: int = 1  # tensor-parallel ranks per sequence shard (mesh.py)
    tp_plan: dict | None = None  # None: the model's own plan; else ours (tp.attention_plan)
    tp_heads_split: bool = True  # the plan gives each tp rank 1/T of the heads (tp.heads_split)
    auto_layout: bool = False  # the scheme came from the layout: re-plan when ranks span nodes
    layout_profile: str | None = None
    load_kv: str | None = None  # a saved cache to continue (kvstore.py), validated in the launcher
    load_manifest: dict | None = None
    save_kv: str | None = None  # save the prompt's cache here after the answer
    save_meta: dict = field(default_factory=dict)  # identity, composition, nonce of the save
    reserve: int | None = None  # tokens to make room for up front (default: prompt + answer)
    prefill_sharding: str = "balanced"  # or "contiguous" (prefill.py): how segments are cut

    @property
    def reserve_tokens(self) -> int:
        if self.reserve is not None:
            return self.reserve
        cached = self.load_manifest["tokens"]["count"] if self.load_manifest else 0
        return cached + len(self.prompt_ids) + self.max_new_tokens


# ---------------------------------------------------------------- the launching process

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


def _merge_plan(o: GenerateOptions, kind: str, n: int, config, tp: int = 1):
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
    lay = plan_for_run(kind, n, heads=sh["heads"] // tp, head_dim=sh["head_dim"], layers=sh["num_layers"],
                       profile=o.layout)
    if o.scheme == "hierarchical" and lay.scheme != "hierarchical":
        return "hierarchical", [list(range(n))], lay.scheme, "tree"
    return lay.scheme, lay.groups, lay.inner, lay.outer


def _kernels_failed(device: str) -> bool:
    """Whether this machine's fast kernels failed their self-check (``treeattn check``; run
    once per machine and software versions, then cached): then the run takes the reference
    path, exact but slower, and says so on one line. Never a silently wrong answer. Under
    torchrun only local rank 0 of each node runs the check, on its own device; the node's other
    processes wait for its verdict instead of all checking GPU 0 at once."""
    from . import launch
    from .check import kernel_verdict, wait_for_verdict

    local = int(os.environ.get("LOCAL_RANK", 0)) if launch.under_torchrun() else 0
    v = kernel_verdict(torch.device(device)) if local == 0 else wait_for_verdict(torch.device(device))
    if v.get("ok"):
        return False
    print(f"treeattn: warning: the fast attention kernels failed their self-check on this machine "
          f"({', '.join(v.get('failed', []))}): using the reference path (exact, slower); "
          f"see `treeattn check`", file=sys.stderr)
    return True


@dataclass
class Run:
    """What ``generate`` and ``chat`` settle in the launcher before any rank starts."""

    kind: str  # "cuda" | "cpu"
    backend: str
    nproc: int
    devices: list
    model_dir: object
    config: object
    tokenizer: object
    context: int | None  # the model's context, tokens
    shapes: dict
    dtype: str  # the run's dtype name, as a saved cache records it
    plan: tuple  # (scheme, groups, inner, outer) of the merge, over a cp group
    reference: bool  # the fast kernels failed their self-check: the reference path
    tp_plan: dict | None = None  # with --tp: None (the model's own plan) or ours
    tp_heads_split: bool = True

    def job(self, o, ids, **kw) -> GenerateJob:
        scheme, groups, inner, outer = self.plan
        return GenerateJob(model_dir=str(self.model_dir), prompt_ids=ids, max_new_tokens=o.max_new_tokens,
                           sampling=Sampling(o.temperature, o.top_k, o.top_p, o.seed), stop=list(o.stop),
                           eos_ids=_eos_ids(self.model_dir, self.config, self.tokenizer), dtype=o.dtype,
                           scheme=scheme, groups=groups, inner=inner or "allreduce", outer=outer or "tree",
                           prefill_chunk=o.prefill_chunk, trust_remote_code=o.trust_remote_code,
                           allow_pickle=o.allow_pickle, reference=self.reference, tp=o.tp,
                           auto_layout=o.scheme == "auto", layout_profile=o.layout,
                           prefill_sharding=o.prefill_sharding, tp_plan=self.tp_plan,
                           tp_heads_split=self.tp_heads_split, **kw)

    def identity(self) -> dict:
        from .kvstore import model_identity

        return model_identity(self.model_dir)

    def load_kv(self, path: str) -> dict:
        """The validated manifest of a saved cache for this run (KVError: exit 2)."""
        from .kvstore import validate

        sh = self.shapes
        return validate(path, identity=self.identity(), dtype=self.dtype,
                        shapes={"layers": sh["num_layers"], "kv_heads": sh["kv_heads"], "head_dim": sh["head_dim"]})

    def save_meta(self, path: str, composition: dict) -> dict:
        """Where ``--save-kv`` writes, checked now (exit 2), and what the manifest records."""
        import secrets
        from pathlib import Path

        from .kvstore import MANIFEST, KVError

        p = Path(path)
        if p.exists() and not (p / MANIFEST).exists():
            raise KVError(f"--save-kv {p}: exists and is not a saved treeattn cache (not overwritten)")
        if not p.parent.is_dir() or not os.access(p.parent, os.W_OK):
            raise KVError(f"--save-kv {p}: {p.parent} is not a writable directory")
        return {"identity": self.identity(), "composition": composition, "nonce": secrets.token_hex(4)}

    def check_fits(self, tokens: int, new_tokens: int, what: str = "the prompt") -> None:
        if self.context and tokens + new_tokens > self.context:
            raise ValueError(f"{what} is {tokens} tokens; with --max-new-tokens {new_tokens} "
                             f"that exceeds the model's context of {self.context} tokens")


def prepare_run(o: GenerateOptions) -> Run:
    """Flags, devices, model, tokenizer, the mesh's validity, the merge plan, the kernel verdict."""
    from . import model as M

    check_flags(o)
    kind, be, n, devices = plan_devices(o.device, o.backend, o.nproc)
    dtype = M.pick_dtype(o.dtype, torch.device(devices[0]))
    model_dir = M.resolve(o.model, allow_pickle=o.allow_pickle)  # None: the embedded demo model
    config = M.load_config(model_dir, o.trust_remote_code)
    probe_model(config, o.trust_remote_code)  # our attention against transformers', once per family and config
    tok = M.load_tokenizer(model_dir, o.trust_remote_code)
    sh = shapes(config)
    check_tp(o.tp, sh["heads"], sh["kv_heads"], n)
    tp_plan, split = _tp_plan(config, o.tp, o.trust_remote_code)
    plan = _merge_plan(o, kind, n // o.tp, config, o.tp if split else 1)  # over a cp group
    return Run(kind, be, n, devices, model_dir, config, tok, M.context_length(config), sh,
               str(dtype).replace("torch.", ""), plan, _kernels_failed(devices[0]), tp_plan, split)


def _tp_plan(config, tp: int, trust_remote_code: bool):
    """With ``--tp T > 1``: ``(plan, heads split)`` — None for the model's own plan, or ours for a
    model without one; whether each tp rank attends with 1/T of the heads. One line (exit 2)
    when transformers' loader cannot take our sub-mesh or the model cannot be split."""
    from . import tp as TP

    if tp == 1:
        return None, True
    problem = TP.hook_problem()
    if problem:
        raise ValueError(problem)
    own = TP.model_plan(config)
    if own:
        return None, TP.heads_split(own)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # names only: no weights are read or allocated
        names = [n for n, _ in AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
                 .named_parameters()]
    plan = TP.attention_plan({n.rsplit(".", 1)[0] for n in names if n.endswith(".weight")} | set(names))
    if not plan:
        raise ValueError(f"--tp {tp}: model type '{config.model_type}' has no tensor-parallel plan and no separate "
                         "q/k/v/o projections to split by heads; use --tp 1")
    print(f"treeattn: model type '{config.model_type}' has no tensor-parallel plan in transformers: --tp {tp} "
          "splits its attention by heads and replicates the rest of its weights", file=sys.stderr)
    return plan, True


def prepare(o: GenerateOptions):
    """Everything checkable before a rank starts: (job, tokenizer, devices plan)."""
    from . import prompt as P

    if o.prompt is not None and o.prompt_file is not None:
        raise P.PromptError("give either --prompt or --prompt-file, not both")
    run = prepare_run(o)
    text = P.read_text(o.prompt, o.prompt_file, context=run.context)  # bounded by the context
    system, chat = o.system, o.chat
    demo = text is None
    if demo:
        if o.model is not None or o.load_kv:
            raise P.PromptError("no prompt: give --prompt, --prompt-file or pipe text to standard input"
                                + (" (--load-kv continues the cached document with it)" if o.load_kv else ""))
        text, demo_system = P.demo_prompt()
        system = system if system is not None else demo_system
        chat = True if chat is None else chat
    o.max_new_tokens = o.max_new_tokens or (96 if demo else 256)
    manifest, cached = None, 0
    if o.load_kv:
        manifest = run.load_kv(o.load_kv)
        cached = manifest["tokens"]["count"]
        ids = P.question_ids(run.tokenizer, text, manifest["composition"])
    else:
        ids = P.build_ids(run.tokenizer, text, chat=bool(chat), system=system)
    run.check_fits(cached + len(ids), o.max_new_tokens,
                   "the cached document and the prompt" if o.load_kv else "the prompt")
    composition = manifest["composition"] if manifest else {"kind": "raw"}
    job = run.job(o, ids, load_kv=o.load_kv, load_manifest=manifest, save_kv=o.save_kv,
                  save_meta=run.save_meta(o.save_kv, composition) if o.save_kv else {})
    if demo:
        print(f"treeattn demo: the embedded SmolLM2-135M-Instruct on {run.nproc} {run.kind.upper()} rank(s) "
              f"reads treeattn_cli/data/demo_document.txt ({len(ids)} tokens with the chat template) and "
              f"answers:\n  {P.DEMO_QUESTION}", file=sys.stderr)
    return job, run.tokenizer, (run.kind, run.backend, run.nproc, run.devices)


def generate_command(o: GenerateOptions) -> int:
    """Run ``treeattn generate``; returns the exit code (0, 1 on a failed run, 130 on Ctrl-C)."""
    from . import launch
    from .engine import rank_generate
    from .report import GenerateView, stats_line, stdout_closed, write_atomic

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
    except launch.Terminated:
        code, reason = 143, "terminated"
    except KeyboardInterrupt:
        code, reason = 130, "interrupted"
    except launch.LaunchError as e:
        code, reason, error = 1, "error", e
    except BrokenPipeError:  # `| head`: stop quietly; --output still gets the text so far
        code, reason = stdout_closed(), "interrupted"
    if not lead:
        return code
    record = view.finish(stop_reason=reason, as_json=o.json)
    if o.output:
        write_atomic(o.output, record["text"])
    if not o.quiet:
        print(stats_line(record), file=sys.stderr)
    if error is not None:
        if o.debug:  # the failing rank's own traceback, collected from it
            tb = next((v[1] for k, v in error.outcomes.values() if k == "error" and v[1]), None)
            if tb:
                print(tb.rstrip(), file=sys.stderr)
        print(f"treeattn: error: {error}", file=sys.stderr)
    return code
