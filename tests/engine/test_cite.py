"""``--cite`` (issue 37): where in the document an answer comes from, exact from the merge.

Each answer row's share of attention per span, summed over the counted layers and every head,
equals transformers' own eager attention weights over the same tokens (on 1 and 3 ranks, tp 2,
with drafts accepted and rejected, in a batch beside answers that do not cite, with windows,
soft-capping and sinks); a tiny model whose attention is steered onto one sentence is cited
there on 1 and 3 ranks through the command line, with the same tokens as without ``--cite``;
text placement and bad input."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from helpers import assert_usage_error, cli
from treeattn_cli.cli import citations as C
from treeattn_cli.engine.cite import cite_layers
from treeattn_cli.engine.job import EngineJob
from treeattn_cli.engine.sampling import Sampling
from treeattn_cli.parallel.launch import run_local
from treeattn_cli.verify import tiny as tiny_models
from ranks import triton_path

NEW = 10
SPANS = [[4, 12], [12, 30], [35, 47], [47, 53]]  # of the document's positions, with a gap (30-35) and a tail


def attention_masses(model_dir, ids: list, prompt: int, rows: int, spans, layers) -> np.ndarray:
    """transformers' eager attention weights of the rows fed with answer tokens 0..rows-1 (at
    positions ``prompt``..), averaged over ``layers`` and every head, summed per span:
    ``[rows, spans]``."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        att = m(torch.tensor([ids]), output_attentions=True).attentions
    a = torch.stack([att[x][0] for x in layers]).double()  # [L, H, T, T]
    out = np.zeros((rows, len(spans)))
    for r in range(rows):
        row = a[:, :, prompt + r].mean((0, 1))  # [T]
        out[r] = [float(row[s:e].sum()) for s, e in spans]
    return out


