"""The (cp × tp) grid of ranks (docs/architecture.md §10): who shares a sequence shard, who shares weights.

``--nproc N --tp T``: ranks form ``cp = N / T`` sequence shards × ``T`` tensor-parallel ranks.
Rank ``r`` has tensor-parallel index ``r % T`` and sequence-shard index ``r // T``:

* a **tp group** is ``T`` contiguous ranks (one node, its best-linked GPUs): they hold one
  sequence shard between them, each with ``1/T`` of the weights and of the heads;
* a **cp group** is the ``cp`` ranks that share a tp index: the same heads over every sequence
  shard. Ring prefill, pass-Q, the tree merge and the ring baseline run over it.

Also here: the checks of ``--tp`` against the model's heads and the grouping of ranks by node
(torchrun's node rank, else the host). Pure logic: the collectives that gather node identities
live in ``comm.py``; the merge layout of a cp group whose ranks span nodes is the layout's
(``topology/layout.py``, ``cp_layout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh:
    world: int
    tp: int = 1
    rank: int = 0

    @property
    def cp(self) -> int:
        return self.world // self.tp

    @property
    def tp_index(self) -> int:
        return self.rank % self.tp

    @property
    def cp_index(self) -> int:
        return self.rank // self.tp

    def tp_ranks(self, cp_index: int) -> list[int]:
        return [cp_index * self.tp + t for t in range(self.tp)]

    def cp_ranks(self, tp_index: int) -> list[int]:
        return [c * self.tp + tp_index for c in range(self.cp)]

    def cp_parts(self) -> list[list[int]]:
        """Every cp group, in tp-index order (each rank is in exactly one)."""
        return [self.cp_ranks(t) for t in range(self.tp)]


def valid_tp(heads: int, kv_heads: int, nproc: int) -> list[int]:
    """Values of ``--tp`` that split both head counts evenly and divide ``nproc``."""
    g = math.gcd(heads, kv_heads)
    return [t for t in range(1, g + 1) if g % t == 0 and nproc % t == 0]


def check_tp(tp: int, heads: int, kv_heads: int, nproc: int) -> None:
    """Refuse a ``--tp`` that cannot shard this model's heads on ``nproc`` ranks (one line)."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if heads % tp or kv_heads % tp or nproc % tp:
        raise ValueError(
            f"--tp {tp} does not fit: the model has H = {heads} query heads and H_kv = "
            f"{kv_heads} KV heads, and --nproc is {nproc}; --tp must divide all three: "
            f"{', '.join(map(str, valid_tp(heads, kv_heads, nproc)))}"
        )


def node_groups(nodes: list[str]) -> list[list[int]]:
    """Ranks per node, nodes in order of their first rank: ``nodes[r]`` is rank r's node."""
    out: dict[str, list[int]] = {}
    for r, n in enumerate(nodes):
        out.setdefault(n, []).append(r)
    return list(out.values())


def check_tp_within_nodes(mesh: Mesh, nodes: list[str]) -> None:
    """A tp group talks twice per layer: it must not span nodes."""
    for c in range(mesh.cp):
        where = {nodes[r] for r in mesh.tp_ranks(c)}
        if len(where) > 1:
            raise ValueError(
                f"--tp {mesh.tp}: ranks {mesh.tp_ranks(c)} would form a tensor-parallel group "
                f"across nodes ({', '.join(sorted(where))}); use a --tp that divides the ranks "
                f"per node"
            )
