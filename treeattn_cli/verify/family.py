"""First-use probe of a model family: our attention against transformers' own, before any rank
starts (issue 21). Catches the next family we have not seen instead of answering it wrong.

A copy of the model's config cut to what attention needs — the first layers up to one of each
layer type (sliding and full), a small vocabulary, small MLPs and few experts, a sliding window
shorter than the probe, on the CPU in fp32 — is built twice from the same random weights:
with transformers' eager attention, and with ours on one rank (``Comm.single``), driven as
``generate`` drives it: a prefill in two segments (the second meets the cache), then decode
steps. The logits must agree at every step. An argument our attention does not know, a mismatch,
or a model whose layers never call the attention interface: the model is refused with one line.

The verdict is cached per (config, transformers, torch, treeattn), like the kernel self-check.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time

import torch

from .. import __version__

PROMPT, SEGMENT, STEPS = 23, 12, 3  # probe tokens, prefill segment, decode steps
WINDOW = 5  # a sliding window the probe is longer than
TOL = 1e-3  # logits, relative to their scale: fp32 on both sides, different summation orders
_VOLATILE = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "attn_implementation",
             "architectures", "auto_map"}


class ProbeFailed(ValueError):
    """The model's attention cannot be served exactly; the message is one line for the user."""


def _key(config) -> str:
    import transformers

    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE}
    blob = json.dumps({"config": d, "transformers": transformers.__version__, "torch": torch.__version__,
                       "treeattn": __version__}, sort_keys=True, default=str)
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
    return c


def _err(a, b) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).abs().max() / max(1.0, b.abs().max().item())).item()


def run_probe(config, trust_remote_code: bool = False) -> float:
    """Max relative logit error of our attention against eager on the probe; raises
    :class:`ProbeFailed` for what cannot be compared (an argument we do not know, no call)."""
    from transformers import AutoModelForCausalLM

    from ..engine.attention import AttentionContext, UnsupportedAttention, register
    from ..engine.cache import ShardedKVCache
    from ..parallel.comm import Comm
    from ..engine.decode import Decoder
    from ..engine.model import shapes

    cfg = small_config(config)
    mtype = getattr(config, "model_type", "?")
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=torch.float32,
                                             trust_remote_code=trust_remote_code).eval()
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=register(), dtype=torch.float32,
                                            trust_remote_code=trust_remote_code).eval()
    ours.load_state_dict(eager.state_dict())
    vocab = eager.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, PROMPT + STEPS), generator=g)
    with torch.inference_mode():
        want = eager(input_ids=ids, use_cache=False).logits[0].float()  # [T, V]
    sh = shapes(cfg)
    cache = ShardedKVCache(sh["num_layers"], 1, sh["kv_heads"], sh["head_dim"], capacity=PROMPT + STEPS)
    calls = [0]
    from ..engine import attention as A

    real = A.treeattn_attention

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    import transformers

    transformers.AttentionInterface.register(A.ATTN_NAME, counted)
    try:
        dec = Decoder(ours, AttentionContext(Comm.single(), cache), vocab_size=vocab)
        err = _err(dec.prefill(ids[:, :PROMPT], SEGMENT)[0], want[PROMPT - 1])  # two segments: the cache met
        for i in range(STEPS):
            err = max(err, _err(dec.step(ids[0, PROMPT + i:PROMPT + i + 1], PROMPT + i)[0], want[PROMPT + i]))
    except UnsupportedAttention as e:
        raise ProbeFailed(str(e)) from None
    finally:
        transformers.AttentionInterface.register(A.ATTN_NAME, real)
    if not calls[0]:
        raise ProbeFailed(f"model type '{mtype}': its layers never call transformers' attention interface, "
                          "so treeattn cannot shard its attention")
    return err


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
            err = run_probe(config, trust_remote_code)
            v = {"ok": err <= TOL, "max_err": err, "reason": None if err <= TOL else (
                f"model type '{mtype}': treeattn's attention differs from transformers' on a short check "
                f"(logits off by {err:.2g} relative, tolerance {TOL:g}): refused rather than answering wrong")}
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
