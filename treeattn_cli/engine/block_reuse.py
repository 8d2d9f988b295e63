"""Prefix reuse by block (docs/architecture.md §12): each full block of a document's shard gets
a key chained from every token before it (``pool.block_keys``), salted with whatever else fixes
its numbers; a new document takes the blocks the pool already holds under its keys (shared, not
copied) and prefills from there, and publishes its own once computed. ``eng``: the rank's
``engine.Engine`` (its mesh, heads, sharding, storage, world); ``pool``: its ``pool.BlockPool``;
``doc``: a ``documents.Document``."""

from __future__ import annotations

from .pool import block_keys


def prefill_salt(eng, pool, piece: int) -> str:
    """What, besides the tokens and the model, fixes the numbers a prefill writes into every
    rank's blocks: the mesh, how segments are cut and sharded, the storage. A saved copy's
    manifest carries it with its segments' digests (``prefix``): a longer document prefilled
    the same way starts with the same numbers (:func:`copies.find_prefix`)."""
    m = eng.mesh
    return (
        f"treeattn-doc|cp={m.cp}|tp={m.tp}|{eng.dec.sharding}|segment={m.cp * piece}|{eng.kv_name}|"
        f"{pool.dtype}|page={pool.page}"
    )


def salt(eng, pool, piece: int) -> str:
    """:func:`prefill_salt` and the rank's place in the mesh (its sequence shard, its heads):
    what fixes the numbers of this rank's blocks (the pool belongs to one engine: one model)."""
    m = eng.mesh
    return f"{prefill_salt(eng, pool, piece)}|rank={m.cp_index}.{m.tp_index}|head0={eng.head0}"


def plan(eng, pool, doc, piece: int) -> None:
    """Where the document's tokens go (every rank's shard after each segment) and this rank's
    chained block keys (``doc.keys``). A block's keys and values depend on every token
    before it on every rank, and (bitwise) on the segments that computed them, so its key's
    scope is the digest of every token up to the end of the segment its last token was
    prefilled in; with the segment length in the salt, equal keys mean equal numbers."""
    import hashlib

    import numpy as np

    from .prefill import positions, shard, size

    p, r = eng.mesh.cp, eng.mesh.cp_index
    ids = np.asarray(doc.ids, dtype=np.int64)
    counts, mine, digests, ends = [[0] * p], [], [], []
    h = hashlib.sha256()
    for s0, s1 in doc.segs:
        pieces = shard(s0, s1 - s0, p, balanced=eng.dec.sharding == "balanced")
        counts.append([c + size(pc) for c, pc in zip(counts[-1], pieces)])
        mine.append(positions(pieces[r]).numpy())
        h.update(ids[s0:s1].tobytes())
        digests.append(h.copy().digest())
        ends.append(counts[-1][r])
    pos = np.concatenate(mine) if mine else np.zeros(0, dtype=np.int64)
    page = pool.page
    last = np.minimum(np.arange(page, len(pos) + page, page), len(pos))  # each block's end
    seg_of_block = np.searchsorted(np.asarray(ends), last, side="left")
    doc.counts = counts
    doc.digests = [x.hex() for x in digests]  # of its tokens up to each segment's end (a saved copy's prefix)
    doc.salt = prefill_salt(eng, pool, piece)
    doc.keys = block_keys(
        ids[pos].tolist(), pos.tolist(), page, salt(eng, pool, piece), [digests[j] for j in seg_of_block], tail=True
    )


def reuse(eng, pool, doc) -> None:
    """Take the longest prefix of ``doc``'s segments whose blocks every rank's pool holds
    (cached by any earlier document: the same tokens prefilled the same way), shared, not
    copied; its prefill goes on from there. The ranks agree on how many segments."""
    cache, page = doc.cache, pool.page
    found = pool.match(doc.keys)  # acquired for this table
    ends = [c[eng.mesh.cp_index] for c in doc.counts]  # this rank's tokens after j segments
    j = max(i for i, e in enumerate(ends) if e <= min(len(found) * page, ends[-1]))
    j = eng.world.all_min(j)
    if j == 0:
        pool.release(found)
        return
    cache.adopt(found, ends[j], doc.counts[j])
    doc.todo = list(doc.segs[j:])
    doc.reused = sum(doc.counts[j])


def publish(doc) -> None:
    """Offer the document's full blocks to later documents that start with the same tokens."""
    if doc.keys:
        table = doc.cache.table
        table.publish(doc.keys if not doc.todo else doc.keys[: table.length // table.pool.page])
