"""A cache written to disk by every rank of one engine at once (``kvstore.py``'s saved-KV
format): each rank its shard, rank 0 the manifest, the folder renamed into place once complete
(a crash leaves a ``.partial-`` folder, never a half cache under the real name)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Saver:
    """What a save needs of the engine: its ranks (``world``: every rank; ``mesh``: the cp × tp
    grid, ``nproc`` ranks), which KV heads this rank holds (``heads_split``: 1/tp of them from
    ``head0``; else every tp peer holds all and one writes), the model's ``shapes``, ``dtype``
    and the KV storage's name."""

    world: object
    lead: bool  # rank 0: writes the manifest
    mesh: object
    nproc: int
    heads_split: bool
    head0: int
    shapes: dict
    dtype: str
    kv_name: str

    def save(self, cache, ids, target: Path, meta: dict, *, soft: bool = False) -> str | None:
        """Every rank's shard of ``cache`` (holding ``ids``) to ``target``: written under a
        temporary name, renamed once complete; ``meta``: identity, composition, nonce. ``soft``
        (a cache directory's copy, not one the user asked for): a write that fails on any rank (a
        full disk, a directory gone) leaves nothing behind and returns why, the same on every
        rank, instead of raising; None: saved."""
        from . import kvstore

        lead = self.lead
        tmp = target.with_name(f"{target.name}.partial-{meta['nonce']}")
        why = None  # soft: this rank's failed write, an OSError
        try:
            if lead:
                tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if not soft:
                raise
            why = e
        self.world.barrier()
        if (self.heads_split or self.mesh.tp_index == 0) and why is None:  # tp peers with the same heads: one writes
            try:
                kvstore.save_shard(
                    tmp, cache, cp_index=self.mesh.cp_index, tp_index=self.mesh.tp_index, head0=self.head0
                )
            except OSError as e:
                if not soft:
                    raise
                why = e
        if soft and (failed := self._failed(why)):  # (a collective in place of the barrier)
            self.world.barrier()  # every rank past its write before rank 0 removes them
            if lead:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
            return failed
        if not soft:
            self.world.barrier()
        if lead:
            sh = self.shapes
            try:
                kvstore.finish_save(
                    tmp,
                    target,
                    ids=ids,
                    identity=meta["identity"],
                    dtype=self.dtype,
                    kv={
                        "kv_dtype": self.kv_name,
                        **(
                            {"rotation": cache.quant.rotation, "scale_groups": cache.quant.groups}
                            if cache.quant is not None
                            else {}
                        ),
                    },
                    shapes={"layers": sh["num_layers"], "kv_heads": sh["kv_heads"], "head_dim": sh["head_dim"]},
                    mesh={"nproc": self.nproc, "tp": self.mesh.tp, "cp": self.mesh.cp},
                    composition=meta.get("composition", {}),
                    prefix=meta.get("prefix"),
                )
            except OSError as e:
                if not soft:
                    raise
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
                why = e
        if soft:  # (the collective every rank waits at: the cache is in place, or nowhere)
            return self._failed(why)
        self.world.barrier()  # the cache is in place before anyone goes on
        return None

    def _failed(self, error: OSError | None) -> str | None:
        """Every rank's write error, agreed (a collective): None when no rank failed, else one
        line naming the first rank that did and why (``errno``'s words)."""
        import errno
        import os

        code = 0 if error is None else error.errno or errno.EIO
        codes = [int(c) for c in self.world.all_gather_values([code])[:, 0].tolist()]
        bad = next((r for r, c in enumerate(codes) if c), None)
        return None if bad is None else f"rank {bad}: {os.strerror(codes[bad])}"
