"""``--cite`` measured (issue 37): planted-fact documents answered by the embedded model.

Run: ``python -m treeattn_cli.bench.cite`` (``--parts choose,accuracy,loo,cost,ranks``; ``--json
FILE`` keeps every number). Each case is a window of the shipped demo document's paragraphs
(~1.2K tokens) with one invented fact planted as a sentence at some depth, and a question only
that fact answers; the prompt is generate's (chat template, document, blank line, question).
Parts:

* ``choose``: one run with every layer's and head's masses kept apart (``detail="heads"``), then
  the share of right answers whose first citation contains the planted sentence, for each choice
  of layers, heads and normalisation (how ``engine/cite.py``'s choices were made);
* ``accuracy``: the same with the shipped choices, as ``generate --cite`` computes citations;
* ``loo``: the leave-one-out baseline with transformers: each paragraph dropped in turn, the drop
  in the answer's log-probability; its top paragraph against ours (forward passes and seconds);
* ``cost``: decode time per token with and without ``--cite``, alternated in one engine
  (medians, and the median ratio of the pairs), and peak memory of a whole run each way;
* ``ranks``: the same citations on 1, 2 and 3 ranks and with ``--tp 3`` (the embedded model's 3
  KV heads do not split 2 ways; tests/engine/test_cite.py checks ``--tp 2`` on a tiny model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ..cli import citations as C
from ..cli.prompt import DEMO_SYSTEM, build_ids
from ..model import load as M
from ..engine.job import EngineJob
from ..engine.sampling import Sampling
from ..parallel.launch import run_local
from ..paths import demo_document

# (sentence planted, a long form of it, question, what a right answer contains): facts the document
# does not hold. The long forms are as long as the document's own sentences (30-45 words), so that a
# normalisation that favours short sentences cannot pass for one that finds the source.
FACTS = [
    (
        "The access code for the north storeroom was 4817.",
        "After a long argument at the autumn meeting of the board, and a vote that was much closer than anyone had "
        "expected, the access code for the north storeroom was changed to 4817 and written in the back of the logbook.",
        "What was the access code for the north storeroom?",
        "4817",
    ),
    (
        "The observatory cat was named Pepper.",
        "A grey cat that arrived one winter from a farm in the valley and never left again was kept by the staff as "
        "the observatory cat, and the children of the village named her Pepper after the colour of her coat.",
        "What was the name of the observatory cat?",
        "Pepper",
    ),
    (
        "The spare eyepieces were kept in a blue tin box under the library stairs.",
        "Because the instrument cupboard was damp in every season, the spare eyepieces were kept in a blue tin box "
        "under the library stairs, wrapped in flannel and checked by the night assistant once a month.",
        "Where were the spare eyepieces kept?",
        "tin box",
    ),
    (
        "The night porter, Tor Vangsnes, always wore a green woollen scarf.",
        "The night porter, Tor Vangsnes, who had come to the ridge from a fishing village in the north and stayed for "
        "thirty years, always wore a green woollen scarf that his sister had knitted for him.",
        "What did the night porter always wear?",
        "scarf",
    ),
    (
        "The dome of the east telescope was painted yellow in 1958.",
        "When the old paint had finally peeled away after twenty winters of wind and ice, the dome of the east "
        "telescope was painted yellow in 1958, a choice the board approved without much enthusiasm.",
        "What colour was the dome of the east telescope painted in 1958?",
        "yellow",
    ),
    (
        "The library held exactly 312 books on optics.",
        "By the time the catalogue was finished, after two summers of work by a student from the university, the "
        "library held exactly 312 books on optics, most of them donated by retired members of the society.",
        "How many books on optics did the library hold?",
        "312",
    ),
    (
        "The cook's favourite dish was fish soup with dill.",
        "Meals on the ridge were simple and were mostly eaten standing in the kitchen, but everyone agreed that the "
        "cook's favourite dish was fish soup with dill, which she made every Friday for the whole staff.",
        "What was the cook's favourite dish?",
        "fish soup",
    ),
    (
        "The director rode a red Norton motorcycle up the ridge road.",
        "In the years before the road was paved and long before the observatory owned a car of its own, the director "
        "rode a red Norton motorcycle up the ridge road, even in rain, to the dismay of the board.",
        "What motorcycle did the director ride?",
        "Norton",
    ),
    (
        "The first visitor of 1950 had travelled from Trondheim.",
        "The visitors' book, which was kept on a table by the door and signed by almost everyone who came up the hill, "
        "shows that the first visitor of 1950 had travelled from Trondheim on foot and by boat.",
        "Where had the first visitor of 1950 travelled from?",
        "Trondheim",
    ),
    (
        "The observatory's radio call sign was LN7HR.",
        "The small transmitter that was installed in the radio room after the war, mainly to send weather reports to "
        "the coast and to talk to the ships, used the observatory's radio call sign, which was LN7HR.",
        "What was the observatory's radio call sign?",
        "LN7HR",
    ),
]
DEPTHS = (0.1, 0.5, 0.9)  # where in the window the fact's paragraph is
WINDOW_CHARS = 5200  # ~1.2K tokens of the demo document per case
NEW_TOKENS = 24


def paragraphs() -> list[str]:
    """The demo document's body paragraphs (its title, note and part headings left out)."""
    return [p for p in demo_document().split("\n\n") if len(p) > 300]


