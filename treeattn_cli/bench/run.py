"""``treeattn bench``: every mode of the command as one function returning records (the
decode harness, ``--prefill``, ``--kernel``, ``--model``, ``--simulate``); ``report.py`` shows
them."""

from __future__ import annotations

from dataclasses import dataclass

from .decode import bench_rank
from .spec import DTYPES, METHODS, BenchSpec


@dataclass
class BenchOptions:
    methods: str = "tree,ring,single"
    scheme: str = "auto"  # auto | all | comma list
    seq_len: str = "16384"
    batch: str = "1"  # a comma list: the decode sweep and projections run each B
    shared: bool = False  # the B sequences share one document (chat --batch's cascade attention)
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "auto"
    nproc: str | None = None  # a comma list: one sweep per rank count
    backend: str = "auto"
    device: str = "auto"
    layers: int = 1
    iters: int = 10
    warmup: int = 3
    timeout: float = 300.0
    simulate: str | None = None
    gpus: str = "8,64,128,1024"
    kernel: bool = False
    model: str | None = None
    new_tokens: int = 16
    layout: str | None = None
    tp: str = "1"  # model mode: ranks per tensor-parallel group; --simulate: a comma list to compare
    model_shape: str | None = None  # --simulate: a known model's shape (projection.MODEL_SHAPES)
    prefill: bool = False  # causal prefill attention per sharding (prefill.py) instead of decode
    acceptance: float | None = None  # --simulate --model-shape: price speculative decoding at this draft acceptance
    draft_k: int = 8  # ... with this many drafts per step
    mfu: float = 0.5  # --simulate --prefill: the fraction of peak FLOP/s compute runs at
    kv_dtype: str = "auto"  # the KV cache's storage: auto | bfloat16 | float16 | float32 | fp8
    max_context: bool = False  # --simulate: the longest context that fits, per model shape and KV dtype
    census: bool = False  # the decode step's operations per layer and per step (--model-shape), counted here


def _kv_dtype(name: str) -> str:
    """``--kv-dtype``, checked: one of ``kvdtypes.KV_DTYPES``."""
    from ..storage.kvdtypes import KV_DTYPES

    if name not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    return name


def parse_ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(float(x)) if "e" in x.lower() else int(x) for x in _expand_k(text)]
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of integers (16K, 1M allowed), got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{flag} values must be >= 1, got {text!r}")
    return vals


def _expand_k(text: str):
    for x in text.split(","):
        x = x.strip()
        mult = {"k": 1024, "m": 1024 * 1024}.get(x[-1:].lower(), 1)
        yield str(int(x[:-1]) * mult) if mult > 1 else x


