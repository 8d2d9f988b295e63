"""A document's copies outside the pool, for ``documents.Documents`` (``docs``): found in the
cache directory and checked whoever wrote them (:func:`saved_manifest`), or a longer document's
that starts with its first segments (:func:`find_prefix`), loaded into its blocks from the host
tier or from disk (:func:`load`), refused when damaged (:func:`refuse`,
:func:`damaged`: removed, the document prefilled and saved again), written there
(:func:`write`: a full disk stops the writes with one line). Every function is a collective:
every rank calls it for the same document at the same point."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .host_tier import copy_in, layers_per_round


def saved_manifest(docs, saved: Path | None, ref: dict, ids: list, prefix: int = 0) -> dict | None:
    """The manifest of the saved copy at ``saved`` if it can be loaded for ``ids`` here: the
    request's own (``manifest``: validated by the launcher, ``--load-kv``), else the cache
    directory's, checked now (``kvstore.validate``: this model, dtype and shapes, its files
    whole, these tokens; ``prefix``: its first ``prefix`` tokens are those of ``ids``) whether or
    not this engine wrote it; one that fails is removed with one line (rank 0) and reported
    (``corrupt``). The same answer on every rank."""
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
            if prefix and kvstore.load_ids(saved)[:prefix] != list(ids[:prefix]):
                raise kvstore.KVError(f"{saved} holds other tokens than its manifest's digests say")
            if not prefix and manifest["tokens"]["sha256"] != kvstore.ids_sha256(ids):
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
    the document is ready once ``doc.restore`` is None); a saved one at once, or its first
    ``doc.load_upto`` segments (a longer document's copy: the rest is prefilled after them)."""
    from . import kvstore

    eng = docs.engine
    under_way = doc.restore is not None and doc.restored > 0  # (the same on every rank) its blocks are held
    upto = doc.counts[doc.load_upto] if doc.load_upto else None  # every rank's tokens of a prefix
    if doc.restore is not None:
        need = int(doc.restore.pos.numel())
    elif upto is not None:
        need = upto[eng.mesh.cp_index]
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
        if upto is not None and not eng.world.all_true(_unchanged(saved, manifest)):
            doc.load, doc.load_upto, doc.source = None, 0, "prefill"  # replaced since it was found: prefilled
            return True
        why = None
        try:
            kvstore.load_into(
                saved, manifest, doc.cache, cp=eng.mesh.cp, cp_index=eng.mesh.cp_index, head0=eng.head0, upto=upto
            )
        except kvstore.KVError as e:  # (a checksum, a file cut since it was validated)
            if not doc.owned:
                raise  # the user's own --load-kv: one line, not a silent prefill
            why = str(e)
        if not eng.world.all_true(why is None):  # one rank's damaged part damages the document
            damaged(docs, doc, why)
            return True
        doc.load = None
        if (manifest.get("prefix") or {}).get("salt") != doc.salt:  # rows another mesh or storage made:
            doc.digests = None  # not what a prefill here makes, so not offered as a prefix when saved
        if upto is not None:  # the rest of the document is prefilled after them
            doc.todo, doc.load_upto = list(doc.segs[doc.load_upto :]), 0
            doc.reused = doc.loaded = sum(upto)
            docs.prefix_loads += 1
    doc.seconds = time.perf_counter() - doc.t_start
    return True


def _unchanged(saved: Path, manifest: dict) -> bool:
    """Whether the copy at ``saved`` is still the one ``manifest`` was read from (another run may
    have replaced it since a document found its prefix there)."""
    from . import kvstore

    try:
        return json.loads((saved / kvstore.MANIFEST).read_text()) == manifest
    except (OSError, ValueError):
        return False


def damaged(docs, doc, why: str | None) -> None:
    """``doc``'s saved copy in the cache directory failed its checks as it loaded (on some
    rank; ``why``: this rank's reason, if it was one of them): removed (:func:`refuse`), the
    document prefilled instead (its questions wait) and saved again once it is."""
    saved, _ = doc.load
    prefix, doc.load_upto = doc.load_upto, 0
    doc.cache.free()
    doc.load, doc.on_disk, doc.source = None, False, "prefill"
    docs.segment(doc, {"piece": doc.piece}, doc.cache.device)
    if docs.spill_meta is not None and not prefix:  # a good copy in its place once prefilled (write-through;
        doc.save = {"target": saved, "meta": docs.spill_meta, "soft": True}  # a prefix's is another document's)
    refuse(docs, saved, saved.name if prefix else doc.key, why)


