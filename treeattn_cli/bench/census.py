"""The decode step's kernel census (issue 51, item 1): how many device operations one batched
decode step dispatches, per layer and per step, for a named model shape. By default on the GPU's
branches (``TREEATTN_KERNEL=triton``; on a CPU the Triton kernels run interpreted, each launch
counted as one operation: what a GPU launches, ``triton_per_layer`` of them Triton's); with
``gpu=False`` the CPU's own step (its torch attention).

Counted on this machine's ranks as the step runs: a random-weight Llama of the shape (its
heads, KV heads and head dim; the MLP and vocabulary cut, which change no count), one rank, a
short document in the block pool and one question decoding (``chat``'s and ``serve``'s path:
``BatchDecoder._step``); every ATen operation dispatched while the step runs is recorded
(``torch.utils._python_dispatch``) but views and allocations, which launch nothing on a GPU. A
layer's count is the difference between the model cut to 3 layers and to 2; the step's is the
2-layer count with the layers scaled to the shape's. On a CPU the attention is the engine's
torch path, not the GPU's two Triton launches; the count is the engine's own, so what a fusion
removes shows here first (``tests/bench/test_census.py`` fails when it grows).

    treeattn bench --census --model-shape llama-3.1-8b --json
"""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

# ATen operations that launch no kernel on a GPU: allocations and metadata (views are told by
# their schema: ``OpOverload.is_view``)
FREE = {"empty", "empty_like", "empty_strided", "detach", "lift_fresh", "alias", "set_", "resize_"}
MLP, VOCAB, DOC, NEW = 256, 256, 48, 6


def _launches(func) -> bool:
    """Whether the ATen operation ``func`` launches device work (not a view or an allocation)."""
    return not getattr(func, "is_view", False) and func.overloadpacket.__name__ not in FREE


def census_rank(ctx, jobs: list, doc: list[int], new: int, gpu: bool = False):
    """One rank, for each of ``jobs`` (an engine each, one after the other): one question over
    ``doc`` (in the block pool), ``new`` tokens; the operations of each decode step the batch
    runs, by name. Returns each job's last step's counts (the first may set things up). ``gpu``:
    on the GPU's branches (``TREEATTN_KERNEL=triton``: the Triton kernels a GPU launches, run by
    Triton's interpreter), each kernel launch counted as one operation (``triton:<name>``)."""
    import os

    from torch.utils._python_dispatch import TorchDispatchMode
    from treeattn_kernels import targets

    if gpu:
        os.environ["TREEATTN_KERNEL"] = "triton"
        from treeattn_kernels import partial_triton

        partial_triton.ONE_SPLIT_COPY["on"] = False  # the reduce a GPU launches, not the interpreter's copies

    from ..engine.batch import BatchDecoder
    from ..engine.engine import Engine
    from ..engine.sampling import Sampling

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            launched = targets._state["counted"]
            before = len(launched) if launched is not None else 0
            out = func(*args, **(kwargs or {}))
            if _launches(func) and not (launched is not None and len(launched) > before):
                self.ops[func.overloadpacket.__name__] += 1  # (an operation that launched kernels: they count)
            return out

    steps, out = [], []
    real = BatchDecoder._step

    def counted(self, *a, **kw):
        launched = targets._state["counted"] = []
        try:
            with Count() as c:
                out = real(self, *a, **kw)
        finally:
            targets._state["counted"] = None
        c.ops.update(f"triton:{k}" for k in launched)
        steps.append(c.ops)
        return out

    BatchDecoder._step = counted
    try:
        for job in jobs:
            steps.clear()
            eng = Engine(ctx, job)
            eng.serve(
                [
                    {
                        "op": "batch",
                        "max_new_tokens": new,
                        "sampling": vars(Sampling()),
                        "stop": [],
                        "eos_ids": [],
                        "speculate": "off",
                        "slots": 1,
                        "questions": [{"ids": doc[-4:], "doc": {"key": "census", "ids": doc[:-4]}}],
                    }
                ]
            )
            eng.serve([{"op": "stop"}])
            out.append(dict(steps[-1]) if steps else {})
            del eng
    finally:
        BatchDecoder._step = real
    return out


def census(
    shape_name: str, root: Path | None = None, head_dim: int | None = None, gpu: bool = True, kv_dtype: str = "auto"
) -> dict:
    """The census record of ``shape_name`` (``projection.MODEL_SHAPES``). ``head_dim``: narrower
    heads than the shape's (the test's: the same operations on smaller tensors, measured equal).
    ``gpu`` (the default): the step on the GPU's branches, its Triton kernels interpreted and each
    launch counted once (what a GPU launches); else the CPU's own step (its torch attention).
    ``kv_dtype``: the cache's storage (``--kv-dtype``: fp8's writes and rotations count too)."""
    from ..engine.job import EngineJob
    from ..parallel.launch import run_local
    from ..verify.tiny import make_model
    from .projection import model_shape

    shape = model_shape(shape_name)
    d = head_dim or shape.head_dim
    root = Path(root or tempfile.mkdtemp(prefix="treeattn-census-"))
    jobs = []
    for layers in (2, 3):
        path = root / f"{shape_name}-d{d}-{layers}"
        if not (path / "config.json").exists():
            make_model(
                "llama",
                path,
                seed=0,
                vocab_size=VOCAB,
                hidden_size=shape.heads * d,
                intermediate_size=MLP,
                num_hidden_layers=layers,
                num_attention_heads=shape.heads,
                num_key_value_heads=shape.kv_heads,
                head_dim=d,
                max_position_embeddings=4096,
            )
        jobs.append(
            EngineJob(str(path), [], dtype="bfloat16", kv_dtype=kv_dtype, max_new_tokens=NEW)
        )  # (a GPU's dtype)
    doc = [(13 * i + 5) % (VOCAB - 20) + 10 for i in range(DOC)]
    import os

    before = os.environ.get("TRITON_INTERPRET")
    if gpu:  # the ranks are CPU ranks: Triton's interpreter runs the kernels (set before they start)
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        counts = dict(zip((2, 3), run_local(census_rank, 1, jobs, doc, NEW, gpu, timeout_s=600)[0]))
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
    two, three = (sum(counts[n].values()) for n in (2, 3))
    per_layer = three - two
    layer_ops = {k: counts[3].get(k, 0) - counts[2].get(k, 0) for k in set(counts[3]) | set(counts[2])}
    model_level = two - 2 * per_layer
    return {
        "model_shape": shape_name,
        "head_dim": d,
        "kv_dtype": kv_dtype,
        "layers": shape.layers,
        "kernels_per_layer": per_layer,
        "kernels_per_step": model_level + shape.layers * per_layer,
        "model_level": model_level,
        "layer_ops": {k: v for k, v in sorted(layer_ops.items(), key=lambda kv: -kv[1]) if v},
        "triton_per_layer": sum(v for k, v in layer_ops.items() if k.startswith("triton:")),
        "counted_on": (
            f"the GPU's branches on a CPU (Triton interpreted, a launch one operation), bf16, KV {kv_dtype}: one rank, "
            "a batched decode step (BatchDecoder._step)"
            if gpu
            else f"cpu, bf16, KV {kv_dtype}: one rank, a batched decode step (BatchDecoder._step), the engine's torch attention"
        ),
    }
