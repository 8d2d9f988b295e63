"""A document's saved copy is checked on every read (issue 52, item 3): each tensor of a shard
file carries the CRC-32 of its bytes, read back as it loads; a copy damaged after it was saved
(one flipped byte, a file cut short) on any rank is refused on every rank, removed from the
cache directory with one line, and the document prefilled: the same answer, never a wrong one,
never a crash, and the next eviction saves a good copy again. So is another model's copy under
the same name (the same tokens): checked before it is read, whoever wrote it."""

from __future__ import annotations

from pathlib import Path

import pytest

from treeattn_cli.engine.job import EngineJob
from treeattn_cli.parallel.launch import run_local
from treeattn_cli.verify import tiny as tiny_models

from ranks import greedy_batch, recording

NEW = 5
DOC = [(13 * i + 5) % 230 + 20 for i in range(60)]
Q = [(29 * i + 11) % 230 + 20 for i in range(5)]


def damage(path: Path, how: str) -> None:
    if how == "foreign":  # another model's copy under the same name (the same tokens)
        import json

        m = json.loads((path.parent / "manifest.json").read_text())
        m["model"]["weights_fingerprint"] = "0" * 64
        (path.parent / "manifest.json").write_text(json.dumps(m))
        return
    data = bytearray(path.read_bytes())
    if how == "flip":  # one bit of a byte in the middle of the tensors' data
        data[len(data) * 2 // 3] ^= 0x10
    else:  # cut: the file loses its last third
        data = data[: len(data) * 2 // 3]
    path.write_bytes(bytes(data))


def written_through(job, new, root) -> dict:
    """A batch of one slot, 16-token blocks, no host tier, every document saved to ``root`` as
    it is made."""
    from treeattn_cli.storage.kvstore import model_identity

    save_meta = {"identity": model_identity(job.model_dir), "composition": {}}
    return greedy_batch(new, page=16, host_memory=0, dir=str(root), save=True, save_meta=save_meta)


def saved_then_damaged(ctx, job, doc, q, new, root, file, how):
    """``q`` over ``doc`` three times, the document leaving memory after each answer (no host
    tier; saved to ``root`` as it is made); before the second, rank 0 damages the saved
    copy's ``file`` (``how``: flip, cut). Rank 0 returns the answers, how the document became
    resident each time, whether its saved copy was there after each, and the engine's reports."""
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.requests import document_key

    key = document_key(doc)
    spec = written_through(job, new, root)
    out: dict = {"answers": [], "sources": [], "saved": []}
    with recording(ctx) as rec:
        eng = Engine(ctx, job)
        for i in range(3):
            if i == 1:
                if ctx.rank == 0:
                    damage(Path(root) / key / file, how)
                eng.world.barrier()
            rec.clear()
            eng.serve([{**spec, "questions": [{"ids": q, "doc": {"key": key, "ids": doc}}]}])
            out["answers"].append(rec.answers.get(0))
            out["sources"].append(rec.sources.get(0))
            out["saved"].append((Path(root) / key / "manifest.json").exists())
            eng.documents.act({"key": key, "ids": doc, "action": "drop", "piece": 8})  # out of memory, its
            # cached blocks forgotten (the saved copy stays: the server's catalogue removes that)
        out["reports"] = rec.reports
        eng.serve([{"op": "stop"}])
    out["stderr"] = rec.stderr
    return out


@pytest.mark.parametrize(
    "file,how,why",
    [
        ("kv-c0-t0.safetensors", "flip", "do not match their checksum"),
        ("kv-c0-t0.safetensors", "cut", "is truncated or corrupt"),
        ("kv-c1-t0.safetensors", "flip", "damaged on another rank"),
        ("kv-c0-t0.safetensors", "foreign", "was saved from another model"),
    ],
    ids=["flip-rank0", "cut-rank0", "flip-rank1", "foreign"],
)
def test_a_damaged_saved_copy_is_removed_and_the_document_prefilled(tiny, tmp_path, file, how, why):
    model = tiny("llama", seed=3)
    want = tiny_models.hf_greedy(model, DOC + Q, NEW)
    job = EngineJob(str(model), [], dtype="float32", max_new_tokens=NEW)
    outs = run_local(saved_then_damaged, 2, job, DOC, Q, NEW, tmp_path, file, how, timeout_s=180)
    lead = outs[0]
    assert lead["answers"] == [want] * 3
    assert lead["sources"] == ["prefill", "prefill", "disk"], lead["sources"]  # refused, then a good copy again
    assert lead["saved"] == [True, True, True]
    corrupt = [k for r in lead["reports"] for k in r.get("corrupt", [])]
    assert len(corrupt) == 1, lead["reports"]
    assert not any("warning" in o["stderr"] for o in outs[1:]), outs[1]["stderr"]  # one line: rank 0's
    err = lead["stderr"]
    lines = [x for x in err.splitlines() if "treeattn: warning:" in x]
    assert len(lines) == 1 and "removed from the cache, the document is prefilled again" in lines[0], err[-2000:]
    assert why in lines[0], lines[0]  # rank 0 says what it found (a rank's damage: every rank refuses the copy)


def full_disk(ctx, job, docs, q, new, root):
    """``q`` over each of ``docs`` with a cache directory ``root`` whose disk is full for rank 1
    (its shard writes fail with ENOSPC). Rank 0 returns the answers, what ``root`` holds after,
    the engine's reports and what it said on stderr."""
    import errno

    from treeattn_cli.storage import kvstore
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.storage.kvstore import model_identity
    from treeattn_cli.engine.requests import document_key

    if ctx.rank == 1:

        def no_space(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        kvstore.save_shard = no_space
    spec = greedy_batch(
        new,
        host_memory=0,
        budget=1,
        dir=str(root),
        save=True,
        save_meta={"identity": model_identity(job.model_dir), "composition": {}},
    )
    out: dict = {"answers": []}
    with recording(ctx) as rec:
        eng = Engine(ctx, job)
        for doc in docs + docs[:1]:
            rec.clear()
            eng.serve([{**spec, "questions": [{"ids": q, "doc": {"key": document_key(doc), "ids": doc}}]}])
            out["answers"].append(rec.answers.get(0))
        out["reports"] = rec.reports
        out["root"] = sorted(p.name for p in Path(root).iterdir())
        eng.serve([{"op": "stop"}])
    out["stderr"] = rec.stderr
    return out


def test_a_full_disk_stops_the_writes_with_one_line_and_answers_go_on(tiny, tmp_path):
    """Issue 52 (and 53's full --cache-dir): the first document's write-through fails on one
    rank; every rank gives it up (no half copy left), one line says so, no later document is
    written, and every answer is transformers' (the documents leave memory at once: a budget of
    one byte; the first comes back by a prefill)."""
    model = tiny("llama", seed=3)
    docs = [DOC, DOC[::-1][:50]]
    job = EngineJob(str(model), [], dtype="float32", max_new_tokens=NEW)
    lead = run_local(full_disk, 2, job, docs, Q, NEW, tmp_path, timeout_s=180)[0]
    assert lead["answers"] == [tiny_models.hf_greedy(model, d + Q, NEW) for d in docs + docs[:1]]
    assert lead["root"] == [], lead["root"]
    assert not any(r.get("saved") or r.get("spilled") for r in lead["reports"]), lead["reports"]
    lines = [x for x in lead["stderr"].splitlines() if "warning" in x]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "answers go on" in lines[0], lead["stderr"]


def prefixes_from_disk(ctx, job, doc, docs, q, new, root, other):
    """``doc`` saved to ``root`` as it is made, then dropped from memory (its cached blocks
    forgotten); then ``q`` over each of ``docs`` (each dropped after its answer, so nothing is
    found in the pool). Then every saved copy's manifest says another model made it, and ``q``
    over ``other``: nothing of theirs is loaded and nothing removed. Rank 0 returns, per
    document, the answer, how it became resident, the tokens it did not prefill, and the
    engine's count of prefixes loaded after it; and for ``other`` the same, with the copies
    in ``root`` before and after."""
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.requests import document_key

    spec = written_through(job, new, root)
    out: dict = {"answers": [], "sources": [], "reused": [], "loads": []}
    with recording(ctx) as rec:
        eng = Engine(ctx, job)
        for i, d in enumerate([doc, *docs]):
            rec.clear()
            eng.serve([{**spec, "questions": [{"ids": q, "doc": {"key": document_key(d), "ids": d}}]}])
            eng.documents.act({"key": document_key(d), "ids": d, "action": "drop", "piece": 8})
            if i:
                out["answers"].append(rec.answers.get(0))
                out["sources"].append(rec.sources.get(0))
                out["reused"].append(rec.reused.get(0))
                out["loads"].append(eng.documents.prefix_loads)
        copies = sorted(p.name for p in Path(root).iterdir())
        if ctx.rank == 0:
            for name in copies:
                damage(Path(root) / name / "kv-c0-t0.safetensors", "foreign")
        eng.world.barrier()
        rec.clear()
        eng.serve([{**spec, "questions": [{"ids": q, "doc": {"key": document_key(other), "ids": other}}]}])
        out["other"] = (rec.answers.get(0), rec.sources.get(0), eng.documents.prefix_loads)
        out["copies"] = (copies, sorted(p.name for p in Path(root).iterdir()))
        eng.serve([{"op": "stop"}])
    out["stderr"] = rec.stderr
    return out


def test_a_document_starting_with_a_saved_ones_segments_loads_them_and_prefills_the_rest(tiny, tmp_path):
    """Issue 52, item 2: a document found on disk by a prefix of its blocks' chained keys. With
    2 ranks and 8-token pieces a segment is 16 tokens; ``DOC`` (60 tokens) is saved. A document
    sharing its first 48 tokens then diverging loads 3 segments (48 tokens) from DOC's copy and
    prefills the rest; one made of its first 32 tokens is all in it (source disk); one sharing
    only 40 tokens loads 2 segments (the third differs); one diverging at its first token loads
    nothing. Every answer is transformers' over the same tokens. A copy another model saved is
    passed over, not judged: with every manifest saying so, a document sharing DOC's first
    segments prefills them, and every copy stays."""
    model = tiny("llama", seed=3)
    tail = [(31 * i + 7) % 230 + 20 for i in range(20)]
    docs = [DOC[:48] + tail, DOC[:32], DOC[:40] + tail, tail + DOC[:40]]
    job = EngineJob(str(model), [], dtype="float32", max_new_tokens=NEW)
    other = DOC[:48] + tail[::-1]
    outs = run_local(prefixes_from_disk, 2, job, DOC, docs, Q, NEW, tmp_path, other, timeout_s=180)
    lead = outs[0]
    assert lead["answers"] == [tiny_models.hf_greedy(model, d + Q, NEW) for d in docs]
    assert lead["sources"] == ["prefill", "disk", "prefill", "prefill"], lead["sources"]
    assert lead["reused"][0] == 48 and lead["reused"][2] == 32 and not lead["reused"][3], lead["reused"]
    assert lead["loads"] == [1, 2, 3, 3], lead["loads"]
    assert lead["other"] == (tiny_models.hf_greedy(model, other + Q, NEW), "prefill", 3), lead["other"]
    before, after = lead["copies"]
    assert len(before) == 5 and set(before) <= set(after), lead["copies"]  # nothing of theirs removed
    assert "warning" not in lead["stderr"], lead["stderr"][-2000:]