def find_prefix(docs, root: Path, doc, ref: dict) -> tuple | None:
    """``(saved, manifest, upto)``: the saved copy in the cache directory ``root`` holding the
    most of ``doc``'s first segments, more than the pool gave it, and how many (``upto``) — a
    longer or diverging document prefilled the same way (its manifest's ``prefix``: the same
    :func:`block_reuse.prefill_salt`, the same digest of the tokens up to a segment's end), found
    by its blocks' chained keys whether or not this engine saw it. Rank 0 reads the directory
    (each manifest once, :attr:`Documents.prefix_index`; only this model's and dtype's copies: a
    copy another model saved there is not this engine's to judge) and tells the others; every
    rank then checks the copy as any saved copy (:func:`saved_manifest`) and its ``prefix``
    against its own document (:func:`_same_prefix`). None: prefill."""
    from . import kvstore

    eng = docs.engine
    have = len(doc.segs) - len(doc.todo)  # segments the pool gave
    best = None
    if eng.lead:
        try:
            best = _best_prefix(docs, root, doc, have, (ref.get("save_meta") or {}).get("identity"))
        except Exception:  # noqa: BLE001 - a directory it cannot read is no prefix; the ranks wait below
            best = None
    best = eng.world.broadcast_object(best)
    if best is None:
        return None
    name, upto = best
    saved = root / name
    manifest = saved_manifest(
        docs, saved, {**ref, "key": name, "manifest": None}, doc.ids, prefix=doc.segs[upto - 1][1]
    )
    ok = manifest is not None and kvstore.as_saved(manifest, eng.mesh.cp) and _same_prefix(manifest, doc, upto)
    return (saved, manifest, upto) if eng.world.all_true(ok) else None


def _same_prefix(manifest: dict, doc, upto: int) -> bool:
    """Whether ``manifest``'s ``prefix`` says its first ``upto`` segments are ``doc``'s, prefilled
    as ``doc`` is here."""
    prefix = manifest.get("prefix")
    return (
        isinstance(prefix, dict)
        and prefix.get("salt") == doc.salt
        and list(prefix.get("digests") or [])[:upto] == list(doc.digests[:upto])
    )


def _best_prefix(docs, root: Path, doc, have: int, identity: dict | None) -> tuple | None:
    """Rank 0's side of :func:`find_prefix`: ``(name, segments)`` of the longest match, or None.
    ``identity``: this model's (``kvstore.model_identity``); a copy of another model or dtype is
    passed over, never judged."""
    best = None
    index = docs.prefix_index
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return None
    dtype = docs.engine.saver.dtype
    for d in entries:
        if d.name == doc.key or ".partial-" in d.name or ".old-" in d.name:
            continue
        try:
            stamp = (d / "manifest.json").stat().st_mtime_ns
            if index.get(d.name, (None,))[0] != stamp:
                m = json.loads((d / "manifest.json").read_text())
                index[d.name] = (stamp, m.get("prefix") or {}, m.get("model"), m.get("dtype"))
            _, prefix, model, saved_dtype = index[d.name]
            if (identity is not None and model != identity) or saved_dtype != dtype:
                continue
            if not isinstance(prefix, dict) or prefix.get("salt") != doc.salt:
                continue
            theirs = list(prefix.get("digests") or [])
        except (OSError, ValueError, TypeError, AttributeError):  # (not a manifest this version reads)
            continue
        n = next((i for i, (a, b) in enumerate(zip(theirs, doc.digests)) if a != b), min(len(theirs), len(doc.digests)))
        if n > max(have, best[1] if best else 0):
            best = (d.name, n)
    for name in [k for k in index if not (root / k).exists()]:  # (copies gone since)
        del index[name]
    return best


def prefix_of(doc) -> dict | None:
    """What a saved copy of ``doc`` says of how it was prefilled (``kvstore.finish_save``'s
    ``prefix``), or None when its rows are not what a prefill here makes."""
    return {"salt": doc.salt, "digests": doc.digests} if doc.digests else None


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
