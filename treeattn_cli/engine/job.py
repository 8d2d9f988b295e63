"""What every rank is told: the job (the engine's settings: model, mesh, plan; and generate's request)
and the device plan that places one rank per device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import Sampling


@dataclass
class EngineJob:
    """What every rank needs: the engine's settings (model, mesh, plan) and ``generate``'s request."""

    model_dir: str
    prompt_ids: list[int]
    max_new_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    eos_ids: list[int] = field(default_factory=list)
    dtype: str = "auto"
    kv_dtype: str = "auto"  # the cache's storage: auto (dtype) | bfloat16 | float16 | float32 | fp8 (kvquant.py)
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
    tp: int = 1  # tensor-parallel ranks per sequence shard (parallel/mesh.py)
    tp_plan: dict | None = None  # None: the model's own plan; else ours (tp.attention_plan)
    tp_heads_split: bool = True  # the plan gives each tp rank 1/T of the heads (tp.heads_split)
    auto_layout: bool = False  # the scheme came from the layout: re-plan when ranks span nodes
    layout_profile: str | None = None
    load_kv: str | None = None  # a saved cache to continue (kvstore.py), validated in the launcher
    load_manifest: dict | None = None
    save_kv: str | None = None  # save the prompt's cache here after the answer
    save_meta: dict = field(default_factory=dict)  # identity, composition, nonce of the save
    cache_dir: str | None = None  # the prompt's document kept and found again here (kvstore format)
    cache_meta: dict = field(default_factory=dict)  # what its manifest records (identity, composition)
    reserve: int | None = None  # tokens the engine's own (append/decode) make room for: its pool's size at least
    # (default: prompt + answer; documents named by requests size the pool themselves)
    prefill_sharding: str = "balanced"  # or "contiguous" (prefill.py): how segments are cut
    speculate: str = "auto"  # off | auto | ngram:K: drafts from the context, verified (speculate.py)
    logprobs: int | None = None  # the answer carries each token's logprob and this many alternatives
    digest: bool = False  # the answer carries a digest of each token's logits (sampling.digests)
    cite: dict | None = None  # the answer carries its rows' attention over these spans (cli/citations.py)

    @property
    def reserve_tokens(self) -> int:
        if self.reserve is not None:
            return self.reserve
        cached = self.load_manifest["tokens"]["count"] if self.load_manifest else 0
        return cached + len(self.prompt_ids) + self.max_new_tokens


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
