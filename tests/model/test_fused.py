"""Transformers' norms and MLPs as one operation each (``model/fused.py``, issue 51): which
modules are replaced, that a replaced model's logits keep their bits on a CPU, that a module of
another formula keeps its own, and that the engine's step dispatches one operation a norm."""

from __future__ import annotations

import pytest
import torch

from treeattn_cli.model import fused
from treeattn_cli.verify import tiny as tiny_models

LAYERS = 2


def _load(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@pytest.mark.parametrize(
    "family, norms, mlps, rope, gate_up, blocks",
    [
        ("llama", 2 * LAYERS + 1, LAYERS, 1, LAYERS, LAYERS),
        ("mistral", 2 * LAYERS + 1, LAYERS, 1, LAYERS, LAYERS),
        ("qwen2", 2 * LAYERS + 1, LAYERS, 1, LAYERS, LAYERS),  # (q, k and v with biases)
        ("qwen3", 4 * LAYERS + 1, LAYERS, 1, LAYERS, LAYERS),  # and each layer's query and key norms
        ("gemma2", 0, 0, 1, LAYERS, 0),  # (1 + weight) norms, a tanh-GELU MLP: transformers' modules stay
        ("gpt_oss", 2 * LAYERS + 1, 0, 0, 0, 0),  # experts, and a rotary embedding of its own
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replaced_modules_keep_the_logits_bits(tmp_path, family, norms, mlps, rope, gate_up, blocks, dtype):
    """The same logits, bit for bit, before and after: for a batch of two and a row alone (the
    fused projections' product is taken once for q, k and v, and kept for no other input; each
    layer's adds fused with the norms after them, the last one's with the model's final norm)."""
    path = tiny_models.make_model(family, tmp_path / family, seed=7, num_hidden_layers=LAYERS)
    model = _load(path, dtype)
    ids = torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        before = model(ids).logits
        done = fused.install(model, weights=True)
        after, alone = model(ids).logits, model(ids[1:]).logits
    assert done == {
        "rms_norm": norms,
        "silu_mul": mlps,
        "rope": rope,
        "add_rms_norm": blocks,
        "treeattn_qkv": LAYERS,
        "treeattn_gate_up": gate_up,
    }
    assert torch.equal(before, after) and torch.equal(before[1:], alone), family
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in _load(path, dtype).parameters())


def test_a_rotary_embedding_of_another_formula_is_left_alone(tmp_path):
    """Channels rotated in interleaved pairs (GPT-J's), not halves: not the reference. The family's
    own function replaced keeps it for calls the kernel does not take (another unsqueeze_dim)."""

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    assert not fused.is_rope(interleaved, torch.device("cpu"), torch.float32, 64)
    path = tiny_models.make_model("llama", tmp_path / "m", seed=7, num_hidden_layers=1)
    fused.install(_load(path, torch.float32))
    import transformers.models.llama.modeling_llama as llama

    fn = llama.apply_rotary_pos_emb
    assert fused.is_rope(fn.treeattn_original, torch.device("cpu"), torch.float32, 64)
    q = torch.randn(1, 3, 2, 8)  # [B, T, H, d]: rotated along unsqueeze_dim=2, by transformers' own
    c, s = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    for a, b in zip(fn(q, q, c, s, unsqueeze_dim=2), fn.treeattn_original(q, q, c, s, unsqueeze_dim=2)):
        assert torch.equal(a, b)


def test_a_module_of_another_formula_is_left_alone(tmp_path):
    """A Llama norm whose weight is applied before the cast (Gemma's order) is not the reference:
    left as it is; the same for an MLP whose activation is not SiLU."""

    class OtherNorm(torch.nn.Module):  # named like a norm, not the formula
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(64, dtype=torch.bfloat16) + 0.5)
            self.variance_epsilon = 1e-6

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (h * self.weight.float()).to(x.dtype)

    OtherNorm.__name__ = "OtherRMSNorm"
    assert not fused.is_rms_norm(OtherNorm())
    path = tiny_models.make_model("llama", tmp_path / "m", seed=7, num_hidden_layers=1)
    model = _load(path, torch.bfloat16)
    mlp = model.model.layers[0].mlp
    assert fused.is_silu_mlp(mlp) and fused.is_rms_norm(model.model.norm)
    mlp.act_fn = torch.nn.GELU()
    assert not fused.is_silu_mlp(mlp)


def test_a_norm_waits_on_its_own_sum_only(tmp_path):
    """The norm a layer's last add computed for the next layer is taken by that layer's input
    norm only for that very sum: handed another tensor (a hook, a caller running a layer alone),
    the norm computes its own, and it is taken once."""
    path = tiny_models.make_model("llama", tmp_path / "m", seed=7, num_hidden_layers=LAYERS)
    model = _load(path, torch.float32)
    fused.install(model)
    first, nxt = model.model.layers[0], model.model.layers[1].input_layernorm
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.inference_mode():
        kw = dict(position_embeddings=model.model.rotary_emb(x, torch.arange(3)[None]))
        total = first(x, **kw)  # (transformers' own attention: the eager module)
        assert nxt.__dict__.get("treeattn_pending") is not None
        other = torch.randn_like(total)  # (another tensor, other numbers)
        want = fused.rms_norm(other, nxt.weight, nxt.variance_epsilon)
        assert torch.equal(nxt(other), want)  # another tensor: its own norm
        assert nxt.__dict__.get("treeattn_pending") is None  # (taken once, or dropped)
        assert torch.equal(nxt(total), fused.rms_norm(total, nxt.weight, nxt.variance_epsilon))


def test_a_layer_of_another_block_keeps_its_forward(tmp_path, monkeypatch):
    """A decoder layer is replaced only where its forward is Llama's pre-norm block: one whose
    residual is scaled (or whose norm comes after the add) keeps its own, and so do its adds."""
    path = tiny_models.make_model("llama", tmp_path / "m", seed=7, num_hidden_layers=1)
    model = _load(path, torch.float32)
    fused.install(model)
    layer = model.model.layers[0]
    assert fused.is_prenorm_layer(layer)
    real = type(layer).forward

    def scaled(self, hidden_states, **kwargs):  # (Gemma-3-style: a residual multiplier)
        return real(self, hidden_states, **kwargs) * 1.0001

    def post_norm(self, hidden_states, **kwargs):  # the norm after the add (OLMo-2's order)
        attn, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = hidden_states + self.input_layernorm(attn)
        return hidden_states + self.post_attention_layernorm(self.mlp(hidden_states))

    for variant in (scaled, post_norm):
        monkeypatch.setattr(type(layer), "forward", variant)
        assert not fused.is_prenorm_layer(layer), variant.__name__
        assert fused.install_layers(_load(path, torch.float32)) == 0  # (its norms not fused: nothing)
        other = _load(path, torch.float32)
        assert fused.install(other)["add_rms_norm"] == 0, variant.__name__


def test_the_step_dispatches_one_operation_a_norm(tmp_path):
    from torch.utils._python_dispatch import TorchDispatchMode

    path = tiny_models.make_model("llama", tmp_path / "m", seed=7, num_hidden_layers=LAYERS)
    model = _load(path, torch.float32)
    fused.install(model, weights=True)
    seen = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Names():
        model(torch.tensor([[5, 6, 7]]))
    # the first layer's input norm alone; each layer's two adds with the norms after them (the
    # last one's with the model's final norm)
    assert seen.count("rms_norm") == 1 and seen.count("add_rms_norm") == 2 * LAYERS
    assert seen.count("silu_mul") == LAYERS
    assert seen.count("rope") == LAYERS
    assert seen.count("linear") == 4 * LAYERS + 1  # q, k and v in one; o; gate and up in one; down; the head
    assert "rsqrt" not in seen and "silu" not in seen and "neg" not in seen  # (the references' ran below them)


def test_a_cpu_keeps_its_projections_apart_and_the_gpu_branches_fuse_them(tmp_path, monkeypatch):
    path = tiny_models.make_model("llama", tmp_path / "m", seed=7, num_hidden_layers=LAYERS)
    assert fused.install(_load(path, torch.float32))["treeattn_qkv"] == 0
    monkeypatch.setenv("TREEATTN_KERNEL", "triton")
    assert fused.install(_load(path, torch.float32))["treeattn_gate_up"] == LAYERS


def test_a_tensor_parallel_model_keeps_its_projections(tmp_path, monkeypatch):
    """Under --tp the projections' plan hooks split and gather their inputs and outputs: a
    tensor-parallel model is never concatenated, on the GPU's branches too."""
    from treeattn_cli.model.load import made_ready

    monkeypatch.setenv("TREEATTN_KERNEL", "triton")
    path = tiny_models.make_model("llama", tmp_path / "m", seed=7, num_hidden_layers=LAYERS)
    model = made_ready(_load(path, torch.float32), tp=True)
    assert model.treeattn_fused["treeattn_qkv"] == 0 and model.treeattn_fused["rms_norm"] == 2 * LAYERS + 1


def test_a_partial_rotation_and_a_multimodal_config_keep_working(tmp_path):
    """Phi-3 rotates a part of each head (``partial_rotary_factor``): its ``apply_rotary_pos_emb``
    is the reference on whole heads, and then takes narrower angles than the heads: those calls
    go to transformers' own, the logits keep their bits. A model whose config holds its language
    model's in ``text_config`` (a multimodal one) is read through it."""
    import types

    path = tiny_models.make_model(
        "phi3", tmp_path / "phi3", seed=7, num_hidden_layers=LAYERS, partial_rotary_factor=0.5
    )
    model = _load(path, torch.float32)
    ids = torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        before = model(ids).logits
        assert fused.install(model)["rope"] == 1
        assert torch.equal(model(ids).logits, before)
    llama = _load(tiny_models.make_model("llama", tmp_path / "m", seed=7, num_hidden_layers=1), torch.float32)
    llama.config = types.SimpleNamespace(text_config=llama.config)
    assert fused.install_rope(llama) == 1
