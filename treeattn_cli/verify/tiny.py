"""Tiny random Hugging Face models saved to disk (no hub) and transformers' own greedy decode on
them: the end-to-end oracle of `treeattn check` and of the tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256


def _tokenizer(out: Path):
    """A byte-level tokenizer with one token per byte (no merges), built offline."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def make_model(kind: str, out: Path, seed: int = 0, **over) -> Path:
    """Save a tiny random ``kind`` model (any causal-LM ``model_type``; llama, mistral, qwen2, qwen3,
    gemma2, gemma3_text and gpt_oss get shapes that exercise what they add) to ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if kind == "mistral":
        base.update(sliding_window=None)
    if kind == "qwen3":
        base.update(head_dim=16)
    if kind == "gemma2":
        base.update(
            head_dim=16,
            sliding_window=6,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=None,
            query_pre_attn_scalar=16,
        )
    if kind == "gemma3_text":  # sliding and full layers, local RoPE, q/k norms
        base.update(
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=16,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    if kind == "gpt_oss":  # attention sinks, alternating sliding windows, experts
        base.update(
            head_dim=16,
            sliding_window=6,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            layer_types=["sliding_attention", "full_attention"],
        )
    if kind in ("mixtral", "qwen3_moe"):
        base.update(num_local_experts=4, num_experts=4, num_experts_per_tok=2)
        if kind == "qwen3_moe":
            base.update(moe_intermediate_size=64, head_dim=16)
    base.update(over)
    cfg = AutoConfig.for_model(kind, **base)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the init: peaked logits, no near-ties
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(4.0)
            elif name.endswith(".sinks"):  # learned sink logits as large as real scores, so they matter
                p.copy_(torch.randn(p.shape) * 2.0 + 2.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer(out)
    return out


def rounded_attention(kv_round) -> str:
    """Register transformers' own eager attention of each model family with keys and values
    passed through ``kv_round`` first (what a cache that stores them rounded holds: the oracle
    of ``--kv-dtype``); returns the implementation's name."""
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    def attend(module, query, key, value, attention_mask, **kw):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, kv_round(key).to(key.dtype), kv_round(value).to(value.dtype), attention_mask, **kw)

    AttentionInterface.register("treeattn_kv_rounded", attend)
    AttentionMaskInterface.register("treeattn_kv_rounded", eager_mask)
    return "treeattn_kv_rounded"


def greedy_decoder(model_dir: Path, kv_round=None):
    """transformers' own greedy generate (eager attention), the model loaded once:
    ``decode(prompt_ids, max_new_tokens) -> token ids``. ``kv_round``: keys and values rounded as
    a cache of another dtype stores them (:func:`rounded_attention`)."""
    from transformers import AutoModelForCausalLM

    attn = rounded_attention(kv_round) if kv_round is not None else "eager"
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)

    return lambda prompt_ids, max_new_tokens: greedy(m, prompt_ids, max_new_tokens)


def greedy(model, prompt_ids, max_new_tokens: int) -> list:
    """``max_new_tokens`` token ids of ``model``'s own greedy generate after ``prompt_ids`` (no
    early end)."""
    ids = torch.tensor([list(prompt_ids)])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()


def hf_greedy(model_dir: Path, prompt_ids, max_new_tokens: int, kv_round=None):
    """transformers' own greedy generate (eager attention): the end-to-end oracle (see
    :func:`greedy_decoder`; this one loads the model for one prompt)."""
    return greedy_decoder(model_dir, kv_round)(prompt_ids, max_new_tokens)