def make_spec(o: BenchOptions, kind: str, nproc: int) -> BenchSpec:
    from ..parallel.schemes import FLAT_SCHEMES, SCHEMES
    from ..topology.layout import plan_for_run

    methods = [m.strip() for m in o.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"--methods takes a comma list of {', '.join(METHODS)}, got {o.methods!r}")
    batches = parse_ints("--batch", str(o.batch))
    for flag, v in (
        ("--heads", o.heads),
        ("--kv-heads", o.kv_heads),
        ("--head-dim", o.head_dim),
        ("--layers", o.layers),
        ("--iters", o.iters),
    ):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if o.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {o.warmup}")
    if o.heads % o.kv_heads:
        raise ValueError(f"--heads ({o.heads}) must be a multiple of --kv-heads ({o.kv_heads})")
    dtype = o.dtype if o.dtype != "auto" else ("bfloat16" if kind == "cuda" else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {o.dtype!r}")
    lay = plan_for_run(kind, nproc, heads=o.heads, head_dim=o.head_dim, layers=o.layers, profile=o.layout)
    if o.scheme == "auto":
        schemes = [lay.scheme]
    elif o.scheme == "all":
        schemes = list(FLAT_SCHEMES) + (["hierarchical"] if lay.scheme == "hierarchical" else [])
    else:
        schemes = [s.strip() for s in o.scheme.split(",")]
        if any(s not in SCHEMES for s in schemes):
            raise ValueError(f"--scheme takes auto, all or a comma list of {', '.join(SCHEMES)}")
    return BenchSpec(
        methods=methods,
        schemes=schemes,
        seq_lens=parse_ints("--seq-len", o.seq_len),
        batch=batches[0],
        batches=batches,
        shared=o.shared,
        heads=o.heads,
        kv_heads=o.kv_heads,
        head_dim=o.head_dim,
        dtype=dtype,
        kv_dtype=o.kv_dtype,
        layers=o.layers,
        iters=o.iters,
        warmup=o.warmup,
        groups=lay.groups if lay.scheme == "hierarchical" else [list(range(nproc))],
        inner=lay.inner or "allreduce",
        outer=lay.outer or "tree",
    )


def bench_command(o: BenchOptions, on_progress=None) -> list[dict]:
    """Run the sweep (or the projection, kernel or model mode); returns the records."""
    from ..engine.job import plan_devices

    if o.simulate and o.prefill:
        from .projection import simulate_prefill

        if not 0 < o.mfu <= 1:
            raise ValueError(f"--mfu must be in (0, 1], got {o.mfu}")
        return simulate_prefill(
            o.simulate,
            parse_ints("--gpus", o.gpus),
            parse_ints("--seq-len", o.seq_len),
            o.model_shape or "llama-3.1-405b",
            tp=parse_ints("--tp", o.tp)[0],
            mfu=o.mfu,
            dtype=o.dtype if o.dtype != "auto" else "bfloat16",
        )
    if o.census:
        from .census import census

        return [census(o.model_shape or "llama-3.1-8b", kv_dtype=_kv_dtype(o.kv_dtype))]
    _kv_dtype(o.kv_dtype)
    if o.max_context:
        from .projection import max_context

        if not o.simulate:
            raise ValueError("--max-context is a projection: give --simulate PROFILE (e.g. dgx-h100)")
        shapes = [o.model_shape] if o.model_shape else ["llama-3.1-8b", "llama-3.1-70b"]
        kvs = [o.kv_dtype] if o.kv_dtype != "auto" else ["bfloat16", "fp8"]
        return max_context(
            o.simulate, parse_ints("--gpus", o.gpus), shapes, kvs, parse_ints("--tp", o.tp) if o.tp != "1" else None
        )  # default: every tp that divides
    if o.prefill:
        return prefill_mode(o, on_progress)
    if o.simulate:
        from .projection import simulate, simulate_mesh

        if o.acceptance is not None and not 0 <= o.acceptance < 1:
            raise ValueError(f"--acceptance must be in [0, 1), got {o.acceptance}")
        if o.draft_k < 1:
            raise ValueError(f"--draft-k must be >= 1, got {o.draft_k}")

        batches = parse_ints("--batch", str(o.batch))
        spec = BenchSpec(
            seq_lens=parse_ints("--seq-len", o.seq_len),
            batch=batches[0],
            batches=batches,
            shared=o.shared,
            heads=o.heads,
            kv_heads=o.kv_heads,
            head_dim=o.head_dim,
            dtype=o.dtype if o.dtype != "auto" else "bfloat16",
            layers=o.layers,
        )
        if o.heads % o.kv_heads:
            raise ValueError(f"--heads ({o.heads}) must be a multiple of --kv-heads ({o.kv_heads})")
        if o.tp != "1" or o.model_shape:
            return [
                r
                for b in batches
                for r in simulate_mesh(
                    o.simulate,
                    parse_ints("--gpus", o.gpus),
                    spec.seq_lens,
                    parse_ints("--tp", o.tp),
                    o.model_shape or "llama-3.1-8b",
                    batch=b,
                    shared=o.shared,
                    dtype=spec.dtype,
                    acceptance=o.acceptance,
                    draft_k=o.draft_k,
                    kv_dtype=o.kv_dtype,
                )
            ]
        return simulate(o.simulate, parse_ints("--gpus", o.gpus), spec)
    counts = parse_ints("--nproc", o.nproc) if o.nproc else [None]
    kind, backend, n, devices = plan_devices(o.device, o.backend, counts[0])
    if o.kernel:
        from .kernel import kernel_bench

        spec = make_spec(o, kind, 1)
        return kernel_bench(
            spec.seq_lens,
            batch=spec.batch,
            heads=spec.heads,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            device=devices[0],
            iters=spec.iters,
            warmup=spec.warmup,
        )
    if o.model is not None:
        return model_mode(o, n, parse_ints("--tp", o.tp)[0])
    from ..parallel.launch import run_local

    records = []
    for i, count in enumerate(counts):
        kind, backend, n, devices = plan_devices(o.device, o.backend, count)
        spec = make_spec(o, kind, n)
        k = len(spec.cases())

        def ev(rank, what, val, base=i * k, total=len(counts) * k):
            if what == "case" and on_progress is not None:
                on_progress(base + val[0], total)

        records += run_local(bench_rank, n, spec, backend=backend, devices=devices, timeout_s=o.timeout, on_event=ev)[0]
    return records


def prefill_mode(o: BenchOptions, on_progress=None) -> list[dict]:
    """``--prefill``: the attention part of prefill per sharding, on ranks (prefill.py)."""
    from ..parallel.launch import run_local
    from .prefill import METHODS as PREFILL_METHODS
    from .prefill import prefill_rank
    from ..engine.job import plan_devices

    methods = (
        list(PREFILL_METHODS)
        if o.methods == BenchOptions.methods
        else [m.strip() for m in o.methods.split(",") if m.strip()]
    )
    if not methods or any(m not in PREFILL_METHODS for m in methods):
        raise ValueError(f"--prefill --methods takes a comma list of {', '.join(PREFILL_METHODS)}, got {o.methods!r}")
    records = []
    counts = parse_ints("--nproc", o.nproc) if o.nproc else [None]
    for i, count in enumerate(counts):
        kind, backend, n, devices = plan_devices(o.device, o.backend, count)
        spec = make_spec(BenchOptions(**{**vars(o), "methods": "tree", "scheme": "allreduce"}), kind, n)
        spec.methods = methods
        total = len(counts) * len(methods) * len(spec.seq_lens)

        def ev(rank, what, val, base=i * len(methods) * len(spec.seq_lens)):
            if what == "case" and on_progress is not None:
                on_progress(base + val[0], total)

        records += run_local(prefill_rank, n, spec, backend=backend, devices=devices, timeout_s=o.timeout, on_event=ev)[
            0
        ]
    return records


def model_mode(o: BenchOptions, n: int, tp: int = 1) -> list[dict]:
    """Decode ms/token of ``generate`` for each method on a real model (``tp``: ranks per
    tensor-parallel group of the tree method)."""
    from ..model import load as M
    from .model import prompt_ids, time_treeattn

    model_dir = M.resolve(o.model)
    tok = M.load_tokenizer(model_dir)
    methods = [m.strip() for m in o.methods.split(",")]
    out = []
    for N in parse_ints("--seq-len", o.seq_len):
        ids = prompt_ids(tok, N)
        for m in methods:
            if m == "single":
                r = time_treeattn(model_dir, ids, o.new_tokens, 1, kv_dtype=o.kv_dtype)
            elif m == "ring":
                r = time_treeattn(model_dir, ids, o.new_tokens, n, decode_method="ring", kv_dtype=o.kv_dtype)
            else:
                r = time_treeattn(
                    model_dir,
                    ids,
                    o.new_tokens,
                    n,
                    tp=tp,
                    kv_dtype=o.kv_dtype,
                    scheme="allreduce" if o.scheme in ("auto", "all") else o.scheme,
                )
            r.pop("token_ids", None)
            out.append(
                {
                    **r,
                    "method": m,
                    "seq_len": N,
                    "model": str(model_dir),
                    "simulated": False,
                    "step_ms_median": r["decode_ms_per_token"],
                }
            )
    return out
