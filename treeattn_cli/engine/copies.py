"""A document's copies outside the pool, for ``documents.Documents`` (``docs``): found in the
cache directory and checked whoever wrote them (:func:`saved_manifest`), loaded into its blocks
from the host tier or from disk (:func:`load`), refused when damaged (:func:`refuse`,
:func:`damaged`: removed, the document prefilled and saved again), written there
(:func:`write`: a full disk stops the writes with one line). Every function is a collective:
every rank calls it for the same document at the same point."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .host_tier import copy_in, layers_per_round


def saved_manifest(docs, saved: Path | None, ref: dict, ids: list) -> dict | None:
    """The manifest of the saved copy at ``saved`` if it can be loaded for ``ids`` here: the
    request's own (``manifest``: validated by the launcher, ``--load-kv``), else the cache
    directory's, checked now (``kvstore.validate``: this model, dtype and shapes, its files
    whole, these tokens) whether or not this engine wrote it; one that fails is removed with
    one line (rank 0) and reported (``corrupt``). The same answer on every rank."""
    from . import kvstore

    if saved is None:
        return None
    if ref.get("manifest") is not None:
        return ref["manifest"]
    eng = docs.engine
    if not eng.world.all_true((saved / kvstore.MANIFEST).exists()):
        return None
    identity, why, manifest = (ref.get("save_meta") or {}).get("identity"), None, None
    try:
        if identity is None:  # (nothing to check it against: a test's directory)
            manifest = json.loads((saved / kvstore.MANIFEST).read_text())
        else:
            sh = eng.saver.shapes
            manifest = kvstore.validate(
                saved,
                identity=identity,
                dtype=eng.saver.dtype,
                shapes={"layers": sh["num_layers"], "kv_heads": sh["kv_heads"], "head_dim": sh["head_dim"]},
            )
            if manifest["tokens"]["sha256"] != kvstore.ids_sha256(ids):
                raise kvstore.KVError(f"{saved} holds other tokens than its name says")
    except (kvstore.KVError, ValueError, OSError) as e:
        why = str(e) or type(e).__name__
    if eng.world.all_true(why is None):
        return manifest
    refuse(docs, saved, ref.get("key"), why)
    return None


def refuse(docs, saved: Path, key: str | None, why: str | None) -> None:
    """A saved copy in the cache directory that cannot be used (``why``: this rank's reason,
    if it found one): removed (rank 0, with one line on stderr), reported (``corrupt``)."""
    import shutil
    import sys

    if docs.engine.lead:
        print(
            f"treeattn: warning: {why or f'the saved copy of document {key} is damaged on another rank'}: "
            f"removed from the cache, the document is prefilled again",
            file=sys.stderr,
            flush=True,
        )
        shutil.rmtree(saved, ignore_errors=True)
    if key is not None:
        docs.changes["corrupt"].append(key)


def load(docs, doc, evict: bool = True) -> bool:
    """Load ``doc``'s copy (in host memory, else saved) into its blocks if every rank has
    them (``evict``: making room first, as for a prefill segment); False: it waits, nothing
    changed. A copy in host memory comes a part at a time (``doc.restored``: the layers copied;
    the document is ready once ``doc.restore`` is None); a saved one at once."""
    from . import kvstore

    eng = docs.engine
    under_way = doc.restore is not None and doc.restored > 0  # (the same on every rank) its blocks are held
    if doc.restore is not None:
        need = int(doc.restore.pos.numel())
    else:
        need = kvstore.shard_counts(doc.load[1], eng.mesh.cp)[eng.mesh.cp_index]
    if not under_way and not docs.room(doc, need, evict=evict):  # (a collective: every rank asks, 0 or not)
        return False
    if doc.restore is not None:  # a part of its layers this round (host_tier.RESTORE_BYTES_PER_ROUND)
        doc.restored = copy_in(doc.restore, doc.cache, doc.restored, layers_per_round(doc.restore))
        docs.restore_parts += 1
        if doc.restored < len(doc.restore.layers):
            return True
        doc.restore, doc.restored = None, 0
    else:
        saved, manifest = doc.load
        why = None
        try:
            kvstore.load_into(saved, manifest, doc.cache, cp=eng.mesh.cp, cp_index=eng.mesh.cp_index, head0=eng.head0)
        except kvstore.KVError as e:  # (a checksum, a file cut since it was validated)
            if not doc.owned:
                raise  # the user's own --load-kv: one line, not a silent prefill
            why = str(e)
        if not eng.world.all_true(why is None):  # one rank's damaged part damages the document
            damaged(docs, doc, why)
            return True
        doc.load = None
    doc.seconds = time.perf_counter() - doc.t_start
    return True


def damaged(docs, doc, why: str | None) -> None:
    """``doc``'s saved copy in the cache directory failed its checks as it loaded (on some
    rank; ``why``: this rank's reason, if it was one of them): removed (:func:`refuse`), the
    document prefilled instead (its questions wait) and saved again once it is."""
    saved, _ = doc.load
    doc.cache.free()
    doc.load, doc.on_disk, doc.source = None, False, "prefill"
    docs.segment(doc, {"piece": doc.piece}, doc.cache.device)
    if docs.spill_meta is not None:  # a good copy in its place once prefilled (write-through)
        doc.save = {"target": saved, "meta": docs.spill_meta, "soft": True}
    refuse(docs, saved, doc.key, why)


def write(docs, cache, ids, target, meta: dict, soft: bool) -> bool:
    """``cache`` (holding ``ids``) saved to ``target`` (a collective). ``soft``: a copy in the
    cache directory: once a write there fails (a full disk), one line says so and the
    directory takes no more writes this run; serving goes on. False: not saved."""
    if soft and docs.writes_off:
        return False
    why = docs.engine.saver.save(cache, ids, Path(target), meta, soft=soft)
    if why is None:
        return True
    docs.writes_off = True
    if docs.engine.lead:
        import sys

        print(
            f"treeattn: warning: cannot write to the cache directory ({why}): no more documents are saved "
            f"there this run; answers go on",
            file=sys.stderr,
            flush=True,
        )
    return False