def _decode(ids, spec, cite=True, layers=None):
    return {
        "op": "decode",
        "seq": 0,
        "max_new_tokens": NEW,
        "sampling": vars(Sampling()),
        "stop": [],
        "eos_ids": [],
        "keep": False,
        "speculate": spec,
        **({"cite": {"spans": SPANS, "layers": layers}} if cite else {}),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A copy-heavy llama (its greedy answer repeats the document: drafts are accepted), and
    gemma2 (window, soft-capping) and gpt_oss (sinks, windows) models."""
    root = tmp_path_factory.mktemp("cite")
    llama = tiny_models.make_model("llama", root / "llama", seed=7)
    start = [(13 * i + 5) % 230 + 20 for i in range(17)]
    doc = (start + tiny_models.hf_greedy(llama, start, 40)) * 2  # 114 tokens: spans cover its first 53
    return {
        "llama": (llama, doc, start),
        "gemma2": (tiny_models.make_model("gemma2", root / "gemma2", seed=4), doc, start),
        "gpt_oss": (tiny_models.make_model("gpt_oss", root / "gpt_oss", seed=5), doc, start),
    }


@pytest.mark.parametrize("world,tp", [(1, 1), (3, 1), (4, 2)], ids=["1-rank", "3-ranks", "tp2-cp2"])
def test_citation_masses_are_transformers_attention(models, world, tp):
    """Every cited answer's ``[rows, spans]`` equals transformers' attention weights averaged over
    the counted layers and heads (1e-5), one row per emitted token but the last, whatever path
    decoded it: the single step and the verify of drafts (``ngram:4`` on a copy-heavy answer:
    drafts accepted and rejected, whose rows must not count), a batch's cascade with two slots (a question that does not cite between two
    that do, one of them drafting), all layers or the default ones; gemma2 and gpt_oss on 3 ranks."""
    llama, doc, start = models["llama"]
    sessions, expect = [], []
    job = EngineJob(str(llama), [], dtype="float32", max_new_tokens=NEW, tp=tp, reserve=256)
    prompt = doc + start[:8]  # its answer copies the document, then parts from it: drafts kept and rejected
    sessions.append((job, [{"op": "append", "ids": prompt}, _decode(prompt, "ngram:4"), {"op": "stop"}]))
    expect.append([("llama", prompt, None, True)])
    qs = [start[3:], [70, 71, 72, 73], start[5:]]
    sessions.append(
        (
            job,
            [
                {"op": "append", "ids": doc},
                {
                    "op": "batch",
                    "slots": 2,
                    "max_new_tokens": NEW,
                    "sampling": vars(Sampling()),
                    "stop": [],
                    "eos_ids": [],
                    "speculate": "off",
                    "questions": [
                        {"ids": qs[0], "cite": {"spans": SPANS, "layers": [0, 1]}},
                        {"ids": qs[1]},
                        {"ids": qs[2], "cite": {"spans": SPANS}, "speculate": "ngram:3"},
                    ],
                },
                {"op": "stop"},
            ],
        )
    )
    expect.append(
        [("llama", doc + qs[0], [0, 1], False), ("llama", doc + qs[1], None, None), ("llama", doc + qs[2], None, False)]
    )
    if world == 3:
        for kind in ("gemma2", "gpt_oss"):
            m, _, _ = models[kind]
            sessions.append(
                (
                    EngineJob(str(m), [], dtype="float32", max_new_tokens=NEW, reserve=256),
                    [{"op": "append", "ids": prompt}, _decode(prompt, "ngram:4"), {"op": "stop"}],
                )
            )
            expect.append([(kind, prompt, None, False)])
    got = run_local(cite_sessions, world, sessions, timeout_s=300)[0]
    paths = {k: v[0] for k, v in models.items()}
    for answers, want in zip(got, expect):
        for rec, (kind, ids, layers, drafts) in zip(answers, want):
            toks = rec["token_ids"]
            assert toks == tiny_models.hf_greedy(paths[kind], ids, NEW), kind  # --cite changes no token
            if layers is None and drafts is None:  # the question that does not cite
                assert "cite" not in rec
                continue
            cited = np.asarray(rec["cite"])
            assert cited.shape == (len(toks) - 1, len(SPANS))
            oracle = attention_masses(paths[kind], ids + toks, len(ids), len(toks) - 1, SPANS, layers or cite_layers(2))
            assert np.abs(cited - oracle).max() < 1e-5, (kind, np.abs(cited - oracle).max())
            assert cited.sum() > 0.1 * cited.shape[0]  # the document's spans draw attention at all
            if drafts:  # the feature under test was on: drafts were verified, some kept and some not
                spec = rec["speculation"]
                assert spec["drafted"] > spec["accepted"] > 0, spec


# ---------------------------------------------------------------- attention steered onto one sentence

MAGIC = "Z"
DOC = (
    "the quiet valley held a small farm and an old mill by the river. "
    "every spring the water rose and the miller cleaned the wheel with care. "
    "the children of the farm walked to school along the high road each day. "
    "behind the mill stood a stone shed where the ZZZZ keys were kept. "
    "in winter the road was closed and the farm sent its letters by boat. "
    "the mill was sold in the end and the shed was pulled down for stone."
)
QUESTION = "where were the Z keys kept?"


def steered_model(out) -> str:
    """A tiny llama whose every query attends to the ``Z`` tokens: their embedding carries a
    channel nothing else writes (channel 0, kept out of every layer's output), which every
    layer's keys read into the slowest-rotating RoPE pair, and every query's bias meets there."""
    from transformers import AutoModelForCausalLM

    path = tiny_models.make_model(
        "llama", out, seed=11, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
    )
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = tiny_models_tokenizer(path)
    z = tok.convert_tokens_to_ids(MAGIC)
    hd = m.config.hidden_size // m.config.num_attention_heads
    with torch.no_grad():
        emb = m.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb[z, 0] = 30.0
        for layer in m.model.layers:
            at = layer.self_attn
            for proj, heads, value in (
                (at.q_proj, m.config.num_attention_heads, None),
                (at.k_proj, m.config.num_key_value_heads, 3.0),
            ):
                for h in range(heads):
                    for ch in (h * hd + hd // 2 - 1, h * hd + hd - 1):  # the slowest RoPE pair
                        proj.weight[ch] = 0.0
                        proj.bias[ch] = 3.0 if value is None else 0.0
                        if value is not None:
                            proj.weight[ch, 0] = value
            at.o_proj.weight[0] = 0.0
            if at.o_proj.bias is not None:
                at.o_proj.bias[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
    m.save_pretrained(path, safe_serialization=True)
    return str(path)


def tiny_models_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    root = tmp_path_factory.mktemp("steered")
    doc = root / "doc.txt"
    doc.write_bytes(f"{DOC}\n\n{QUESTION}".encode())
    return steered_model(root / "m"), doc


def test_citations_find_the_sentence_attention_is_steered_to(steered):
    """generate --cite --json on 1 and 3 ranks: the first citation is the sentence that holds the
    Z tokens (character offsets into the file, its text), with most of the attention; the
    question's own Z is not cited; the same spans and scores on both; the same tokens as
    without --cite."""
    model, doc = steered
    text = doc.read_text()
    want = text.index("behind the mill")
    recs = {}
    for n in (1, 3):
        r = cli(
            "generate",
            "--model",
            model,
            "--prompt-file",
            str(doc),
            "--no-chat",
            "--cite",
            "--json",
            "--nproc",
            str(n),
            "--max-new-tokens",
            "6",
            "--dtype",
            "float32",
            "--quiet",
        )
        assert r.exit_code == 0, r.stderr
        recs[n] = json.loads(r.stdout)
    plain = cli(
        "generate",
        "--model",
        model,
        "--prompt-file",
        str(doc),
        "--no-chat",
        "--json",
        "--nproc",
        "3",
        "--max-new-tokens",
        "6",
        "--dtype",
        "float32",
        "--quiet",
    )
    assert json.loads(plain.stdout)["token_ids"] == recs[3]["token_ids"]
    first = recs[1]["citations"][0]
    assert first["start"] == want and text[first["start"] : first["end"]] == first["text"]
    assert first["text"].startswith("behind the mill") and first["text"].endswith("were kept.")
    assert first["score"] > 0.5 and all(c["score"] < 0.1 for c in recs[1]["citations"][1:])
    assert all(c["end"] <= text.index(QUESTION) for c in recs[1]["citations"])  # the question is not cited
    assert [(c["start"], c["end"]) for c in recs[3]["citations"]] == [
        (c["start"], c["end"]) for c in recs[1]["citations"]
    ]
    assert abs(recs[3]["citations"][0]["score"] - first["score"]) < 1e-5
    assert recs[1]["sentence_citations"] and all(s["citation"]["start"] == want for s in recs[1]["sentence_citations"])


def test_chat_cites_each_answer_of_a_batch(steered, tmp_path):
    """chat --cite --batch 2 --json: every answer's record cites the steered sentence, in offsets
    of the document file."""
    model, doc = steered
    only = tmp_path / "doc.txt"
    only.write_text(DOC)
    qs = tmp_path / "q.txt"
    qs.write_text("where are the keys?\nwhat stood behind the mill?\nwho cleaned the wheel?\n")
    r = cli(
        "chat",
        "--model",
        model,
        "--prompt-file",
        str(only),
        "--questions",
        str(qs),
        "--no-chat",
        "--cite",
        "--json",
        "--batch",
        "2",
        "--nproc",
        "2",
        "--max-new-tokens",
        "4",
        "--dtype",
        "float32",
        "--quiet",
    )
    assert r.exit_code == 0, r.stderr
    recs = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    assert len(recs) == 3
    for rec in recs:
        assert rec["citations"][0]["start"] == DOC.index("behind the mill"), rec["citations"]


def test_sources_name_lines_and_quote_the_sentence(steered):
    """The terminal's Sources list: numbered, the line of the file, the quoted sentence."""
    from treeattn_cli.cli.sources import show

    text = "first line of nothing much\n" + DOC
    spans = C.DocumentSpans(text, [(27, 27 + 60)], [(4, 60)])
    out = io.StringIO()
    show(
        {
            "text": "the keys were in the shed",
            "citations": [{"start": 27, "end": 87, "score": 0.42, "text": text[27:87]}],
        },
        spans,
        file=out,
    )
    s = out.getvalue()
    assert s.startswith("Sources") and " 1. line 2 (42.0% of the attention): \u201cthe quiet valley" in s


# ---------------------------------------------------------------- placing text on tokens


def test_spans_are_sentences_and_short_ones_join_the_next():
    text = "Title\n\nA first sentence of some length here. Dr. Who came. Then a longer one follows it.\n\nEnd."
    got = [text[a:b] for a, b in C.split_spans(text)]
    assert got == [
        "Title",
        "A first sentence of some length here.",
        "Dr. Who came. Then a longer one follows it.",
        "End.",
    ]
    text = "A first sentence of some length here. Short end.\nNext line is long enough to stand alone. Ok."
    assert [text[a:b] for a, b in C.split_spans(text)] == [
        "A first sentence of some length here.",
        "Short end.\nNext line is long enough to stand alone. Ok.",
    ]
    assert C.split_spans("A first sentence of some length here. Short end.") == [(0, 48)]


def test_spans_sit_on_the_tokens_of_their_characters(steered):
    """Every span's positions are the tokens whose first character lies in it, under a byte
    tokenizer one per character: offsets into the text the user gave, sinks and the question left
    out."""
    model, _ = steered
    tok = tiny_models_tokenizer(model)
    text = f"{DOC}\n\n{QUESTION}"
    ids = tok(text)["input_ids"]
    spans = C.for_prompt(tok, text, ids, chat=False, system=None)
    assert spans.chars[0] == (0, DOC.index(".") + 1)
    assert spans.positions[0] == (4, DOC.index(".") + 1)  # the first 4 positions are sinks
    for (a, b), (s, e) in zip(spans.chars[1:], spans.positions[1:]):
        assert (s, e) == (a, b)  # one token per byte: positions are offsets
    assert spans.chars[-1][1] == len(DOC)


def test_spans_through_a_chat_template_sit_on_the_characters_of_the_text(steered, tmp_path):
    """With a chat template (generate's prompt, chat's document before a question), spans keep
    offsets into the text the user gave and sit on the template's tokens of those characters."""
    import shutil

    from treeattn_cli.cli.prompt import build_ids, document_ids

    model, _ = steered
    m = tmp_path / "m"
    shutil.copytree(model, m)
    cfg = json.loads((m / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (m / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = tiny_models_tokenizer(m)
    text = f"{DOC}\n\n{QUESTION}"
    ids = build_ids(tok, text, chat=True, system="Be brief.")
    at = "<|system|>Be brief.<|end|>\n<|user|>".__len__()  # one token per byte: positions are offsets
    spans = C.for_prompt(tok, text, ids, chat=True, system="Be brief.")
    doc_ids, comp = document_ids(tok, DOC, chat=True, system="Be brief.")
    again = C.for_document(tok, DOC, doc_ids, comp, system="Be brief.")
    for sp in (spans, again):
        assert sp.chars == C.split_spans(DOC)
        assert all((s, e) == (at + a, at + b) for (a, b), (s, e) in zip(sp.chars, sp.positions))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--prompt", "too short.\n\nwhat?"], "too short to cite"),
        (["--prompt", "x" * 40, "--load-kv", "/nonexistent"], "--cite needs the document's text"),
    ],
)
def test_bad_cite_input_is_one_line(steered, args, needle):
    model, _ = steered
    r = cli("generate", "--model", model, "--no-chat", "--cite", "--nproc", "1", *args)
    assert_usage_error(r, needle)


def test_the_gpu_path_cites_through_the_triton_kernels(tiny):
    """With ``TREEATTN_KERNEL=triton`` (the GPU's choice of kernels, interpreted here) on 2 ranks:
    a single answer and a batch over the engine's document run the dense split kernel with
    ``block_lse``, a batch over two documents in the block pool the paged one (both counted, so a
    path that fell back to ATen fails); the masses are transformers' attention weights."""
    llama = tiny("llama", seed=3, head_dim=64, num_hidden_layers=1)  # one layer: cite_layers(1) = [0]
    doc = [(13 * i + 5) % 230 + 20 for i in range(24)]
    other = doc[::-1][:20]
    q = [(29 * i + 11) % 230 + 20 for i in range(5)]
    spans = [[4, 10], [10, 18], [18, 24]]
    cite = {"spans": spans}
    new = 4
    common = {"max_new_tokens": new, "sampling": vars(Sampling()), "stop": [], "eos_ids": [], "speculate": "off"}
    job = EngineJob(str(llama), [], dtype="float32", max_new_tokens=new, reserve=64)
    dense = (
        job,
        [
            {"op": "append", "ids": doc},
            {"op": "mark", "name": "doc"},
            {"op": "append", "ids": q},
            {"op": "decode", "seq": 0, "keep": False, "cite": cite, **common},
            {"op": "rollback", "name": "doc"},
            {"op": "batch", "slots": 2, "questions": [{"ids": q, "cite": cite}, {"ids": q[:2]}], **common},
            {"op": "stop"},
        ],
    )
    paged = (
        job,
        [
            {
                "op": "batch",
                "slots": 2,
                "piece": 8,
                **common,
                "questions": [
                    {"ids": q, "doc": {"key": "a", "ids": doc}, "cite": cite},
                    {"ids": q[:3], "doc": {"key": "b", "ids": other}, "cite": {"spans": [[4, 20]]}},
                ],
            },
            {"op": "stop"},
        ],
    )
    for session, kernel, want in (
        (dense, "partial_attention_triton", [(doc + q, spans), (doc + q, spans), None]),
        (paged, "partial_attention_triton_paged", [(doc + q, spans), (other + q[:3], [[4, 20]])]),
    ):
        per_rank = run_local(triton_cite_sessions, 2, [session], kernel, timeout_s=600)
        answers = per_rank[0][0][0]
        assert all(n >= new - 1 for _, n in per_rank), per_rank  # the kernel ran on every rank
        for rec, w in zip(answers, want):
            if w is None:
                assert "cite" not in rec
                continue
            ids, sp = w
            toks = rec["token_ids"]
            assert toks == tiny_models.hf_greedy(llama, ids, new)
            oracle = attention_masses(llama, ids + toks, len(ids), len(toks) - 1, sp, [0])
            assert np.abs(np.asarray(rec["cite"]) - oracle).max() < 1e-5, kernel


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


def cite_sessions(ctx, sessions):
    """For each ``(job, requests)``: an engine on these ranks serving ``requests``; rank 0 returns,
    per session, every answer's record (``answer`` events, then ``banswer`` ones in question order)
    with its ``token_ids``, ``cite`` masses and ``speculation``."""
    from treeattn_cli.engine.engine import Engine

    out = []
    for job, requests in sessions:
        got, batch = [], {}

        def emit(kind, p, got=got, batch=batch):
            if kind == "answer":
                got.append(p)
            elif kind == "banswer":
                batch[p[0]] = p[1]

        real, ctx.emit = ctx.emit, emit
        try:
            Engine(ctx, job).serve(requests)
        finally:
            ctx.emit = real
        out.append(got + [batch[i] for i in sorted(batch)])
    return out if ctx.rank == 0 else None


def triton_cite_sessions(ctx, sessions, kernel):
    """:func:`cite_sessions` with ``TREEATTN_KERNEL=triton`` and ``partial_triton.<kernel>`` counted:
    rank 0 returns the sessions' answers, every rank how many times the kernel ran."""
    with triton_path(kernel) as calls:
        got = cite_sessions(ctx, sessions)
    return got, calls[0]
