"""What ``generate``, ``chat`` and ``serve`` settle in the launching process before any rank starts:
flags, devices, model, tokenizer, the mesh's validity, the tensor-parallel plan, the merge plan,
the first-use checks (the model family's probe, the kernels' verdict). :func:`prepare_run` returns
a :class:`Run`; each command adds its own prompt and requests.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

from ..parallel.mesh import check_tp
from ..engine.sampling import Sampling
from ..engine.job import EngineJob, plan_devices
from ..model.load import shapes
from ..verify.family import probe_model
from .options import GenerateOptions, check_flags


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
    from ..topology.layout import load_profile, plan_for_run

    if o.scheme not in ("auto", "hierarchical"):
        if o.layout:
            load_profile(o.layout)  # still a usage error if it is bad
        return o.scheme, None, None, None
    sh = shapes(config)
    lay = plan_for_run(
        kind, n, heads=sh["heads"] // tp, head_dim=sh["head_dim"], layers=sh["num_layers"], profile=o.layout
    )
    if o.scheme == "hierarchical" and lay.scheme != "hierarchical":
        return "hierarchical", [list(range(n))], lay.scheme, "tree"
    return lay.scheme, lay.groups, lay.inner, lay.outer


def _kernels_failed(device: str) -> bool:
    """Whether this machine's fast kernels failed their self-check (``treeattn check``; run
    once per machine and software versions, then cached): then the run takes the reference
    path, exact but slower, and says so on one line. Never a silently wrong answer. Under
    torchrun only local rank 0 of each node runs the check, on its own device; the node's other
    processes wait for its verdict instead of all checking GPU 0 at once."""
    from ..parallel import forkserver
    from ..verify.kernels import kernel_verdict, wait_for_verdict

    local = int(os.environ.get("LOCAL_RANK", 0)) if forkserver.under_torchrun() else 0
    v = kernel_verdict(torch.device(device)) if local == 0 else wait_for_verdict(torch.device(device))
    if v.get("ok"):
        return False
    print(
        f"treeattn: warning: the fast attention kernels failed their self-check on this machine "
        f"({', '.join(v.get('failed', []))}): using the reference path (exact, slower); "
        f"see `treeattn check`",
        file=sys.stderr,
    )
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
    kv_dtype: str  # how the KV cache is stored (storage/kvquant.storage): a dtype name or fp8_e4m3fn(uz)
    plan: tuple  # (scheme, groups, inner, outer) of the merge, over a cp group
    reference: bool  # the fast kernels failed their self-check: the reference path
    tp_plan: dict | None = None  # with --tp: None (the model's own plan) or ours
    tp_heads_split: bool = True
    notes: list = field(default_factory=list)  # lines for the user once every check has passed

    def job(self, o, ids, **kw) -> EngineJob:
        """What every rank is told; called once the run is settled (every check passed), so the
        notes the user should read before ranks start are said here, once."""
        for line in self.notes:
            print(f"treeattn: note: {line}", file=sys.stderr)
        self.notes = []
        scheme, groups, inner, outer = self.plan
        return EngineJob(
            model_dir=str(self.model_dir),
            prompt_ids=ids,
            max_new_tokens=o.max_new_tokens,
            sampling=Sampling(o.temperature, o.top_k, o.top_p, o.seed),
            stop=list(o.stop),
            eos_ids=_eos_ids(self.model_dir, self.config, self.tokenizer),
            dtype=o.dtype,
            kv_dtype=o.kv_dtype,
            scheme=scheme,
            groups=groups,
            inner=inner or "allreduce",
            outer=outer or "tree",
            prefill_chunk=o.prefill_chunk,
            trust_remote_code=o.trust_remote_code,
            allow_pickle=o.allow_pickle,
            reference=self.reference,
            tp=o.tp,
            auto_layout=o.scheme == "auto",
            layout_profile=o.layout,
            prefill_sharding=o.prefill_sharding,
            speculate=o.speculate,
            tp_plan=self.tp_plan,
            tp_heads_split=self.tp_heads_split,
            logprobs=getattr(o, "logprobs", None),
            digest=getattr(o, "digest", False),
            **kw,
        )

    def kv_bytes_per_token(self, tp: int) -> int:
        """Bytes of KV one token takes on all ranks together (tp peers that attend with every
        head each hold a copy), scales included."""
        from ..storage.kvdtypes import token_bytes

        sh = self.shapes
        return token_bytes(self.kv_dtype, sh["num_layers"], sh["kv_heads"], sh["head_dim"]) * (
            1 if self.tp_heads_split else tp
        )

    def identity(self) -> dict:
        from ..storage.kvstore import model_identity

        return model_identity(self.model_dir)

    def load_kv(self, path: str, note: bool = True) -> dict:
        """The validated manifest of a saved cache for this run (KVError: exit 2); ``note``: one
        line on stderr when its KV storage is converted to this run's ``--kv-dtype``."""
        from ..storage.kvstore import conversion, validate

        sh = self.shapes
        m = validate(
            path,
            identity=self.identity(),
            dtype=self.dtype,
            shapes={"layers": sh["num_layers"], "kv_heads": sh["kv_heads"], "head_dim": sh["head_dim"]},
        )
        line = conversion(m, self.kv_dtype)
        if note and line:
            print(f"treeattn: note: {path}: {line}", file=sys.stderr)
        return m

    def save_meta(self, path: str, composition: dict) -> dict:
        """Where ``--save-kv`` writes, checked now (exit 2), and what the manifest records."""
        import secrets
        from pathlib import Path

        from ..storage.kvstore import MANIFEST, KVError

        p = Path(path)
        if p.exists() and not (p / MANIFEST).exists():
            raise KVError(f"--save-kv {p}: exists and is not a saved treeattn cache (not overwritten)")
        if not p.parent.is_dir() or not os.access(p.parent, os.W_OK):
            raise KVError(f"--save-kv {p}: {p.parent} is not a writable directory")
        return {"identity": self.identity(), "composition": composition, "nonce": secrets.token_hex(4)}

    def cache_meta(self, path: str) -> dict:
        """``--cache-dir`` (``generate``, ``chat``): made if missing and writable, checked now
        (exit 2); what the manifests of the documents saved there record."""
        from pathlib import Path

        from ..storage.kvstore import KVError

        p = Path(path)
        if p.exists() and not p.is_dir():
            raise KVError(f"--cache-dir {p}: not a directory")
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KVError(f"--cache-dir {p}: cannot be made ({e.strerror or e})") from None
        if not p.is_dir() or not os.access(p, os.W_OK):
            raise KVError(f"--cache-dir {p}: not a writable directory")
        return {"identity": self.identity(), "composition": {"kind": "raw"}}

    def check_fits(self, tokens: int, new_tokens: int, what: str = "the prompt") -> None:
        if self.context and tokens + new_tokens > self.context:
            raise ValueError(
                f"{what} is {tokens} tokens; with --max-new-tokens {new_tokens} "
                f"that exceeds the model's context of {self.context} tokens"
            )


