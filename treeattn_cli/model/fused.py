"""Fused operations of the decode step (issue 51): work of transformers' modules that is one
launch on a GPU, as torch custom operations, so a step dispatches one operation where the
module dispatched several (the census counts them as they run, ``bench/census.py``).

* ``treeattn::rms_norm``: the RMS norm of Llama, Qwen2/3 and Mistral (eight launches a norm as
  transformers' module; two norms a layer, Qwen3's query and key norms two more);
* ``treeattn::add_rms_norm``: a layer's residual add and the RMS norm after it (the post-attention
  norm in the layer; the next layer's input norm, or the model's last, after the MLP), where
  the layer is Llama's pre-norm block (:func:`install_layers`): two operations for one;
* ``treeattn::silu_mul``: their MLP's ``silu(gate) * up`` (two launches);
* ``treeattn::rope``: their attention's rotary embedding of the queries and keys (transformers'
  ``apply_rotary_pos_emb``, ten launches; replaced in the family's modeling module, as Liger
  Kernel does, where that function gives the reference's bits).

Each is one Triton launch on a GPU (``treeattn_kernels.fused_triton``) and transformers' own
operations elsewhere (``fused_ref``): a CPU's numbers stay transformers' bits. :func:`install`
replaces a module's forward only where it gives the reference's bits on random rows (a norm of
another formula, Gemma's ``1 + weight``, or an MLP of another activation keeps its module), and
not over a tensor-parallel DTensor's shards."""

from __future__ import annotations

import torch

from . import fused_weights, invariance
from .fused_weights import _plain


# The operations, registered with the dispatcher once per process: one implementation for every
# device (``treeattn_kernels`` picks Triton on CUDA, the reference elsewhere), and their shapes
# for meta tensors. (``torch.library.custom_op`` costs ~30 µs more a call on a CPU.)
_LIB = torch.library.Library("treeattn", "FRAGMENT")
_LIB.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIB.define("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)")
_LIB.define("silu_mul(Tensor gate, Tensor up) -> Tensor")
_LIB.define("rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)")


def _rms_norm(x, weight, eps):
    from treeattn_kernels import rms_norm as kernel

    return kernel(x, weight, eps, empty=invariance.empty_rows)  # (rows the next linear takes as they lie)


def _add_rms_norm(x, residual, weight, eps):
    from treeattn_kernels import add_rms_norm as kernel

    return kernel(x, residual, weight, eps, empty=invariance.empty_rows)


def _silu_mul(gate, up):
    from treeattn_kernels import silu_mul as kernel

    return kernel(gate, up, empty=invariance.empty_rows)


def _rope(q, k, cos, sin):
    from treeattn_kernels import rope as kernel

    return kernel(q, k, cos, sin)


_LIB.impl("rms_norm", _rms_norm, "CompositeExplicitAutograd")
_LIB.impl("add_rms_norm", _add_rms_norm, "CompositeExplicitAutograd")
_LIB.impl("silu_mul", _silu_mul, "CompositeExplicitAutograd")
_LIB.impl("rope", _rope, "CompositeExplicitAutograd")
_LIB.impl("rms_norm", lambda x, w, eps: x.new_empty(x.shape, dtype=torch.promote_types(w.dtype, x.dtype)), "Meta")
_LIB.impl(
    "add_rms_norm",
    lambda x, r, w, eps: (x.new_empty(x.shape, dtype=torch.promote_types(w.dtype, x.dtype)), torch.empty_like(x)),
    "Meta",
)
_LIB.impl("silu_mul", lambda gate, up: torch.empty_like(up), "Meta")
_LIB.impl(
    "rope",
    lambda q, k, cos, sin: (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    ),
    "Meta",
)
rms_norm = torch.ops.treeattn.rms_norm  # x [..., n], weight [n], eps -> [..., n] (fused_ref.rms_norm_ref)
add_rms_norm = torch.ops.treeattn.add_rms_norm  # x, residual [..., n], weight, eps -> (normed sum, sum)
silu_mul = torch.ops.treeattn.silu_mul  # gate, up [...] -> silu(gate) * up (fused_ref.silu_mul_ref)
rope = torch.ops.treeattn.rope  # q [B, H, T, d], k [B, H_kv, T, d], cos, sin [B, T, d] -> (q, k) rotated


def is_rms_norm(m, seed: int = 0) -> bool:
    """Whether module ``m`` is a Llama-style RMS norm: a plain ``weight [n]``, a float
    ``variance_epsilon``, and the reference's bits on random rows (1 and 5 of them, scaled
    wide) on its own device and dtype."""
    from treeattn_kernels import rms_norm_ref

    w, eps = getattr(m, "weight", None), getattr(m, "variance_epsilon", None)
    if not (type(m).__name__.endswith("RMSNorm") and _plain(w) and w.dim() == 1 and isinstance(eps, float)):
        return False
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for rows in (1, 5):
            x = (torch.randn(rows, w.shape[0], generator=g) * 8).to(w.device, w.dtype)
            try:
                same = torch.equal(m(x), rms_norm_ref(x, w, eps))
            except Exception:  # noqa: BLE001 - a module that takes other arguments: not ours to fuse
                return False
            if not same:
                return False
    return True


