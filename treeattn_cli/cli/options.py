"""The flags of ``generate`` and ``chat`` (and the commands that run a model the same way), and
the checks that need neither torch nor a model.

The flags the commands share are defined once, here, in blocks (:data:`MODEL_FLAGS`,
:data:`ANSWER_FLAGS`, :data:`RUN_FLAGS`, ...); ``main`` turns them into each command's options.
Nothing here imports torch or transformers: ``main`` checks the flags with :func:`check_flags`
before it imports what runs them, so a bad flag costs a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ..storage.kvdtypes import KV_DTYPES
from ..parallel.schemes import SCHEMES


@dataclass(frozen=True)
class Flag:
    """One command-line flag: the field of :class:`GenerateOptions` it fills, its type and
    default, its help, and its spelling where it is not ``--field-name``."""

    name: str
    type: object
    default: object
    help: str
    decls: tuple = ()


MODEL_FLAGS = (
    Flag("model", Optional[str], None, "Local directory, .gguf file or hub id (default: the embedded demo model)."),
    Flag("allow_pickle", bool, False, "Allow pickled .bin weights (they can run code)."),
    Flag("trust_remote_code", bool, False, "Allow a model's own Python code from its repository."),
)
ANSWER_FLAGS = (
    Flag("system", Optional[str], None, "System message for the chat template."),
    Flag("max_new_tokens", Optional[int], None, "Most tokens per answer (default 256; generate's demo 96)."),
    Flag("temperature", float, 0.0, "Sampling temperature; 0 = greedy."),
    Flag("top_k", int, 0, "Sample from the k most likely tokens (0 = off)."),
    Flag("top_p", float, 1.0, "Nucleus sampling mass in (0, 1] (1 = off)."),
    Flag("seed", int, 0, "Random seed for sampling (every answer starts from it)."),
    Flag("stop", List[str], [], "Stop an answer when this text appears (repeatable)."),
    Flag(
        "logprobs",
        Optional[int],
        None,
        "With --json: each token's log-probability under the model and its N "
        "most likely alternatives (0: the token's own only; at most 20).",
    ),
    Flag(
        "digest",
        bool,
        False,
        "With --json: 'digests', one per token, 16 hex digits of the logits it was "
        "chosen from. An answer's are the same alone, in a batch, with drafts (same model, dtype, --kv-dtype "
        "and ranks): compare runs bit for bit.",
    ),
)
CITE_FLAGS = (
    Flag(
        "cite",
        bool,
        False,
        "Say where in the document the answer comes from: the sentences its tokens gave the "
        "most attention to, exact from the merge (with --json: 'citations', character offsets into the prompt "
        "text; on a terminal, a 'Sources' list after the answer). Never changes the answer.",
    ),
)
SPECULATE_FLAGS = (
    Flag(
        "speculate",
        str,
        "auto",
        "Draft tokens from the document and the answer (n-gram lookup) and verify "
        "them in one step: off | auto (adapts; off when sampling) | ngram:K. Greedy output is unchanged, "
        "bit for bit.",
    ),
)
SERVE_FLAGS = (
    Flag("host", str, "127.0.0.1", "Address to listen on (loopback only unless you say otherwise)."),
    Flag("port", int, 8000, "Port to listen on."),
    Flag("served_model_name", Optional[str], None, "The model's name in the API (default: the model directory's)."),
    Flag("api_key", Optional[str], None, "Require 'Authorization: Bearer KEY' on /v1 requests."),
    Flag(
        "cache_dir",
        Optional[str],
        None,
        "Save each document's sharded KV cache here as it is made (a restart finds them).",
    ),
    Flag(
        "kv_memory",
        Optional[str],
        None,
        "Each rank's KV block pool for documents, allocated at start: a size "
        "(8GiB, 512MiB, bytes) or a fraction of the memory free on the rank's device once the model is loaded "
        "(0.9 or 90%; ranks on one CPU share its available memory). Default: 512MiB on a CPU, 8GiB on a GPU. "
        "Least recently used documents leave when it is full.",
    ),
    Flag("cache_bytes", Optional[int], None, "The older name of --kv-memory, in bytes."),
    Flag(
        "host_memory",
        Optional[str],
        None,
        "Each rank's host-memory tier behind its pool: a document that "
        "leaves the pool keeps a copy here and comes back by a copy, not a prefill (least recently used "
        "leave first). A size (64GiB, 512MiB, bytes; 0: none). Default: a quarter of the available host memory "
        "over the ranks, at most 512MiB on a CPU, 64GiB on a GPU.",
    ),
    Flag("batch", int, 8, "Requests that decode together (about any documents; more wait for a free slot)."),
    Flag(
        "max_waiting",
        int,
        64,
        "Requests that may wait for a slot; past --batch + this many, a request gets "
        "HTTP 429 with Retry-After at once.",
    ),
    Flag("max_request_bytes", int, 64 << 20, "Largest request body in bytes (HTTP 413 past it)."),
    Flag("log_format", str, "text", "One line per request on stderr: text | json | none."),
    Flag(
        "document",
        List[str],
        [],
        "A text file to cache as a document before listening (repeatable; as POST /v1/documents would).",
    ),
    Flag("pin", bool, False, "Pin the --document files: they never leave memory."),
    Flag(
        "restarts",
        int,
        3,
        "After a lost rank, start new ranks up to this many times (1, 2, 4... s apart; "
        "503 'recovering' meanwhile); 0: stop at once, exit 1 (for a supervisor that restarts the server).",
    ),
)
RUN_FLAGS = (
    Flag(
        "prefill_chunk",
        Optional[int],
        None,
        "Tokens per rank per prefill segment (bounds activation memory); in a batch (chat --batch, "
        "serve), also the tokens of a long question prefilled per step between the other answers' tokens.",
    ),
    Flag(
        "prefill_sharding",
        str,
        "balanced",
        "How prefill segments are cut: balanced (2p chunks, rank r holds r and 2p-1-r) | contiguous.",
    ),
    Flag("nproc", Optional[int], None, "Local ranks (default: visible GPUs, 2 on a CPU-only machine)."),
    Flag("tp", int, 1, "Tensor-parallel ranks per sequence shard (weights split T ways); --nproc = shards x T."),
    Flag("backend", str, "auto", "auto | nccl | gloo."),
    Flag("device", str, "auto", "auto | cuda | cpu."),
    Flag("dtype", str, "auto", "auto | float32 | bfloat16 | float16."),
    Flag(
        "kv_dtype",
        str,
        "auto",
        "KV cache storage: auto (the model's dtype) | bfloat16 | float16 | float32 | fp8 "
        "(e4m3, rotated, a scale per token and head: about half of bf16; measure it with "
        "`treeattn check --kv-dtype fp8 --prompt-file DOC`).",
    ),
    Flag(
        "scheme",
        str,
        "auto",
        "Merge scheme: auto (the layout `treeattn topo` chooses) | allreduce | allgather | tree | hierarchical.",
    ),
    Flag(
        "layout",
        Optional[str],
        None,
        "Interconnect profile for the layout choice: a built-in name or a YAML path "
        "(e.g. from `topo --measure --save`).",
    ),
    Flag("timeout", float, 300.0, "Collective timeout in seconds (a lost rank is reported after it)."),
)
CACHE_FLAGS = (
    Flag("save_kv", Optional[str], None, "Save the document's (prompt's) sharded KV cache to this directory."),
    Flag(
        "load_kv",
        Optional[str],
        None,
        "Start from a saved KV cache (any --nproc): the prompt or questions follow its tokens.",
    ),
    Flag(
        "cache_dir",
        Optional[str],
        None,
        "Keep the document's KV cache in this directory, named by its tokens: a "
        "later run over the same document (generate: the same prompt) loads it instead of prefilling it "
        "(serve --cache-dir shares the format).",
    ),
)
REPORT_FLAGS = (
    Flag("quiet", bool, False, "No stats lines on stderr."),
    Flag("debug", bool, False, "Show full tracebacks."),
)


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
    kv_dtype: str = "auto"  # the KV cache's storage: auto | bfloat16 | float16 | float32 | fp8 (storage/kvquant.py)
    scheme: str = "auto"
    output: str | None = None
    json: bool = False
    timeout: float = 300.0
    allow_pickle: bool = False
    trust_remote_code: bool = False
    layout: str | None = None  # a profile (name or YAML path) for the layout choice
    debug: bool = False  # full tracebacks (a failed rank's too)
    tp: int = 1  # tensor-parallel ranks per sequence shard: --nproc = cp x tp
    save_kv: str | None = None  # save the prompt's KV cache here (storage/kvstore.py)
    load_kv: str | None = None  # continue a saved KV cache with the prompt
    cache_dir: str | None = None  # documents kept and found again by their tokens (serve: every document)
    quiet: bool = False  # no stats line on stderr
    prefill_sharding: str = "balanced"  # or "contiguous": how prefill segments are cut (engine/prefill.py)
    speculate: str = "auto"  # off | auto | ngram:K (engine/speculate.py)
    logprobs: int | None = None  # --json records carry each token's logprob and this many alternatives
    digest: bool = False  # --json records carry a digest of each token's logits (sampling.digests)
    cite: bool = False  # answers carry citations: the document's sentences their rows read most (cli/citations.py)


def check_flags(o: GenerateOptions) -> None:
    """The checks that need neither torch nor the model: run before the heavy imports, so a
    mistyped flag is refused at once (one line, exit 2) instead of after seconds of loading."""
    if o.max_new_tokens is not None and o.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {o.max_new_tokens}")
    if not o.temperature >= 0 or o.temperature != o.temperature:
        raise ValueError(f"--temperature must be >= 0, got {o.temperature}")
    if o.top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {o.top_k}")
    if not 0 < o.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {o.top_p}")
    if o.logprobs is not None and not 0 <= o.logprobs <= 20:
        raise ValueError(f"--logprobs must be in 0..20, got {o.logprobs}")
    if o.prefill_chunk is not None and o.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1, got {o.prefill_chunk}")
    if o.nproc is not None and o.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {o.nproc}")
    if not o.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {o.timeout}")
    _speculation(o.speculate)
    if o.cache_dir and (o.load_kv or o.save_kv):
        raise ValueError(
            "--cache-dir finds and keeps the document by itself: give it or --load-kv / --save-kv, not both"
        )
    if o.cite and o.load_kv:
        raise ValueError(
            "--cite needs the document's text, and a --load-kv cache holds only its tokens: give the "
            "document with --prompt-file instead"
        )
    from .prompt import check_file, check_folder

    check_file(o.prompt_file)
    check_file(getattr(o, "questions", None), "--questions file")
    check_folder(o.output, "--output")
    if getattr(o, "batch", 1) < 1:
        raise ValueError(f"--batch must be >= 1, got {o.batch}")
    for flag, val, choices in (
        ("--backend", o.backend, ("auto", "nccl", "gloo")),
        ("--device", o.device, ("auto", "cuda", "cpu")),
        ("--dtype", o.dtype, ("auto", "float32", "bfloat16", "float16")),
        ("--kv-dtype", o.kv_dtype, KV_DTYPES),
        ("--scheme", o.scheme, ("auto", *SCHEMES)),
        ("--prefill-sharding", o.prefill_sharding, ("balanced", "contiguous")),
    ):
        if val not in choices:
            raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {val!r}")


@dataclass
class ServeOptions(GenerateOptions):
    """``treeattn serve``: generate's flags that apply, and the server's."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    cache_dir: str | None = None
    kv_memory: str | None = None  # --kv-memory as given: parsed into cache_bytes or kv_fraction
    cache_bytes: int | None = None  # per rank (None: engine.room.POOL_BYTES of the device); once
    # the ranks made the pool, its bytes
    kv_fraction: float | None = None  # --kv-memory as a fraction of each rank's free memory
    host_memory: str | None = None  # --host-memory as given
    host_bytes: int | None = None  # parsed (None: host_tier.default_budget)
    batch: int = 8
    max_waiting: int = 64
    max_request_bytes: int = 64 << 20
    log_format: str = "text"
    document: list = field(default_factory=list)
    pin: bool = False
    restarts: int = 3