def prepare_run(o: GenerateOptions) -> Run:
    """Flags, devices, model, tokenizer, the mesh's validity, the merge plan, the kernel verdict."""
    from ..model import load as M

    check_flags(o)
    kind, be, n, devices = plan_devices(o.device, o.backend, o.nproc)
    dtype = M.pick_dtype(o.dtype, torch.device(devices[0]))
    from ..storage.kvquant import storage

    model_dir = M.resolve(o.model, allow_pickle=o.allow_pickle)  # None: the embedded demo model
    config = M.load_config(model_dir, o.trust_remote_code)
    probe_model(config, o.trust_remote_code)  # our attention against transformers', once per family and config
    tok = M.load_tokenizer(model_dir, o.trust_remote_code)
    sh = shapes(config)
    kv_name = storage(o.kv_dtype, dtype, torch.device(devices[0]), sh["head_dim"])[2]  # fp8 on sm_80: one line
    check_tp(o.tp, sh["heads"], sh["kv_heads"], n)
    tp_plan, split = _tp_plan(config, o.tp, o.trust_remote_code)
    plan = _merge_plan(o, kind, n // o.tp, config, o.tp if split else 1)  # over a cp group
    notes = [_fidelity_note(model_dir, kv_name)] if kv_name.startswith("fp8") else []
    if kind == "cuda":  # a GPU run without its decode kernel is slower: said once, at start
        from treeattn_kernels import triton_problem

        problem = triton_problem()
        notes += [f"{problem}: decode runs on ATen's kernels instead (exact, slower)"] if problem else []
    return Run(
        kind,
        be,
        n,
        devices,
        model_dir,
        config,
        tok,
        M.context_length(config),
        sh,
        str(dtype).replace("torch.", ""),
        kv_name,
        plan,
        _kernels_failed(devices[0]),
        tp_plan,
        split,
        [x for x in notes if x],
    )


def _fidelity_note(model_dir, kv_name: str) -> str | None:
    """A line when no fidelity check of this lossy KV storage is recorded for this model."""
    from ..storage.kvstore import model_identity
    from ..verify.fidelity import recorded

    if recorded(model_identity(model_dir), kv_name) is None:
        return (
            f"{kv_name} KV is not exact and no fidelity check is recorded for this model: "
            "`treeattn check --kv-dtype fp8 --prompt-file DOC` measures it on your document"
        )
    return None


def _tp_plan(config, tp: int, trust_remote_code: bool):
    """With ``--tp T > 1``: ``(plan, heads split)`` — None for the model's own plan, or ours for a
    model without one; whether each tp rank attends with 1/T of the heads. One line (exit 2)
    when transformers' loader cannot take our sub-mesh or the model cannot be split."""
    from ..model import tp as TP

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
        names = [
            n
            for n, _ in AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code).named_parameters()
        ]
    plan = TP.attention_plan({n.rsplit(".", 1)[0] for n in names if n.endswith(".weight")} | set(names))
    if not plan:
        raise ValueError(
            f"--tp {tp}: model type '{config.model_type}' has no tensor-parallel plan and no separate "
            "q/k/v/o projections to split by heads; use --tp 1"
        )
    print(
        f"treeattn: model type '{config.model_type}' has no tensor-parallel plan in transformers: --tp {tp} "
        "splits its attention by heads and replicates the rest of its weights",
        file=sys.stderr,
    )
    return plan, True