def is_silu_mlp(m, seed: int = 0) -> bool:
    """Whether module ``m`` is a Llama-style MLP, ``down(silu(gate(x)) * up(x))`` with plain
    weights: its own output's bits equal the reference formula's (``fused_ref.silu_mul_ref``
    between its projections) on random rows."""
    from treeattn_kernels import silu_mul_ref

    parts = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, torch.nn.Linear) and _plain(p.weight) for p in parts):
        return False
    if type(getattr(m, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):  # (torch's, transformers')
        return False
    w = parts[0].weight
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for rows in (1, 3):
            x = torch.randn(rows, w.shape[1], generator=g).to(w.device, w.dtype)
            try:
                if not torch.equal(m(x), _mlp_forward(m, silu_mul_ref)(x)):
                    return False
            except Exception:  # noqa: BLE001 - a module that takes other arguments: not ours to fuse
                return False
    return True


def is_rope(fn, device, dtype, head_dim: int, seed: int = 0) -> bool:
    """Whether ``fn`` (a modeling module's ``apply_rotary_pos_emb``) gives the reference's bits
    (``fused_ref.rope_ref``) on random queries, keys and angles of ``head_dim`` (even)."""
    from treeattn_kernels import rope_ref

    if head_dim % 2:
        return False
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 3, head_dim, generator=g).to(device, dtype)
    k = torch.randn(2, 2, 3, head_dim, generator=g).to(device, dtype)
    angles = torch.randn(2, 3, head_dim // 2, generator=g) * 20
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    with torch.inference_mode():
        try:
            got, want = fn(q, k, cos, sin), rope_ref(q, k, cos, sin)
        except Exception:  # noqa: BLE001 - another signature: not ours to replace
            return False
    return all(torch.equal(a, b) for a, b in zip(got, want))


def _rope_in_place_of(original):
    checked: set = set()  # the dtypes is_rope found the original to be the reference in

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # transformers' signature
        if unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() != 3 or q.dtype not in checked:
            return original(q, k, cos, sin, unsqueeze_dim)
        if not (q.shape[-1] == k.shape[-1] == cos.shape[-1] == sin.shape[-1]):  # (a partial rotation)
            return original(q, k, cos, sin, unsqueeze_dim)
        if not (k.dtype == cos.dtype == sin.dtype == q.dtype):
            return original(q, k, cos, sin, unsqueeze_dim)
        return rope(q, k, cos, sin)

    apply_rotary_pos_emb.treeattn_original = original
    apply_rotary_pos_emb.treeattn_checked = checked
    return apply_rotary_pos_emb


def install_rope(model) -> int:
    """Replace ``apply_rotary_pos_emb`` in the modeling module of ``model``'s attention by one
    using ``treeattn::rope`` for calls in the dtypes where :func:`is_rope` found it the reference
    (once per process, module and dtype: every model of that family loaded here then uses it,
    with a CPU's bits unchanged; calls of another dtype or shape go to transformers' own);
    returns how many modules use it for ``model``'s dtype."""
    import sys

    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg  # (a multimodal model's language model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = next(model.parameters())
    names = {type(m).__module__ for m in model.modules() if type(m).__name__.endswith("Attention")}
    done = 0
    for name in sorted(names):
        mod = sys.modules.get(name)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None or not callable(fn) or not _plain(w):
            continue
        original = getattr(fn, "treeattn_original", fn)
        if not hasattr(fn, "treeattn_checked"):
            fn = _rope_in_place_of(original)
        if w.dtype not in fn.treeattn_checked:
            if not is_rope(original, w.device, w.dtype, head_dim):
                continue  # (in this dtype: calls in it keep transformers' own)
            fn.treeattn_checked.add(w.dtype)
            mod.apply_rotary_pos_emb = fn
        done += 1
    return done


def install(model, weights: bool | None = None) -> dict:
    """Replace the forward of every Llama-style RMS norm (:func:`is_rms_norm`) and MLP
    (:func:`is_silu_mlp`) of ``model`` by one using ``treeattn::rms_norm`` / ``silu_mul``, and its
    family's rotary embedding (:func:`install_rope`), and concatenate its query, key and value
    projections and its MLP's gate and up where exact (``fused_weights``; ``weights``: whether to,
    by default on the GPU's branches, :func:`_gpu_branches`); returns how many of each
    (``model.treeattn_fused``)."""
    done = {"rms_norm": 0, "silu_mul": 0}
    for m in model.modules():
        if is_rms_norm(m):
            m.forward = _norm_forward(m)
            done["rms_norm"] += 1
        elif is_silu_mlp(m):
            m.forward = _mlp_forward(m)
            done["silu_mul"] += 1
    done["rope"] = install_rope(model)
    done["add_rms_norm"] = install_layers(model)
    if weights is None:
        weights = _gpu_branches(model)
    done.update(fused_weights.install(model) if weights else dict.fromkeys(fused_weights.GROUPS, 0))
    model.treeattn_fused = done
    return done


def _gpu_branches(model) -> bool:
    """Whether ``model`` runs the GPU's branches: on CUDA, or with ``TREEATTN_KERNEL=triton`` (a
    CPU running them, Triton interpreted). A CPU's own path keeps its projections apart: MKL's
    one-row product of a concatenated gate and up is slower than the two apart (measured on the
    embedded model: 266 µs against 253; its decode step 56.5 ms fused against 52.7 apart)."""
    from treeattn_kernels import gpu_path

    w = next(model.parameters(), None)
    return w is not None and gpu_path(w)


def _norm_forward(m):
    def forward(hidden_states):
        pending = m.__dict__.pop("treeattn_pending", None)  # (sum, its norm) the layer before computed
        if pending is not None and pending[0] is hidden_states:
            return pending[1]
        return rms_norm(hidden_states, m.weight, m.variance_epsilon)

    forward.treeattn_norm = True
    return forward


class _StandIn(torch.nn.Module):
    """An attention for :func:`is_prenorm_layer`: its rows halved plus one, no weights."""

    def forward(self, hidden_states=None, **kwargs):
        return hidden_states * 0.5 + 1, None


def _fused_norm(m) -> bool:
    return getattr(getattr(m, "forward", None), "treeattn_norm", False)


def is_prenorm_layer(layer, seed: int = 0) -> bool:
    """Whether decoder layer ``layer`` is Llama's pre-norm block (``h + attn(norm1(h))``, then
    ``+ mlp(norm2(.))``) with both norms fused: its own forward and :func:`_layer_forward`'s
    give the same bits on random rows, its attention replaced by a stand-in for the check (the
    block around it is what is replaced; an extra norm, scale or gate fails)."""
    if not (_fused_norm(getattr(layer, "input_layernorm", None)) and _fused_norm(layer.post_attention_layernorm)):
        return False
    if not isinstance(getattr(layer, "self_attn", None), torch.nn.Module) or not hasattr(layer, "mlp"):
        return False
    w = layer.input_layernorm.weight
    g = torch.Generator().manual_seed(seed)
    real = layer.self_attn
    layer.self_attn = _StandIn()
    try:
        with torch.inference_mode():
            x = (torch.randn(2, 3, w.shape[0], generator=g) * 4).to(w.device, w.dtype)
            return torch.equal(type(layer).forward(layer, x), _layer_forward(layer)(x))
    except Exception:  # noqa: BLE001 - a layer of another signature: not ours to replace
        return False
    finally:
        layer.self_attn = real


def _layer_forward(layer):
    """Llama's pre-norm block with each residual add fused with the norm after it: the
    post-attention norm here, and the next layer's input norm (or the model's last norm,
    ``layer.treeattn_next_norm``) after the MLP, whose output waits on that norm for it (keyed by
    the sum it normed: a norm handed another tensor computes its own)."""

    def forward(hidden_states, **kwargs):
        normed = layer.input_layernorm(hidden_states)
        attn, _ = layer.self_attn(hidden_states=normed, **kwargs)
        post = layer.post_attention_layernorm
        normed, hidden = add_rms_norm(attn, hidden_states, post.weight, post.variance_epsilon)
        out = layer.mlp(normed)
        nxt = layer.__dict__.get("treeattn_next_norm")
        if nxt is None:
            return hidden + out
        normed, total = add_rms_norm(out, hidden, nxt.weight, nxt.variance_epsilon)
        nxt.treeattn_pending = (total, normed)
        return total

    return forward


def install_layers(model) -> int:
    """Replace the forward of every decoder layer of ``model`` that is Llama's pre-norm block
    (:func:`is_prenorm_layer`, checked once per class) by :func:`_layer_forward`, each layer's
    last add fused with the next layer's input norm, the last layer's with the model's final
    norm where that is fused too; returns how many layers."""
    checked: dict = {}
    done = 0
    for stack in model.modules():
        layers = getattr(stack, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            continue
        ours = []
        for layer in layers:
            kind = type(layer)
            if kind not in checked:
                checked[kind] = is_prenorm_layer(layer)
            ok = checked[kind] and _fused_norm(layer.input_layernorm) and _fused_norm(layer.post_attention_layernorm)
            # (each layer's own parts too: a hybrid class may hold another attention in some layers)
            ours.append(ok and isinstance(getattr(layer, "self_attn", None), torch.nn.Module) and hasattr(layer, "mlp"))
        final = getattr(stack, "norm", None)
        for i, layer in enumerate(layers):
            if not ours[i]:
                continue
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) and ours[i + 1] else None
            if i + 1 == len(layers) and final is not None and _fused_norm(final):
                nxt = final
            layer.__dict__["treeattn_next_norm"] = nxt  # (not a submodule: the next layer owns it)
            layer.forward = _layer_forward(layer)
            done += 1
    return done


def _mlp_forward(m, act_mul=None):
    act_mul = act_mul or silu_mul  # (is_silu_mlp checks the formula with the reference's)

    def forward(x):
        return m.down_proj(act_mul(m.gate_proj(x), m.up_proj(x)))

    return forward