def check_serve_flags(o: ServeOptions) -> None:
    check_flags(o)
    if not 0 < o.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {o.port}")
    if o.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {o.max_waiting}")
    if o.restarts < 0:
        raise ValueError(f"--restarts must be >= 0, got {o.restarts}")
    if o.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be at least 1024, got {o.max_request_bytes}")
    if o.log_format not in ("text", "json", "none"):
        raise ValueError(f"--log-format must be text, json or none, got {o.log_format!r}")
    for path in o.document:
        if not Path(path).is_file():
            raise ValueError(f"--document {path}: no such file")
    if o.pin and not o.document:
        raise ValueError("--pin pins the --document files: name one")
    if o.kv_memory is not None and o.cache_bytes is not None:
        raise ValueError("--cache-bytes is the older name of --kv-memory: give one of them")
    if o.kv_memory is not None:
        o.cache_bytes, o.kv_fraction = parse_memory(o.kv_memory)
    if o.cache_bytes is not None and o.cache_bytes < 1 << 20:
        raise ValueError(f"--kv-memory must be at least 1 MiB (1048576 bytes), got {o.cache_bytes}")
    if o.host_memory is not None:
        o.host_bytes, _ = parse_memory(o.host_memory, "--host-memory", fractions=False)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_memory(text: str, flag: str = "--kv-memory", fractions: bool = True) -> tuple[int | None, float | None]:
    """``--kv-memory``: ``(bytes, None)`` for a size (``8GiB``, ``512MiB``, ``1.5G``, ``2000000000``:
    units in powers of 1000 or 1024 as spelled), ``(None, fraction)`` for a fraction of the free
    memory (``0.9``, ``1.0``, ``90%``: in (0, 1]); anything else is a ValueError saying what is accepted."""
    import re

    t = str(text).strip().lower().replace(" ", "")
    bad = ValueError(
        f"{flag} must be a size (8GiB, 512MiB, 2000000000 bytes) or a fraction of the free "
        f"memory in (0, 1] (0.9 or 90%), got {text!r}"
        if fractions
        else f"{flag} must be a size (64GiB, 512MiB, 2000000000 bytes; 0: none), got {text!r}"
    )
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(%?)([a-z]*)", t)
    if m is None:
        raise bad
    number, percent, unit = float(m.group(1)), m.group(2), m.group(3)
    if percent or (not unit and "." in m.group(1)):  # a fraction; a whole number alone is bytes
        if unit or not fractions:
            raise bad
        f = number / 100 if percent else number
        if not 0 < f <= 1:
            raise bad
        return None, f
    if unit not in _UNITS:
        raise bad
    return int(number * _UNITS[unit]), None


@dataclass
class ChatOptions(GenerateOptions):
    """``treeattn chat``: generate's flags, and how questions come and whether turns are kept."""

    conversation: bool = False  # keep the turns (default: every question against the document alone)
    questions: str | None = None  # a file of questions, one per line ('-': standard input)
    batch: int = 8  # questions from a file or a pipe decoding together (typed ones: one at a time)


def _speculation(text: str) -> None:
    """``--speculate``'s grammar, checked without importing torch (engine/speculate.py parses
    it for the run)."""
    t = (text or "").strip().lower()
    if t in ("off", "auto"):
        return
    if t.startswith("ngram:") and t[6:].isdigit() and 1 <= int(t[6:]) <= 64:
        return
    raise ValueError(f"--speculate takes off, auto or ngram:K with 1 <= K <= 64, got {text!r}")
