"""Tensor parallelism through transformers' own loader, on a sub-mesh of the (cp × tp) grid.

transformers 5.x shards a model over a mesh it builds itself from the whole world
(``DistributedConfig(tp_size=T)``); no public argument takes a sub-mesh, which the tp groups of a
(cp × tp) grid are. Its loader asks one function for the mesh (:data:`HOOK`): while loading, we
answer with the tp group of this rank. A private function, so :func:`hook_problem` tests for it
(where it is, what it takes, what it returns) before any rank starts; without it ``--tp`` is
refused in one line and everything else works.

Which plan: the model's own ``base_model_tp_plan``. A model without one (gpt-oss in transformers
5.23) gets :func:`attention_plan`: the attention's projections split by heads (q/k/v by output,
o by input, attention sinks with their heads) and everything else replicated, so the KV cache
and the attention are still split T ways. Whether the plan splits heads at all matters to the
cache: Phi-3's fused ``qkv_proj`` is sharded and gathered again (``colwise_gather_output``), so
every tp rank attends with all heads (:func:`heads_split`).
"""

from __future__ import annotations

import contextlib
import inspect

HOOK = ("transformers.distributed.mixin", "initialize_distributed_mesh")

_COLWISE = ("colwise", "packed_colwise", "local_colwise")  # styles that leave each rank its own slice


def hook_problem() -> str | None:
    """None when transformers' loader can be handed our sub-mesh; else why not (one line)."""
    import importlib

    import transformers

    where = ".".join(HOOK)
    try:
        fn = getattr(importlib.import_module(HOOK[0]), HOOK[1])
        from transformers.distributed.utils import TransformersDeviceMesh
    except (ImportError, AttributeError):
        return f"--tp needs transformers' tensor-parallel loader ({where}), absent from transformers {transformers.__version__}"
    try:
        params = list(inspect.signature(fn).parameters)
        mesh_params = set(inspect.signature(TransformersDeviceMesh).parameters)
    except (TypeError, ValueError):
        params, mesh_params = [], set()
    if (
        params != ["distributed_config"]
        or mesh_params != {"dense_mesh", "expert_mesh"}
        or not hasattr(TransformersDeviceMesh, "get_mesh")
    ):
        return (
            f"--tp needs transformers' tensor-parallel loader as treeattn knows it ({where}); "
            f"transformers {transformers.__version__} changed it"
        )
    return None


def model_plan(config) -> dict:
    """The model's own tensor-parallel plan (``base_model_tp_plan``), or {} if it has none."""
    c = getattr(config, "text_config", None) or config
    return dict(getattr(c, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None) or {})


def attention_plan(module_names) -> dict:
    """A plan for a model without its own: the attention split by heads, the rest replicated.
    Needs separate q/k/v/o projections (``module_names``: the model's module and parameter
    names); {} when it has none."""
    import re

    names = set(module_names)
    layer = next((n.rsplit(".q_proj", 1)[0] for n in sorted(names) if n.endswith("self_attn.q_proj")), None)
    if layer is None or not all(f"{layer}.{p}" in names for p in ("k_proj", "v_proj", "o_proj")):
        return {}
    stem = re.sub(r"\.\d+\.", ".*.", layer)  # e.g. model.layers.*.self_attn
    plan = {
        f"{stem}.q_proj": "colwise",
        f"{stem}.k_proj": "colwise",
        f"{stem}.v_proj": "colwise",
        f"{stem}.o_proj": "rowwise",
    }
    if f"{layer}.sinks" in names:  # one learned logit per query head: split with the heads
        plan[f"{stem}.sinks"] = "colwise"
    return plan


def heads_split(plan: dict) -> bool:
    """Whether ``plan`` leaves each tp rank 1/T of the attention heads (q, k and v projections
    sharded by output and not gathered again)."""
    styles = {k.rsplit(".", 1)[-1]: v for k, v in plan.items() if ".self_attn." in k or k.startswith("self_attn.")}
    return all(styles.get(p) in _COLWISE for p in ("q_proj", "k_proj", "v_proj"))


@contextlib.contextmanager
def loading(tp_mesh, device):
    """Inside: transformers' loader shards over ``tp_mesh`` (this rank's tp group, a 1-D mesh
    named "tp") on ``device`` instead of a mesh of the whole world."""
    if tp_mesh is None:
        yield
        return
    import importlib

    from transformers.distributed.utils import TransformersDeviceMesh

    class SubMesh(TransformersDeviceMesh):
        """Only tensor parallelism: every view the loader asks for is the tp group."""

        def get_mesh(self, dims):
            dims = (dims,) if isinstance(dims, str) else tuple(dims)
            if "tp" not in dims:
                raise ValueError(f"treeattn shards weights over a tp group only, not {dims}")
            return self._dense_mesh

    mod = importlib.import_module(HOOK[0])
    real = getattr(mod, HOOK[1])
    setattr(mod, HOOK[1], lambda config: (device, SubMesh(tp_mesh, tp_mesh)))
    try:
        yield
    finally:
        setattr(mod, HOOK[1], real)
