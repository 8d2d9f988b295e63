"""First-use probe of a model family: our attention against transformers' own, before any rank
starts (issue 21). Catches the next family we have not seen instead of answering it wrong.

A copy of the model's config cut to what attention needs — the first layers up to one of each
layer type (sliding and full), a small vocabulary, small MLPs and few experts, a sliding window
shorter than the probe, a soft-capping of attention logits that bends them, weights spread
wide enough that attention is sharp, on the CPU in fp32 — is built twice from the same random weights:
with transformers' eager attention, and with ours. Ours runs where commands run it (issue 50):
the engine on one rank (``Comm.single``), a document prefilled into the block pool in two
segments (the second meets the first's blocks), two questions over it in one batch (one with no
tokens of its own, as ``generate`` asks, one with a question in the tail), decode steps, and
verifies of drafts that are kept, cut short and rejected; twice: the CPU's branches, and the
GPU's (documents and tails read through their block tables, fixed-shape steps) with the
reference kernels under them (``treeattn_kernels.gpu_branches``). Each answer's tokens are then
fed to the eager model at once, and every token's distribution must agree with eager's at its
position. An argument our attention does not know, a mismatch, or a model whose layers never
call the attention interface: the model is refused with one line.

The verdict is cached per (config, transformers, torch, treeattn), like the kernel self-check.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import time

import torch

from .. import __version__
from .tiny import greedy

DOCUMENT, SEGMENT, QUESTION, NEW = (
    23,
    12,
    4,
    10,
)  # the document's tokens, a prefill segment's, a question's, an answer's
DRAFTS, PAGE = 2, 8  # drafts a verify carries; tokens per block of the probe's pool (a document spans blocks)
WINDOW = 5  # a sliding window the probe is longer than
SOFTCAP = 2.0  # attention logits' soft-capping, low enough to bend the probe's scores
INIT = 0.2  # the random weights' spread: attention scores of several units (the usual 0.02 leaves them
# under 0.1, every row a near-uniform average, and soft-capping or a key too many barely shows)
PROBE = 2  # what the probe runs (2: the engine's pooled path, issue 50): a verdict of another is not reused
TOL = 1e-3  # log-probabilities, relative to their scale: fp32 on both sides, different summation orders
_VOLATILE = {
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "use_cache",
    "attn_implementation",
    "architectures",
    "auto_map",
}


class ProbeFailed(ValueError):
    """The model's attention cannot be served exactly; the message is one line for the user."""


def _key(config) -> str:
    import transformers

    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE}
    blob = json.dumps(
        {
            "config": d,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "treeattn": __version__,
            "probe": PROBE,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _file(config):
    from ..paths import cache_root

    return cache_root() / "probe" / f"{_key(config)}.json"


def small_config(config):
    """A copy of ``config`` small enough to build in a moment and still the same attention."""
    c = copy.deepcopy(config)
    text = getattr(c, "text_config", None) or c
    types = list(getattr(text, "layer_types", None) or [])
    layers = text.num_hidden_layers
    if types:  # the first layers up to one of each kind (sliding, full, ...)
        layers = max(types.index(t) for t in set(types)) + 1
        text.layer_types = types[:layers]
    text.num_hidden_layers = min(text.num_hidden_layers, layers if types else 2)
    if getattr(text, "vocab_size", 0) > 512:
        text.vocab_size = 512
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(text, name, None)
        if isinstance(v, int) and v >= text.vocab_size:
            setattr(text, name, None)
    for name, v in list(vars(text).items()):  # the MLP does not touch attention: small
        if isinstance(v, int) and not isinstance(v, bool) and "intermediate_size" in name and v > 64:
            setattr(text, name, 64)
    per_tok = getattr(text, "num_experts_per_tok", None) or 1
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        v = getattr(text, name, None)
        if isinstance(v, int) and v > max(per_tok, 2):
            setattr(text, name, max(per_tok, 2))
    if isinstance(getattr(text, "sliding_window", None), int) and text.sliding_window > WINDOW:
        text.sliding_window = WINDOW
    if isinstance(getattr(text, "initializer_range", None), float):
        text.initializer_range = INIT
    cap = getattr(text, "attn_logit_softcapping", None)  # (Gemma's 50 leaves small scores as they are)
    if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > SOFTCAP:
        text.attn_logit_softcapping = SOFTCAP
    return c


def _err(a, b) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).abs().max() / max(1.0, b.abs().max().item())).item()


