"""Random-weight models of a named shape, saved to disk with a byte-level tokenizer (one token
per byte, ``verify/tiny.py``): the models of the model-level GPU measurements on a machine that
holds no weights (no hub there, and the demo model is too large to carry with the wheel folder).

The vocabulary is 256 tokens whatever the shape, so a step's output projection is smaller than
the real model's (SmolLM2-135M: 49,152 rows; Llama-3.2-1B: 128,256); everything else (layers,
heads, head dim, MLP) is the named model's. Weights are scaled as ``tiny.make_model`` scales
them (peaked logits: greedy answers with few near-ties, which loop, as random models do).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 17,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        max_position_embeddings=1 << 17,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_position_embeddings=1 << 17,
    ),
}


def random_model(shape: str, out: Path | None = None) -> Path:
    """Save a random-weight Llama of ``shape`` (one of :data:`SHAPES`) to ``out`` (default a new
    temporary folder) and return the folder."""
    from ..verify.tiny import make_model

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; shapes: {', '.join(SHAPES)}")
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix=f"treeattn-random-{shape}-"))
    make_model("llama", out, seed=0, **SHAPES[shape])
    cfg = out / "tokenizer_config.json"  # a chat template: chat, serve and the demo's prompts need one
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": CHAT_TEMPLATE}))
    return out


def device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """``--device auto|cpu|cuda`` and ``--dtype auto|float32|bfloat16|float16`` of the model-level
    scripts: auto is the GPU in bf16 when there is one, else the CPU in fp32."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return device, dtype


def add_model_flags(ap, device: bool = True) -> None:
    """The model-level scripts' flags: ``--random SHAPE``, and ``--device``/``--dtype``."""
    ap.add_argument("--random", default=None, choices=sorted(SHAPES), help="a random-weight model of this shape")
    if device:
        ap.add_argument("--device", default="auto", help="auto | cpu | cuda (auto: the GPU when there is one)")
        ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: bf16 on a GPU)")


def model_from_flags(ap, a) -> tuple:
    """``(model, device, dtype)`` of the parsed flags (:func:`add_model_flags`): the random model
    built now when one is asked for; a bad device or dtype is ``ap.error`` (one line, exit 2)."""
    device = dtype = None
    if hasattr(a, "device"):
        try:
            device, dtype = device_and_dtype(a.device, a.dtype)
        except ValueError as e:
            ap.error(str(e))
    return (str(random_model(a.random)) if a.random else a.model), device, dtype