def cases(n: int | None = None) -> list[dict]:
    """Every (fact, depth) case: its document, question, expected text, and where the planted
    sentence is in the document (characters)."""
    paras = paragraphs()
    out = []
    for i, (short, long_, question, expect) in enumerate(FACTS):
        for j, depth in enumerate(DEPTHS):
            fact = long_ if (i + j) % 2 else short
            start = (3 * i + 7 * j) % len(paras)
            window, size = [], 0
            while size < WINDOW_CHARS:
                p = paras[(start + len(window)) % len(paras)]
                window.append(p)
                size += len(p) + 2
            k = min(len(window) - 1, int(depth * len(window)))
            sents = window[k].split(". ")
            at = max(1, len(sents) // 2)  # in the middle of its paragraph
            window[k] = ". ".join(sents[:at]) + ". " + fact + " " + ". ".join(sents[at:])
            doc = "\n\n".join(window)
            a = doc.index(fact)
            out.append(
                {
                    "doc": doc,
                    "question": question,
                    "expect": expect,
                    "fact": (a, a + len(fact)),
                    "paragraph": k,
                    "depth": depth,
                    "long": fact is long_,
                }
            )
    return out[:n] if n else out


def prompt_of(case: dict) -> str:
    return f"{case['doc']}\n\n{case['question']}"


def rank_answers(ctx, job, items):
    """Every rank: an engine that answers ``items`` (``(ids, cite spec or None)``) one after
    another from an empty cache; rank 0 returns each answer's record."""
    from ..engine.engine import Engine

    got = []
    real, ctx.emit = ctx.emit, (lambda kind, p: got.append(p) if kind == "answer" else None)
    reqs = [{"op": "mark", "name": "empty"}]
    for ids, cite in items:
        reqs += [
            {"op": "append", "ids": ids},
            {
                "op": "decode",
                "seq": 0,
                "max_new_tokens": job.max_new_tokens,
                "sampling": vars(Sampling()),
                "stop": [],
                "eos_ids": job.eos_ids,
                "keep": False,
                "speculate": job.speculate,
                "cite": cite,
            },
            {"op": "rollback", "name": "empty"},
        ]
    try:
        Engine(ctx, job).serve(reqs + [{"op": "stop"}])
    finally:
        ctx.emit = real
    return got if ctx.rank == 0 else None


def answer_all(model_dir, tok, cs, *, nproc=1, tp=1, detail="sum", layers=None, speculate="off", cite=True):
    """Each case answered greedily (``generate``'s prompt): records with ``text``, ``token_ids``,
    ``right`` and, with ``cite``, ``spans`` and ``masses``."""
    from ..cli.prepare import _eos_ids

    items, spans_of = [], []
    for c in cs:
        text = prompt_of(c)
        ids = build_ids(tok, text, chat=True, system=DEMO_SYSTEM)
        spans = C.for_prompt(tok, text, ids, chat=True, system=DEMO_SYSTEM)
        spans_of.append(spans)
        items.append((ids, spans.spec(layers=layers, detail=detail) if cite else None))
    eos = _eos_ids(model_dir, M.load_config(model_dir), tok)
    job = EngineJob(
        str(model_dir),
        [],
        max_new_tokens=NEW_TOKENS,
        dtype="float32",
        tp=tp,
        speculate=speculate,
        eos_ids=eos,
        reserve=max(len(i) for i, _ in items) + NEW_TOKENS + 8,
    )
    recs = run_local(rank_answers, nproc, job, items, timeout_s=3600)[0]
    out = []
    for c, spans, r in zip(cs, spans_of, recs):
        text = tok.decode(r["token_ids"], skip_special_tokens=True)
        out.append(
            {
                "text": text,
                "token_ids": r["token_ids"],
                "right": c["expect"].lower() in text.lower(),
                "spans": spans,
                "masses": r.get("cite"),
                "decode_tokens_per_s": r.get("decode_tokens_per_s"),
                "new_tokens": r.get("new_tokens"),
            }
        )
    return out


def rank_of(spans, scores, fact) -> int:
    """The planted sentence's place among the spans by score (1: first)."""
    s = next(i for i, (a, b) in enumerate(spans.chars) if a <= fact[0] and fact[1] <= b)
    return 1 + int((scores > scores[s]).sum())


def hit(spans, scores, fact) -> bool:
    """Whether the best-scored span contains the planted sentence."""
    return rank_of(spans, scores, fact) == 1


def first_hit(case, rec, masses=None) -> bool:
    """The shipped choice: ``citations()``'s first citation contains the planted sentence."""
    got = C.citations(rec["spans"], rec["masses"] if masses is None else masses, _TOK[0], rec["token_ids"])
    c = got["citations"][0] if got["citations"] else None
    return c is not None and c["start"] <= case["fact"][0] and case["fact"][1] <= c["end"]


_TOK: list = []


NORMS = {
    "mean share": lambda m, n: m.mean(0),
    "share / tokens": lambda m, n: m.mean(0) / n,
    "share / sqrt(tokens)": lambda m, n: m.mean(0) / np.sqrt(n),
}


def choose(cs, recs) -> list[dict]:
    """Accuracy of every (layers, heads, normalisation) choice on the right answers, from masses
    kept per layer and head (``[layers, heads, rows, S]``)."""
    right = [(c, r) for c, r in zip(cs, recs) if r["right"] and r["masses"] is not None and r["masses"].shape[2]]
    if not right:
        return []
    L, H = right[0][1]["masses"].shape[:2]
    layer_sets = {
        "all layers": range(L),
        "lower half": range(L // 2),
        "upper half": range(L // 2, L),
        "upper third": range(L - L // 3, L),
        "middle third": range(L // 3, L - L // 3),
        "last 4": range(L - 4, L),
    }
    for x in range(L):
        layer_sets[f"layer {x}"] = [x]
    rows = []
    for lname, ls in layer_sets.items():
        for nname, norm in NORMS.items():
            if lname.startswith("layer ") and nname != "mean share":
                continue
            ranks = []
            for c, r in right:
                m = r["masses"][list(ls)].sum((0, 1))  # [rows, S]
                n = np.array([b - a for a, b in r["spans"].positions], dtype=np.float64)
                ranks.append(rank_of(r["spans"], norm(m, n), c["fact"]))
            ok = sum(x == 1 for x in ranks)
            long_ok = sum(x == 1 for x, (c, _) in zip(ranks, right) if c["long"])
            rows.append(
                {
                    "layers": lname,
                    "heads": "all",
                    "norm": nname,
                    "right": len(right),
                    "hits": ok,
                    "accuracy": ok / len(right),
                    "mrr": float(np.mean([1 / x for x in ranks])),
                    "long_right": sum(c["long"] for c, _ in right),
                    "long_hits": long_ok,
                }
            )
    # heads of the chosen layers, one at a time (how much a choice of heads could add)
    up = list(range(L // 2, L))
    for h in range(H):
        ok = sum(hit(r["spans"], r["masses"][up][:, h].sum(0).mean(0), c["fact"]) for c, r in right)
        rows.append(
            {
                "layers": "upper half",
                "heads": f"head {h}",
                "norm": "mean share",
                "right": len(right),
                "hits": ok,
                "accuracy": ok / len(right),
            }
        )
    return rows


def loo(model_dir, tok, cs, recs) -> dict:
    """Leave-one-out over paragraphs with transformers (eager fp32, one process): for each right
    answer, the paragraph whose removal lowers the answer's log-probability most."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logp(doc, question, answer_ids):
        ids = build_ids(tok, f"{doc}\n\n{question}", chat=True, system=DEMO_SYSTEM)
        x = torch.tensor([ids + answer_ids])
        with torch.inference_mode():
            lp = torch.log_softmax(m(x).logits[0, len(ids) - 1 : -1].float(), -1)
        return float(lp.gather(1, torch.tensor(answer_ids)[:, None]).sum())

    hits = ours_para = n = passes = 0
    t0 = time.perf_counter()
    for c, r in zip(cs, recs):
        if not r["right"]:
            continue
        n += 1
        paras = c["doc"].split("\n\n")
        full = logp(c["doc"], c["question"], r["token_ids"])
        drops = [
            full - logp("\n\n".join(paras[:i] + paras[i + 1 :]), c["question"], r["token_ids"])
            for i in range(len(paras))
        ]
        passes += 1 + len(paras)
        hits += int(np.argmax(drops)) == c["paragraph"]
        got = C.citations(r["spans"], r["masses"], tok, r["token_ids"])["citations"]
        if got:
            start = got[0]["start"]
            ours_para += c["doc"].count("\n\n", 0, start) == c["paragraph"]
    secs = time.perf_counter() - t0
    return {
        "right": n,
        "loo_hits": hits,
        "loo_accuracy": hits / n if n else None,
        "ours_paragraph_hits": ours_para,
        "ours_paragraph_accuracy": ours_para / n if n else None,
        "forward_passes": passes,
        "passes_per_answer": passes / n if n else None,
        "seconds": secs,
        "seconds_per_answer": secs / n if n else None,
    }


def rank_alternate(ctx, job, ids, spec, pairs):
    """Every rank: the prompt prefilled once, then ``pairs`` answers without and with ``--cite``
    alternately, each from the prompt's cache; rank 0 returns each answer's decode ms per token."""
    from ..engine.engine import Engine

    got = []
    real, ctx.emit = (
        ctx.emit,
        (lambda kind, p: got.append(1e3 / p["decode_tokens_per_s"]) if kind == "answer" else None),
    )
    reqs = [{"op": "append", "ids": ids}, {"op": "mark", "name": "doc"}]
    for _ in range(pairs):
        for cite in (None, spec):
            reqs += [
                {
                    "op": "decode",
                    "seq": 0,
                    "max_new_tokens": job.max_new_tokens,
                    "sampling": vars(Sampling()),
                    "stop": [],
                    "eos_ids": [],
                    "keep": False,
                    "speculate": "off",
                    "cite": cite,
                },
                {"op": "rollback", "name": "doc"},
            ]
    try:
        Engine(ctx, job).serve(reqs + [{"op": "stop"}])
    finally:
        ctx.emit = real
    return got if ctx.rank == 0 else None


def cost(model_dir, tok, pairs: int = 8, nproc: int = 2, device: str = "cpu") -> dict:
    """Decode ms per token of the demo's prompt without and with ``--cite`` (``--speculate off``,
    48 tokens an answer), alternated in one engine (ranks started once, the prompt prefilled
    once), medians and the median ratio of each pair; peak memory of whole runs each way."""
    from ..cli.prompt import demo_prompt
    from ..engine.engine import rank_generate

    text, system = demo_prompt()
    ids = build_ids(tok, text, chat=True, system=system)
    spans = C.for_prompt(tok, text, ids, chat=True, system=system)
    gpu = device == "cuda"
    where = dict(backend="nccl" if gpu else "gloo", devices=[f"cuda:{r}" if gpu else "cpu" for r in range(nproc)])
    dtype = "bfloat16" if gpu else "float32"
    job = EngineJob(str(model_dir), [], max_new_tokens=48, dtype=dtype, speculate="off", reserve=len(ids) + 64)
    ms = run_local(rank_alternate, nproc, job, ids, spans.spec(), pairs, timeout_s=3600, **where)[0]
    off, on = ms[0::2], ms[1::2]
    rss = {}
    for mode in ("off", "on"):
        job = EngineJob(
            str(model_dir),
            ids,
            max_new_tokens=48,
            dtype=dtype,
            speculate="off",
            cite=spans.spec() if mode == "on" else None,
        )
        rec = run_local(rank_generate, nproc, job, timeout_s=1200, **where)[0]
        rss[mode] = max(rec.get("peak_device_bytes") or rec["peak_rss_bytes"])
    return {
        "prompt_tokens": len(ids),
        "spans": len(spans.chars),
        "nproc": nproc,
        "pairs": pairs,
        "device": device,
        "ms_per_token_off": statistics.median(off),
        "ms_per_token_on": statistics.median(on),
        "overhead": statistics.median([b / a - 1 for a, b in zip(off, on)]),
        "peak_rss_off": rss["off"],
        "peak_rss_on": rss["on"],
        "samples": {"off": off, "on": on},
    }


def ranks(model_dir, tok, cs) -> list[dict]:
    """The same cases' citations on 1, 2, 3 ranks and tp 3 x cp 1 (the embedded model's 3 KV heads
    do not split 2 ways): spans and scores."""
    rows, base = [], None
    for nproc, tp in ((1, 1), (2, 1), (3, 1), (3, 3)):
        recs = answer_all(model_dir, tok, cs, nproc=nproc, tp=tp)
        got = [C.citations(r["spans"], r["masses"], tok, r["token_ids"]) for r in recs]
        key = [[(x["start"], x["end"]) for x in g["citations"]] for g in got]
        scores = np.array([[x["score"] for x in g["citations"]] for g in got], dtype=object)
        tokens = [r["token_ids"] for r in recs]
        if base is None:
            base = (key, scores, tokens)
        diff = max((abs(a - b) for s1, s0 in zip(scores, base[1]) for a, b in zip(s1, s0)), default=0.0)
        rows.append(
            {
                "nproc": nproc,
                "tp": tp,
                "same_spans": key == base[0],
                "same_tokens": tokens == base[2],
                "max_score_diff": diff,
            }
        )
    return rows


def main(argv=None):
    import os
    import platform

    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="choose,accuracy,loo,cost,ranks")
    ap.add_argument("--cases", type=int, default=None, help="only the first N cases")
    ap.add_argument("--nproc", type=int, default=2, help="ranks for choose/accuracy/cost")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cost: where the ranks run (cuda: one GPU a rank, NCCL, bf16; peak device memory)",
    )
    ap.add_argument("--json", default=None, help="write every number to this file")
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))
    model_dir = M.resolve(None)
    tok = M.load_tokenizer(model_dir)
    _TOK.append(tok)
    cs = cases(a.cases)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU ranks (gloo), "
        "embedded SmolLM2-135M-Instruct in fp32",
        "cases": len(cs),
    }
    recs = None
    if "choose" in parts:
        t0 = time.perf_counter()
        recs = answer_all(
            model_dir,
            tok,
            cs,
            nproc=a.nproc,
            detail="heads",
            layers=list(range(M.shapes(M.load_config(model_dir))["num_layers"])),
        )
        report["answer_seconds"] = time.perf_counter() - t0
        report["right_answers"] = sum(r["right"] for r in recs)
        report["answers"] = [
            {"question": c["question"], "answer": r["text"], "right": r["right"]} for c, r in zip(cs, recs)
        ]
        print(f"{report['right_answers']} of {len(cs)} answers right", flush=True)
    if "choose" in parts:
        report["choose"] = choose(cs, recs)
        for row in report["choose"]:
            if not row["layers"].startswith("layer ") and row["heads"] == "all":
                print(
                    f"{row['layers']:>14} {row['norm']:>22}: {row['hits']}/{row['right']} = {row['accuracy']:.0%}, "
                    f"long {row['long_hits']}/{row['long_right']}, MRR {row['mrr']:.3f}"
                )
        singles = [r for r in report["choose"] if r["layers"].startswith("layer ")]
        heads = [r for r in report["choose"] if r["heads"] != "all"]
        print("single layers:", " ".join(f"{r['layers'][6:]}:{r['hits']}" for r in singles))
        print("single heads (upper half):", " ".join(f"{r['heads'][5:]}:{r['hits']}" for r in heads), flush=True)
    if "accuracy" in parts:
        shipped = answer_all(model_dir, tok, cs, nproc=a.nproc)
        right = [(c, r) for c, r in zip(cs, shipped) if r["right"]]
        ok = sum(first_hit(c, r) for c, r in right)
        report["accuracy"] = {
            "right": len(right),
            "first_citation_hits": ok,
            "accuracy": ok / len(right) if right else None,
            "layers": "upper half (engine/cite.py)",
        }
        print(
            f"shipped choice: the first citation holds the planted sentence in {ok}/{len(right)} right answers",
            flush=True,
        )
        recs = recs or shipped
    if "loo" in parts:
        shipped_recs = answer_all(model_dir, tok, cs, nproc=1)
        report["loo"] = loo(model_dir, tok, cs, shipped_recs)
        print("leave-one-out:", json.dumps(report["loo"]), flush=True)
    if "cost" in parts:
        report["cost"] = cost(model_dir, tok, nproc=a.nproc, device=a.device)
        c = report["cost"]
        print(
            f"cost: {c['ms_per_token_off']:.1f} -> {c['ms_per_token_on']:.1f} ms/token (median pair "
            f"{c['overhead']:+.1%}), peak memory {c['peak_rss_off'] / 2**20:.0f} -> {c['peak_rss_on'] / 2**20:.0f} MiB",
            flush=True,
        )
    if "ranks" in parts:
        report["ranks"] = ranks(model_dir, tok, cs[:6])
        for row in report["ranks"]:
            print("ranks:", json.dumps(row), flush=True)
    if a.json:

        def plain(x):
            if isinstance(x, np.ndarray):
                return None
            return str(x)

        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=plain)


if __name__ == "__main__":
    main()