class _Drafts:
    """The probe's drafter: eager's greedy continuation of the sequence so far, given whole, with
    its second draft wrong, or its first, in turn; so verifies keep every draft, keep one, and keep
    none (the rows after a rejected draft are cut from the tail), whatever the random model says.
    ``oracle``: eager's greedy continuations, computed once (a sequence that left them, at a near
    tie, is continued afresh)."""

    def __init__(self, eager, tokens: list[int], vocab: int, oracle: list[list[int]]):
        self.eager, self.tokens, self.vocab, self.oracle, self.calls = eager, list(tokens), vocab, oracle, 0

    def extend(self, tokens) -> None:
        self.tokens += [int(t) for t in tokens]

    def draft(self, k: int) -> list[int]:
        if k <= 0:
            return []
        n = len(self.tokens)
        out = next((o[n : n + k] for o in self.oracle if len(o) >= n + k and o[:n] == self.tokens), None)
        if out is None:
            out = greedy(self.eager, self.tokens, k)
        wrong = (None, 1, 0)[self.calls % 3]
        self.calls += 1
        if wrong is not None and wrong < k:
            out[wrong] = (out[wrong] + 1) % self.vocab
        return out


def _answers(
    ours, eager, vocab: int, document: list[int], question: list[int], gpu: bool, oracle: list[list[int]]
) -> list[dict]:
    """The probe's two questions over ``document`` through the engine on one rank, as ``chat
    --batch`` and ``generate`` run them (``gpu``: on the GPU's branches, the reference kernels
    under them); each answer's record (``token_ids``, ``logprobs`` of the whole vocabulary,
    ``speculation``)."""
    from treeattn_kernels import gpu_branches

    from ..engine.engine import Engine
    from ..engine.job import EngineJob
    from ..engine.sampling import Sampling
    from ..parallel.launch import RankContext

    class Probe(Engine):
        def _drafter(self, own=(), doc=None):
            return _Drafts(eager, list(doc.ids if doc is not None else self.ids) + list(own), vocab, oracle)

    got: dict = {}
    ctx = RankContext(
        rank=0,
        world=1,
        local_rank=0,
        backend="gloo",
        device="cpu",
        timeout_s=60.0,
        emit=lambda kind, p: got.__setitem__(p[0], p[1]) if kind == "banswer" else None,
    )
    job = EngineJob("", [], dtype="float32", static=gpu, cuda_graph=False, reference=gpu, reserve=0)
    doc = {"key": "probe", "ids": document}
    with gpu_branches() if gpu else contextlib.nullcontext():
        Probe(ctx, job, model=ours).serve(
            [
                {
                    "op": "batch",
                    "questions": [
                        {"ids": [], "doc": {**doc, "last_logits": True}},  # generate's
                        {"ids": question, "doc": doc},
                    ],
                    "slots": 2,
                    "max_new_tokens": NEW,
                    "sampling": vars(Sampling()),
                    "stop": [],
                    "eos_ids": [],
                    "speculate": f"ngram:{DRAFTS}",
                    "logprobs": vocab,
                    "piece": SEGMENT,
                    "page": PAGE,
                    "pool_for": len(document),
                    "tails": len(question) + NEW,
                    "tail_slots": 2,
                },
                {"op": "stop"},
            ]
        )
    return [got[0], got[1]]


def run_probe(config, trust_remote_code: bool = False) -> dict:
    """Run the probe: ``{"max_err"}``, the largest relative error of a token's log-probabilities
    against eager's over every answer on both branches, and what ran (``answers``, ``tokens``,
    ``drafted``, ``accepted``, ``calls`` of our attention); raises :class:`ProbeFailed` for what
    cannot be compared (an argument we do not know, no call)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from treeattn_kernels import reference_only, use_reference

    from ..engine import attention as A
    from ..model.load import made_ready

    cfg = small_config(config)
    mtype = getattr(config, "model_type", "?")
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="eager", dtype=torch.float32, trust_remote_code=trust_remote_code
    ).eval()
    ours = AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation=A.register(), dtype=torch.float32, trust_remote_code=trust_remote_code
    ).eval()
    ours.load_state_dict(eager.state_dict())
    # as load_model leaves a model (fused operations, row invariance), its projections concatenated
    # as on a GPU's branches (on a CPU the same bits: checked as they are made)
    made_ready(ours, weights=True)
    vocab = eager.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (DOCUMENT + QUESTION,), generator=g).tolist()
    document, question = ids[:DOCUMENT], ids[DOCUMENT:]
    calls = [0]
    real = A.treeattn_attention

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    reference = reference_only()  # (the engine sets this process's kernels: put back after)
    transformers.AttentionInterface.register(A.ATTN_NAME, counted)
    try:
        oracle = [document + q + greedy(eager, document + q, NEW + DRAFTS) for q in ([], question)]
        runs = [_answers(ours, eager, vocab, document, question, gpu, oracle) for gpu in (False, True)]
    except A.UnsupportedAttention as e:
        raise ProbeFailed(str(e)) from None
    finally:
        transformers.AttentionInterface.register(A.ATTN_NAME, real)
        use_reference(reference)
    if not calls[0]:
        raise ProbeFailed(
            f"model type '{mtype}': its layers never call transformers' attention interface, "
            "so treeattn cannot shard its attention"
        )
    err, out = 0.0, {"answers": 0, "tokens": 0, "drafted": 0, "accepted": 0, "calls": calls[0]}
    for answers in runs:
        for asked, rec in zip(([], question), answers):
            toks = rec["token_ids"]
            seq = document + asked + toks
            with torch.inference_mode():
                logits = eager(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
            at = len(document) + len(asked) - 1  # the position each token was chosen at: at + i
            want = torch.log_softmax(logits[at : at + len(toks)], dim=-1)  # [n, V]
            got = torch.full_like(want, -math.inf)
            for i, lp in enumerate(rec["logprobs"]):
                top = torch.tensor(lp["top"], dtype=torch.float64)  # [V, 2]: (id, logprob)
                got[i, top[:, 0].long()] = top[:, 1].float()
            err = max(err, _err(got, want) if len(toks) == NEW else math.inf)
            out["answers"] += 1
            out["tokens"] += len(toks)
            out["drafted"] += rec["speculation"]["drafted"]
            out["accepted"] += rec["speculation"]["accepted"]
    return {"max_err": err, **out}


def probe_model(config, trust_remote_code: bool = False) -> None:
    """Refuse (``ProbeFailed``, one line) a model whose attention treeattn does not reproduce
    exactly; the verdict is cached, so this costs a moment once per family and config."""
    path = _file(config)
    try:
        v = json.loads(path.read_text())
    except (OSError, ValueError):
        v = None
    if v is None:
        mtype = getattr(config, "model_type", "?")
        try:
            err = run_probe(config, trust_remote_code)["max_err"]
            v = {
                "ok": err <= TOL,
                "max_err": err,
                "reason": None
                if err <= TOL
                else (
                    f"model type '{mtype}': treeattn's attention differs from transformers' on a short check "
                    f"(logits off by {err:.2g} relative, tolerance {TOL:g}): refused rather than answering wrong"
                ),
            }
        except ProbeFailed as e:
            v = {"ok": False, "max_err": None, "reason": str(e)}
        v["when"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        try:
            from ..paths import write_atomic

            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(v))
        except OSError:  # a read-only cache: probe again next time
            pass
    if not v["ok"]:
        raise ProbeFailed(v["reason"])
