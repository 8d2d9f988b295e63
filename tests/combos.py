"""The combination test (issue 32): configurations drawn from a seed over every dimension that
changes how a decode step is computed, and the rank function that runs them.

Exactness broke where features met (a slot refilled while another slot's drafts were cut
back), never inside one feature's own tests. So each configuration combines them at random —
ranks, --tp, merge scheme, fp8 KV, chat --batch with more questions than slots, the server's
open batch (questions joining it, cancelled, a document asked for again or loaded from disk),
questions over several documents in the same steps (new documents prefilled a segment at a time
while the others decode, documents evicted to disk and loaded back, one shorter than the shards),
--conversation, --speculate off|auto|ngram:K over questions that copy the document and ones
that do not, questions shorter than the sequence shards, chunked prefill (of documents, and of long questions
between the other answers' steps), a saved cache
reloaded on another number of ranks, seeded sampling, and model families with sliding
windows, soft-capping and sinks — and every answer is checked against **the same request
alone** (one question after the document, one at a time, no drafts; sampling with the same
seed), token for token and logprob for logprob, and, greedy with an unrounded cache, against
transformers' greedy ``generate``.

A new feature joins by adding a function to :data:`DIMENSIONS` (it draws the feature's value
into the :class:`Config`) and, if it changes the requests, a branch in :func:`requests_of`:
not a new test file.

Re-run one case (a failure prints this line):   python tools/combos.py --seed S  (the command line: tools/combos.py)
The long run:                                   python tools/combos.py --seeds 500 [--first N]
"""

from __future__ import annotations

import json
import random
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from treeattn_cli.storage.host_tier import RESTORE_BYTES_PER_ROUND as RESTORE_DEFAULT

FAMILIES = {"llama": 3, "gemma2": 4, "gpt_oss": 5}  # plain GQA; window + soft-capping; sinks + windows
ORDER = [(3, 1), (1, 1), (2, 1), (2, 2)]  # (cp, tp) rank sets, in the order they run (saves come first)
LOGPROBS = 3  # alternatives compared per token
# An answer is compared with the same request alone bit for bit (issue 49): the digest of the logits
# each token was chosen from, its logprobs, its tokens. Citation masses, a measurement beside the
# answer (their per-key scores come from another pass over the keys), to fp32 round-off.
GAP_CITE = 1e-4


@dataclass
class Config:
    """One combination. Every field is drawn by a function of :data:`DIMENSIONS`."""

    seed: int
    family: str = "llama"
    cp: int = 1
    tp: int = 1
    scheme: str = "allreduce"
    kv: str = "auto"  # or fp8
    route: str = "batch"  # batch (chat --batch) | serve (open batch) | sequential (chat --batch 1) | conversation
    doc_len: int = 0  # tokens of the family's document used
    chunk: int | None = None  # --prefill-chunk of the document's prefill
    reload_cp: int | None = None  # the document's cache saved on this many ranks, then loaded here
    questions: list = field(default_factory=list)  # {"ids", "kind", "speculate"}
    slots: int = 1
    speculate: str = "off"
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0})
    new: int = 6
    joins: list = field(default_factory=list)  # serve: [after k streamed tokens, question index] joining late
    cancels: list = field(default_factory=list)  # serve: [after k streamed tokens, question index] cancelled
    again: bool = False  # serve: a second batch over the same document (now in memory), after another document
    docs: list = field(default_factory=list)  # mixed: [start, length] of each document in the family's; q["doc"]
    budget: int | None = None  # mixed: bytes of resident documents per rank (tiny: evicted to disk, loaded back)
    tight: bool = False  # mixed: the block pool holds the largest document alone (the others wait their turn)
    host: bool = True  # mixed with a budget: documents that leave memory keep a copy in the host tier (else: disk)
    restore_parts: bool = False  # host: a copy comes back a layer per round of the step loop (else: at once)
    page: int | None = None  # mixed: tokens per block of the pool (16: tiny documents fill blocks, share prefixes)
    qchunk: int | None = None  # batch, serve: question tokens prefilled per round (the batch's piece; mixed: chunk)
    graphs: bool = False  # steps replayed from (stand-in) CUDA graphs, over the GPU's kernels (graph_standin)
    cold: bool = False  # mixed, alike, asked again: as after a restart, only the longest document's saved copy left

    @property
    def world(self) -> int:
        return self.cp * self.tp

    @property
    def greedy(self) -> bool:
        return self.sampling["temperature"] == 0

    def save_key(self) -> str:
        return f"{self.family}-{self.kv}-{self.doc_len}-cp{self.reload_cp}"

    def line(self) -> str:
        """The configuration in one line (what a failure prints)."""
        qs = ",".join(
            f"{q['kind']}{len(q['ids'])}"
            + (f"/{q['speculate']}" if q.get("speculate") else "")
            + (f"/d{q['doc']}" if "doc" in q else "")
            + ("/cite" if q.get("cite") else "")
            + (f"/new{q['new']}" if "new" in q else "")
            for q in self.questions
        )
        extra = [
            f"chunk={self.chunk}" if self.chunk else "",
            f"reload<-cp{self.reload_cp}" if self.reload_cp else "",
            f"joins={self.joins}" if self.joins else "",
            f"cancels={self.cancels}" if self.cancels else "",
            "again" if self.again else "",
            "cold" if self.cold else "",
            f"docs={self.docs}" if self.docs else "",
            f"budget={self.budget}" if self.budget is not None else "",
            "" if self.budget is None else "host" if self.host else "no-host",
            "tight" if self.tight else "",
            f"page={self.page}" if self.page else "",
            f"qchunk={self.qchunk}" if self.qchunk else "",
            "graphs" if self.graphs else "",
            ""
            if self.greedy
            else f"T={self.sampling['temperature']},k={self.sampling['top_k']},seed={self.sampling['seed']}",
        ]
        return (
            f"seed={self.seed} {self.family} cp={self.cp} tp={self.tp} {self.scheme} kv={self.kv} "
            f"{self.route} slots={self.slots} spec={self.speculate} new={self.new} doc={self.doc_len} "
            f"q=[{qs}] " + " ".join(x for x in extra if x)
        ).strip()


# ---------------------------------------------------------------- the dimensions


def d_family(rng, c, fx):
    c.family = rng.choice(["llama", "llama", "gemma2", "gpt_oss"])


def d_mesh(rng, c, fx):
    meshes = [m for m in ORDER if not (c.family == "gpt_oss" and m[1] > 1)]  # sinks under tp: family tests
    c.cp, c.tp = rng.choice(meshes)


def d_scheme(rng, c, fx):
    c.scheme = rng.choice(["allreduce", "tree", "allgather"]) if c.cp > 1 else "allreduce"


def d_kv(rng, c, fx):
    c.kv = "fp8" if rng.random() < 0.3 else "auto"


def d_route(rng, c, fx):
    c.route = rng.choices(["batch", "serve", "conversation", "sequential"], [4, 3, 2, 1])[0]


def d_document(rng, c, fx):
    doc = fx[c.family]["doc"]
    c.doc_len = rng.choice([len(doc), len(doc), len(doc) - rng.randint(1, 30)])
    c.chunk = rng.choice([None, None, rng.randint(2, 9)])


def d_questions(rng, c, fx):
    """Questions that copy the document (drafts get accepted), that do not (drafts get
    rejected), and ones shorter than the sequence shards."""
    f = fx[c.family]
    doc = f["doc"][: c.doc_len]
    n = rng.randint(2, 6 if c.route == "serve" else 5)
    qs = []
    for _ in range(n):
        kind = rng.choices(["copy", "fresh", "short"], [5, 3, 2])[0]
        if kind == "copy":  # the start of a passage the document continues
            a = rng.randrange(0, max(1, len(f["start"]) - 3))
            ids = f["start"][a:]
        elif kind == "fresh":
            ids = [rng.randrange(20, 250) for _ in range(rng.randint(2, 12))]
        else:
            ids = [rng.randrange(20, 250) for _ in range(rng.randint(1, max(1, c.cp - 1)))]
        qs.append({"ids": ids, "kind": kind})
    assert doc
    c.questions = qs


def d_slots(rng, c, fx):
    n = len(c.questions)
    c.slots = rng.randint(1, min(3, n - 1)) if c.route in ("batch", "serve") else 1


def d_speculate(rng, c, fx):
    def one():
        return rng.choice(["off", "auto", f"ngram:{rng.randint(1, 6)}", f"ngram:{rng.randint(1, 6)}"])

    c.speculate = one()
    if c.route == "serve":  # each request brings its own
        for q in c.questions:
            q["speculate"] = one()


def d_sampling(rng, c, fx):
    if rng.random() < 0.25:
        c.sampling = {
            "temperature": rng.choice([0.7, 1.0]),
            "top_k": rng.choice([0, 20]),
            "top_p": 1.0,
            "seed": rng.randrange(1000),
        }


def d_new(rng, c, fx):
    """Answer lengths: one for all, or (a batch's questions, the server's requests) each its
    own, so answers end at different steps and slots refill while others are drafting."""
    c.new = rng.randint(3, 10)
    if c.route in ("batch", "serve") and rng.random() < 0.5:
        for q in c.questions:
            q["new"] = rng.randint(2, 12)


def new_of(c: Config, i: int) -> int:
    return c.questions[i].get("new", c.new)


def d_reload(rng, c, fx):
    earlier = [cp for cp, tp in ORDER[: ORDER.index((c.cp, c.tp))] if tp == 1 and cp != c.cp]
    if earlier and c.route != "conversation" and rng.random() < 0.25:
        c.reload_cp = rng.choice(earlier)


def d_serve(rng, c, fx):
    """The server's differences from chat: late questions join the running batch, a client
    cancels, a document is asked for again once another one was served."""
    if c.route != "serve":
        return
    n = len(c.questions)
    late = [i for i in range(1, n) if rng.random() < 0.4]
    c.joins = [[rng.randint(1, c.new), i] for i in late]
    if rng.random() < 0.4:
        c.cancels = [[rng.randint(1, c.new), rng.randrange(n)]]
    c.again = rng.random() < 0.3


def d_mixed(rng, c, fx):
    """Half the server's configurations ask about several documents at once: one open batch,
    each question over its own document (a new one is prefilled a segment per step while the
    others decode); sometimes the documents leave memory at once (a budget of one byte), saved
    to disk and loaded back when asked again (or found in the pool's cached blocks); sometimes the
    block pool holds only the largest document, so a document waits for blocks until the
    questions over another one end; sometimes blocks are small enough for the tiny documents to
    fill, and the documents begin alike, so later ones take the earlier ones' blocks. Drawn last, so the other dimensions draw what
    they drew before it existed (the regression seeds keep their configurations)."""
    if c.route != "serve" or rng.random() < 0.5:
        return
    c.route, c.reload_cp = "mixed", None
    full = len(fx[c.family]["doc"])
    c.docs = [[5 * k, full - 5 * k - rng.randint(0, 10)] for k in range(rng.randint(2, 3))]
    for q in c.questions:
        q["doc"] = rng.randrange(len(c.docs))
    if rng.random() < 0.3:
        c.budget = 1
    c.tight = rng.random() < 0.3
    if rng.random() < 0.5:  # blocks tiny documents fill: full blocks carry keys, later documents reuse them
        c.page = 16
        if rng.random() < 0.6:  # documents that begin alike: a later one takes the earlier one's blocks
            c.docs = [[0, n] for _, n in c.docs]


def doc_of(c: Config, fx: dict, i: int) -> list:
    """The document question ``i`` continues."""
    doc = fx[c.family]["doc"]
    if c.docs:
        start, n = c.docs[c.questions[i]["doc"]]
        return doc[start : start + n]
    return doc[: c.doc_len]


def d_qchunk(rng, c, fx):
    """Long questions prefilled a chunk per round between the other answers' steps (the batch's
    ``piece``). Drawn last, so the configurations drawn before it stay what they were."""
    if c.route in ("batch", "serve") and rng.random() < 0.4:
        c.qchunk = rng.randint(2, 12)


def d_cite(rng, c, fx):
    """``--cite``: some answers measure their rows' attention over spans of their document (a
    few random ranges of its positions; the upper layer, or both), compared with the same request
    alone (the single sequence's step and verify) as the tokens are. Drawn last, so the
    configurations drawn before it stay what they were."""
    if rng.random() >= 0.35:
        return
    layers = rng.choice([None, [0, 1]])
    for i, q in enumerate(c.questions):
        if rng.random() < 0.7:
            n = len(doc_of(c, fx, i))
            cuts = sorted(rng.sample(range(4, n + 1), min(n - 3, 2 * rng.randint(1, 3))))
            spans = [[a, b] for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
            if spans:
                q["cite"] = {"spans": spans, "layers": layers}


def d_graphs(rng, c, fx):
    """Steps replayed from CUDA graphs as on a GPU (issue 38): a batch's plain steps and verifies
    captured and replayed by ``graph_standin`` (each replay checked to issue
    what its capture recorded), over a fixed-shape cache and the GPU's kernels (Triton,
    interpreted); the same requests alone run eagerly over the same kernels (issue 49: the
    bits are the kernels'). Drawn last, so the
    configurations drawn before it stay what they were."""
    c.graphs = rng.random() < 0.08  # (slow: interpreted kernels; CI draws four, and a coverage seed)


def d_short(rng, c, fx):
    """Mixed documents: one more, shorter than the sequence shards (every rank computes its
    tokens, each kept where the fewest are; in the block pool like any other: issue 35 item 2),
    and one more question, over it (a copy of a drawn one, uncited: spans belong to their
    document). Drawn last, and only adding, so what was drawn before stays as it was."""
    if c.route == "mixed" and c.cp > 1 and rng.random() < 0.35:
        c.docs.append([5 * len(c.docs), rng.randint(1, c.cp - 1)])
        q = {k: v for k, v in rng.choice(c.questions).items() if k != "cite"}
        c.questions.append({**q, "doc": len(c.docs) - 1})


def d_host(rng, c, fx):
    """Documents that leave memory at once (a budget) keep a copy in the host tier and come back
    from it (issue 52), or, without a tier (``--host-memory 0``), from their saved copy on disk.
    Drawn last, so what was drawn before stays as it was."""
    if c.budget is not None:
        c.host = rng.random() < 0.5
        c.restore_parts = c.host and rng.random() < 0.5


def d_cold(rng, c, fx):
    """Documents that begin alike asked again as after a restart: nothing in memory, no cached
    block, no host copy, and only the longest document's saved copy in the cache directory (the
    others deleted), so each shorter one loads its first segments from that copy and prefills
    the rest (issue 52: a prefix found on disk by its blocks' chained keys). Drawn last, and only
    adding (a budget without a host tier, asked again), so what was drawn before stays as it was."""
    if c.route == "mixed" and c.docs and all(s == 0 for s, _ in c.docs) and rng.random() < 0.5:
        c.cold, c.again, c.budget, c.host, c.restore_parts = True, True, 1, False, False
        c.chunk = c.chunk or rng.randint(3, 8)  # (segments shorter than the documents: prefixes to share)


DIMENSIONS = [
    d_family,
    d_mesh,
    d_scheme,
    d_kv,
    d_route,
    d_document,
    d_questions,
    d_slots,
    d_speculate,
    d_sampling,
    d_new,
    d_reload,
    d_serve,
    d_mixed,
    d_qchunk,
    d_cite,
    d_graphs,
    d_short,
    d_host,
    d_cold,
]


def draw(seed: int, fx: dict) -> Config:
    rng = random.Random(seed)
    c = Config(seed)
    for dim in DIMENSIONS:
        dim(rng, c, fx)
    return c


# ---------------------------------------------------------------- fixtures (parent process)


def fixtures(root: Path) -> dict:
    """Tiny models of each family under ``root`` and, per family, a document that holds two
    copies of a passage (the model's own greedy continuation of ``start``), so that questions
    beginning like it get drafts that are accepted."""
    from treeattn_cli.verify import tiny as tiny_models

    root.mkdir(parents=True, exist_ok=True)
    saved = root / "fixtures.json"
    if saved.exists():
        return json.loads(saved.read_text())
    out = {}
    for kind, seed in FAMILIES.items():
        m = root / kind
        if not (m / "config.json").exists():
            tiny_models.make_model(kind, m, seed=seed)
        start = [(13 * i + 5 + seed) % 230 + 20 for i in range(12)]
        cont = tiny_models.hf_greedy(m, start, 24)
        filler = [(7 * i + 3 * seed) % 200 + 30 for i in range(20)]
        out[kind] = {"model": str(m), "start": start, "doc": filler + start + cont + filler[::-1] + start + cont}
    saved.write_text(json.dumps(out))
    return out


class Oracle:
    """transformers' greedy decode (eager attention), models loaded once per family."""

    def __init__(self, fx: dict):
        self.fx, self.models, self.memo = fx, {}, {}

    def greedy(self, family: str, ids: list, new: int) -> list:
        import torch
        from transformers import AutoModelForCausalLM

        key = (family, tuple(ids), new)
        if key not in self.memo:
            if family not in self.models:
                self.models[family] = AutoModelForCausalLM.from_pretrained(
                    self.fx[family]["model"], dtype=torch.float32, attn_implementation="eager"
                )
            x = torch.tensor([ids])
            out = self.models[family].generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new,
                do_sample=False,
                min_new_tokens=new,
                pad_token_id=0,
            )
            self.memo[key] = out[0, len(ids) :].tolist()
        return self.memo[key]


# ---------------------------------------------------------------- on the ranks


def requests_of(c: Config, fx: dict, save_root: str, alone: bool = False) -> list:
    """The engine requests of the configuration under test (after the document is in place);
    ``alone``: each question by itself on the same path (see :func:`alone_requests`)."""
    q_common = {
        "max_new_tokens": c.new,
        "sampling": c.sampling,
        "stop": [],
        "eos_ids": [],
        "logprobs": LOGPROBS,
        "digest": True,
    }
    if c.route in ("batch", "sequential", "conversation"):  # as chat asks: the document in the ranks'
        doc = fx[c.family]["doc"][: c.doc_len]  # pool, named by every question (--batch S at a time)
        spec = {"key": f"chat-{c.seed}", "ids": doc, "piece": c.chunk or -(-len(doc) // c.cp)}
        if c.reload_cp:
            d = Path(save_root) / c.save_key()
            spec.update(load_from=str(d), manifest=json.loads((d / "manifest.json").read_text()))
        qs = [
            {"ids": q["ids"], "max_new_tokens": new_of(c, i), "cite": q.get("cite"), "doc": spec}
            for i, q in enumerate(c.questions)
        ]
        common = {
            "speculate": alone_speculate(c, {}) if alone else c.speculate,
            **q_common,
            "pool_for": len(doc),
            **({"piece": c.qchunk} if c.qchunk else {}),
        }
        if c.route == "conversation":  # --conversation: each question and its answer join the document
            return [{"op": "batch", "questions": [{**q, "keep": True}], "slots": 1, **common, "grow": True} for q in qs]
        if c.route == "sequential" or alone:  # one request per question (chat --batch 1, typed questions)
            return [{"op": "batch", "questions": [q], "slots": 1, **common} for q in qs]
        return [{"op": "batch", "questions": qs, "slots": c.slots, **common}]
    if c.route in ("serve", "mixed") and alone:  # each request alone, as the server would have it
        spec, the_doc = serve_spec(c, fx, save_root)
        return [
            {
                "op": "batch",
                "slots": 1,
                **spec,
                "questions": [
                    {**serve_question(c, fx, spec, the_doc, i), "speculate": alone_speculate(c, c.questions[i])}
                ],
            }
            for i in range(len(c.questions))
        ]
    raise ValueError(f"no requests for route {c.route}")


def alone_speculate(c: Config, q: dict) -> str:
    """How a question alone speculates: not at all when greedy (drafts verified in one forward
    must leave every row's bits as one token at a time would); sampled, as in the configuration
    (speculative sampling draws other random numbers than plain sampling)."""
    return "off" if c.greedy else q.get("speculate", c.speculate)


def _job(c: Config, fx: dict, graphs: bool = False):
    from treeattn_cli.engine.job import EngineJob

    return EngineJob(
        fx[c.family]["model"],
        [],
        dtype="float32",
        kv_dtype=c.kv,
        tp=c.tp,
        scheme=c.scheme,
        max_new_tokens=c.new,
        reserve=256,
        static=True if graphs else None,
    )


def _save(ctx, key: str, c: Config, fx: dict, save_root: str) -> None:
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.storage.kvstore import model_identity

    d = Path(save_root) / key
    if (d / "manifest.json").exists():
        return
    Engine(ctx, _job(c, fx)).serve(
        [
            {"op": "append", "ids": fx[c.family]["doc"][: c.doc_len]},
            {
                "op": "save",
                "dir": str(d),
                "nonce": f"{c.seed:08x}",
                "identity": model_identity(fx[c.family]["model"]),
                "composition": {},
            },
        ]
    )


def serve_spec(c: Config, fx: dict, save_root: str) -> tuple[dict, dict]:
    """What the server's requests of the configuration share: ``(spec, the document)``."""
    doc = fx[c.family]["doc"][: c.doc_len]
    key = c.save_key() if c.reload_cp else f"doc-{c.seed}"
    the_doc = {"key": key, "ids": doc, "piece": c.chunk}
    if c.reload_cp:
        the_doc.update(
            load_from=str(Path(save_root) / key),
            manifest=json.loads((Path(save_root) / key / "manifest.json").read_text()),
        )
    spec = {
        "max_new_tokens": c.new,
        "sampling": c.sampling,
        "stop": [],
        "eos_ids": [],
        "logprobs": LOGPROBS,
        "digest": True,
    }
    if c.qchunk:  # a long question goes in chunks of this many tokens, a round each
        spec["piece"] = c.qchunk
    if c.route == "mixed":  # each question names its document; the batch makes them resident
        spec["piece"] = c.chunk
        if c.tight:  # blocks for the largest document's shard on one rank, no more, and the tail of
            # one question and answer (the longest) at a time: the others wait for its blocks
            from treeattn_cli.engine.room import PAGE, tail_blocks

            page = c.page or PAGE
            longest = max(n for _, n in c.docs)
            tail = max(len(q["ids"]) + new_of(c, i) for i, q in enumerate(c.questions))
            spec["pool_blocks"] = -(-(-(-longest // c.cp)) // page) + tail_blocks(tail, c.cp, page)
        if c.page:
            spec["page"] = c.page
        if c.budget is not None:
            from treeattn_cli.storage.kvstore import model_identity

            spill = Path(save_root) / f"spill-{c.seed}"
            spec.update(
                budget=c.budget,
                dir=str(spill),
                **({} if c.host else {"host_memory": 0}),
                save_meta={"identity": model_identity(fx[c.family]["model"]), "composition": {}},
            )
    return spec, the_doc


def serve_question(c: Config, fx: dict, spec: dict, the_doc: dict, i: int) -> dict:
    """Question ``i`` as the server's engine request has it (``engine.requests.Ask``: of ``spec``,
    the fields a request has; the others are its batch's)."""
    from dataclasses import fields

    from treeattn_cli.engine.requests import Ask

    own = {f.name for f in fields(Ask)}
    q = {
        "ids": c.questions[i]["ids"],
        "speculate": c.questions[i].get("speculate", c.speculate),
        **{k: v for k, v in spec.items() if k in own},
        "max_new_tokens": new_of(c, i),
        "cite": c.questions[i].get("cite"),
    }
    q["doc"] = {"key": f"d{c.seed}-{c.questions[i]['doc']}", "ids": doc_of(c, fx, i)} if c.route == "mixed" else the_doc
    return q


def _serve_case(ctx, eng, c: Config, fx: dict, save_root: str, answers: dict, events: dict) -> None:
    """The server's path: every question names the document (from disk when saved: the cache
    directory), one open batch that late questions join (posted as tokens stream, like the
    scheduler does) and whose answers may be cancelled, questions that joined too late answered
    by a next batch, and, with ``again``, the same questions once more after another document
    was served (the first document then comes from the ranks' pools)."""
    from treeattn_cli.parallel import comm as C

    doc = fx[c.family]["doc"][: c.doc_len]
    spec, the_doc = serve_spec(c, fx, save_root)

    def question(i):
        return serve_question(c, fx, spec, the_doc, i)

    def run_batch(seq: int, order: list, into: dict, posts: bool) -> list:
        """One open batch of questions ``order`` (batch index -> question index); returns (on
        every rank) the questions it never took."""
        streamed, joined, cancels = [0], [], [0]
        joins = sorted(c.joins) if posts else []
        cancel = sorted(c.cancels) if posts else []
        done = []
        store = C._state.get("store")

        def emit(kind, p):
            if kind == "btoken":
                streamed[0] += 1
                while joins and joins[0][0] <= streamed[0]:
                    i = joins.pop(0)[1]
                    C.post_join(store, seq, len(joined), [question(i)])
                    joined.append(i)
                    order.append(i)
                while cancel and cancel[0][0] <= streamed[0]:
                    i = cancel.pop(0)[1]
                    if i in order:
                        C.post_cancel(store, seq, cancels[0], [order.index(i)])
                        cancels[0] += 1
                        events.setdefault("cancel_posted", []).append(i)
            elif kind == "banswer":
                into[order[p[0]]] = p[1]
            elif kind == "batch_done":
                done.append(p)
                events.setdefault("batches", []).append(p)
            elif kind == "bdoc":
                events.setdefault("sources", []).append(p[1]["source"])
                events.setdefault("reused", []).append(p[1].get("reused", 0))
                events.setdefault("loaded", []).append(p[1].get("loaded", 0))
            elif kind == "docs":
                for k, v in p.items():
                    events.setdefault(k, []).extend(v)

        real, ctx.emit = ctx.emit, emit
        try:
            eng.serve(
                [
                    {
                        "op": "batch",
                        "seq": seq,
                        "open": True,
                        "questions": [question(i) for i in order],
                        "slots": c.slots,
                        **spec,
                    }
                ]
            )
        finally:
            ctx.emit = real
        left = joined[done[0]["joins"] :] + [i for _, i in joins] if ctx.rank == 0 else None
        return eng.world.broadcast_object(left, src=0)  # every rank runs the next batch alike

    late = {i for _, i in c.joins}
    seq = 1000 + 10 * (c.seed % 1000)
    rest = run_batch(seq, [i for i in range(len(c.questions)) if i not in late], answers, posts=True)
    if rest:
        events["late"] = len(rest)
        run_batch(seq + 1, list(rest), answers, posts=False)
    if c.again:  # another document, then this one again: from the engine's memory (or disk: a budget)
        if c.route != "mixed":  # (a request with nothing to answer makes it resident, as POST /v1/documents)
            other = {"key": f"other-{c.seed}", "ids": doc[: max(3, len(doc) // 2)], "piece": c.chunk}
            eng.serve(
                [
                    {
                        "op": "batch",
                        "slots": 1,
                        "max_new_tokens": 0,
                        "sampling": {},
                        "questions": [{"ids": [], "doc": other, "max_new_tokens": 0}],
                    }
                ]
            )
        if c.cold:  # as after a restart: out of memory and the pools, and only the longest one's copy kept
            import shutil

            longest = max(range(len(c.docs)), key=lambda k: c.docs[k][1])
            for k, (start, n) in enumerate(c.docs):  # (saved first: the last one made may still be in memory)
                ids = fx[c.family]["doc"][start : start + n]
                for action in ("evict", "drop"):
                    eng.documents.act({"key": f"d{c.seed}-{k}", "ids": ids, "action": action, "piece": c.chunk})
                if ctx.rank == 0 and k != longest:
                    shutil.rmtree(Path(save_root) / f"spill-{c.seed}" / f"d{c.seed}-{k}", ignore_errors=True)
            eng.world.barrier()
        events["again"] = {}
        run_batch(seq + 2, list(range(len(c.questions))), events["again"], posts=False)


def run_one(ctx, c: Config, fx: dict, save_root: str) -> dict:
    """The configuration, then each question alone; rank 0 returns the records."""
    from treeattn_cli.engine.engine import Engine

    import os

    from treeattn_cli.storage import host_tier

    answers, events, alone = {}, {}, {}
    host_tier.RESTORE_BYTES_PER_ROUND = 1 if c.restore_parts else RESTORE_DEFAULT  # (one layer a round)
    eng = Engine(ctx, _job(c, fx, c.graphs))
    stand_in = None
    if c.graphs:
        from ranks import fake_cuda_graphs

        stand_in = fake_cuda_graphs(eng.dec, ctx.rank)
    t0 = time.perf_counter()
    try:
        if c.route in ("serve", "mixed"):
            _serve_case(ctx, eng, c, fx, save_root, answers, events)
        else:
            seq = [0]

            def emit(kind, p):
                if kind == "banswer" and c.route in ("sequential", "conversation"):  # a request per question
                    answers[len(answers)] = p[1]
                elif kind == "banswer":
                    answers[p[0]] = p[1]
                elif kind == "answer":
                    answers[seq[0]] = p
                    seq[0] += 1
                elif kind in ("loaded", "batch_done"):
                    events.setdefault(kind, []).append(p)

            real, ctx.emit = ctx.emit, emit
            try:
                eng.serve(requests_of(c, fx, save_root))
            finally:
                ctx.emit = real
    finally:
        os.environ.pop("TREEATTN_KERNEL", None)  # (the stand-in's: the GPU's kernels) alone runs the CPU's
    if stand_in is not None:
        events["graph_replays_checked"] = stand_in.checked
        events["verify_replays"] = eng.graph_totals["verify_graph_replays"]
    took = time.perf_counter() - t0
    # the same requests alone: a fresh engine, the same document on the same path (the pool, its
    # segments, its saved cache), one question at a time, no drafts: every bit of every answer
    ref = Engine(ctx, _job(c, fx))

    def emit_alone(kind, p):
        if kind == "banswer":
            alone[len(alone)] = p[1]

    real, ctx.emit = ctx.emit, emit_alone
    try:
        if c.graphs:  # the configuration's kernels (the GPU's, interpreted), eagerly
            os.environ["TREEATTN_KERNEL"] = "triton"
        ref.serve(requests_of(c, fx, save_root, alone=True))
    finally:
        ctx.emit = real
        os.environ.pop("TREEATTN_KERNEL", None)
    return {"answers": answers, "alone": alone, "events": events, "seconds": took}


def run_set(ctx, configs: list, fx: dict, save_root: str, saves: list) -> list | None:
    """Every configuration of one rank set, in one launch (ranks start once): first the saved
    caches other rank sets load, then each configuration. A configuration that raises on every
    rank is reported with its traceback and the next one runs."""
    for key, cfg in saves:
        _save(ctx, key, Config(**cfg), fx, save_root)
    out = []
    for cfg in configs:
        c = Config(**cfg)
        t0 = time.perf_counter()
        try:
            out.append({"seed": c.seed, **run_one(ctx, c, fx, save_root)})
        except Exception as e:  # noqa: BLE001 - reported as this configuration's failure
            out.append({"seed": c.seed, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
        out[-1]["seconds"] = time.perf_counter() - t0  # (its alone answers included: what CI pays for it)
    return out if ctx.rank == 0 else None


# ---------------------------------------------------------------- checking (parent process)


def _first_difference(a: list, b: list) -> int | None:
    """The first index at which ``a`` and ``b`` differ over their common length, or None."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)


def check(c: Config, r: dict, fx: dict, oracle: Oracle, notes: list | None = None) -> list[str]:
    """What is wrong with a configuration's result (empty: nothing): each answer against the
    same request alone, bit for bit (the digest of each token's logits, its logprobs, its tokens
    and stop; a cancelled answer a prefix of alone's), and, greedy with an unrounded cache,
    alone's tokens against transformers' greedy decode. ``notes``: unused (kept for callers)."""
    if "error" in r:
        return [r["error"].strip()]
    bad = []
    answers = {int(k): v for k, v in r["answers"].items()}
    alone = {int(k): v for k, v in r["alone"].items()}
    cancelled = set(r["events"].get("cancel_posted", []))
    context = list(fx[c.family]["doc"][: c.doc_len])
    for i, q in enumerate(c.questions):
        doc = doc_of(c, fx, i)
        got, want = answers.get(i), alone.get(i)
        if got is None or want is None:
            bad.append(f"question {i}: no answer ({'config' if got is None else 'alone'})")
            continue
        bad += _differs(f"question {i}", got, want, prefix=i in cancelled and got["stop_reason"] == "cancelled")
        if q.get("cite"):  # each kept row's attention over the spans, as alone (rows of the same tokens)
            n = len(got["token_ids"])
            bad += _cite_differs(i, got.get("cite"), want.get("cite"), max(0, n - 1), n, GAP_CITE)
        if c.greedy and c.kv == "auto":  # transformers' greedy decode of the same tokens
            prompt = (context if c.route == "conversation" else list(doc)) + list(q["ids"])
            hf = oracle.greedy(c.family, prompt, new_of(c, i))
            if want["token_ids"] != hf:
                bad.append(f"question {i}: alone {want['token_ids']} != transformers {hf}")
        if c.route == "conversation":
            context += list(q["ids"]) + list(want["token_ids"])
    again = r["events"].get("again")
    if again is not None:
        for i in range(len(c.questions)):
            a, w = again.get(i) or again.get(str(i)), alone.get(i)
            if a is None or w is None:
                bad.append(f"question {i}, document asked again: no answer")
            else:
                bad += _differs(f"question {i}, document asked again", a, w)
    return bad


def _differs(what: str, got: dict, want: dict, prefix: bool = False) -> list[str]:
    """How answer ``got`` differs from ``want`` in its bits (``prefix``: a cancelled answer,
    whose tokens so far must be alone's first ones)."""
    g, w = got["token_ids"], want["token_ids"]
    gd, wd = got.get("digests"), want.get("digests")
    if gd is None or wd is None or len(gd) != len(g) or len(wd) != len(w):
        return [f"{what}: no digest of each token's logits"]
    out = []
    if prefix:
        if g != w[: len(g)]:
            out.append(f"{what} (cancelled): {g} is not a prefix of {w}")
    elif g != w:
        out.append(f"{what}: tokens {g} != alone {w} (first difference at {_first_difference(g, w)})")
    elif got["stop_reason"] != want["stop_reason"]:
        out.append(f"{what}: stop {got['stop_reason']} != alone {want['stop_reason']}")
    at = _first_difference(gd, wd)
    if at is not None:
        out.append(f"{what}: the logits of token {at} differ from alone's in their bits (digest {gd[at]} != {wd[at]})")
    lp = _first_difference(got.get("logprobs") or [], want.get("logprobs") or [])
    if lp is not None and at is None:
        out.append(f"{what}: the logprobs of token {lp} differ from alone's")
    return out


def _cite_differs(i: int, got, want, rows: int, emitted: int, tol: float) -> list[str]:
    """Problems of an answer's citation masses against alone's over their first ``rows`` rows
    (the rows of tokens both emitted alike; one row per emitted token but the last)."""
    import numpy as np

    if got is None or want is None:
        return [f"question {i}: no citation masses ({'config' if got is None else 'alone'})"]
    got, want = np.asarray(got), np.asarray(want)
    if got.shape[0] != max(0, emitted - 1):
        return [f"question {i}: {got.shape[0]} citation rows for {emitted} tokens"]
    diff = float(np.abs(got[:rows] - want[:rows]).max()) if rows else 0.0
    return [f"question {i}: citation masses differ from alone by {diff:.2e} (> {tol:g})"] if diff > tol else []


def features(c: Config, r: dict) -> set[str]:
    """Which combinations this configuration actually exercised (the test checks that the
    whole set covers them, not only that answers agree)."""
    if "error" in r:
        return set()
    out = {f"route:{c.route}", f"mesh:{c.cp}x{c.tp}", f"kv:{c.kv}", f"family:{c.family}"}
    answers = list(r["answers"].values())
    spec = [a.get("speculation") or {} for a in answers]
    if any(s.get("accepted") for s in spec):
        out.add("drafts accepted")
    if any(s.get("drafted", 0) > s.get("accepted", 0) for s in spec):
        out.add("drafts rejected")
    if c.route in ("batch", "serve", "mixed") and len(c.questions) > c.slots:
        out.add("slots refilled")
        if any(s.get("drafted", 0) > s.get("accepted", 0) for s in spec):
            out.add("slots refilled while drafting")
    if any(b.get("joins") for b in r["events"].get("batches", [])):
        out.add("joined a running batch")
    if any(a.get("stop_reason") == "cancelled" for a in answers):
        out.add("cancelled")
    if c.reload_cp:
        out.add("reloaded on other ranks")
    if "again" in r["events"]:
        out.add("document from memory")
    if any(len(q["ids"]) < c.cp for q in c.questions) and c.route == "conversation":
        out.add("question shorter than the shards")
    if any(n < c.cp for _, n in c.docs or []):
        out.add("document shorter than the shards")
    if not c.greedy:
        out.add("sampling")
    if c.chunk:
        out.add("chunked prefill")
    batches = r["events"].get("batches", [])
    if any(b.get("documents_per_step", 0) > 1 for b in batches):
        out.add("documents mixed in a step")
    if any(b.get("segments_while_decoding") for b in batches):
        out.add("document prefilled while others decode")
    if any(b.get("chunks_while_decoding") for b in batches + r["events"].get("batch_done", [])):
        out.add("question prefilled in chunks while others decode")
    if any(b.get("pool_waits") for b in batches):
        out.add("a document waited for blocks")
    if any(b.get("tail_waits") for b in batches):
        out.add("a question waited for its tail's blocks")
    if r["events"].get("spilled") and "disk" in r["events"].get("sources", []):
        out.add("document evicted to disk and loaded back")
    if "host" in r["events"].get("sources", []):
        out.add("document evicted to host memory and copied back")
        if c.restore_parts:
            out.add("document copied back a layer per round")
    if any(r["events"].get("loaded", [])):
        out.add("document's first segments loaded from a longer one's saved copy")
    if "pool" in r["events"].get("sources", []):
        out.add("document found whole in the pool's cached blocks")
    if any(n and s == "prefill" for n, s in zip(r["events"].get("reused", []), r["events"].get("sources", []))):
        out.add("document prefilled after a prefix found in the pool")
    if r["events"].get("graph_replays_checked"):
        if any(b.get("graph_replays") for b in batches + r["events"].get("batch_done", [])):
            out.add("batched steps replayed from graphs")
        if r["events"].get("verify_replays") or any(
            b.get("verify_graph_replays") for b in batches + r["events"].get("batch_done", [])
        ):
            out.add("verifies replayed from graphs")
    cited = [a for a in answers if a.get("cite") is not None and len(a["cite"])]
    if cited:
        out.add("cited")
        if any((a.get("speculation") or {}).get("accepted") for a in cited):
            out.add("cited with drafts accepted")
        if c.route in ("batch", "serve", "mixed") and any(not q.get("cite") for q in c.questions):
            out.add("cited beside answers that do not")
    return out


def run(seeds: list[int], root: Path, *, progress=None, timeout_s: float = 600.0):
    """Draw, run and check configurations ``seeds``; returns ``(configs, results, problems,
    notes)`` with problems ``{seed: [lines]}``."""
    from treeattn_cli.parallel.launch import LaunchError, run_local

    fx = fixtures(root / "fixtures")
    save_root = root / "saves"
    save_root.mkdir(parents=True, exist_ok=True)
    configs = {s: draw(s, fx) for s in seeds}
    saves: dict = {}  # rank set -> [(key, config)]
    for c in configs.values():
        if c.reload_cp:
            saves.setdefault((c.reload_cp, 1), {})[c.save_key()] = {**asdict(c), "cp": c.reload_cp, "tp": 1}
    results, problems, notes = {}, {}, []
    oracle = Oracle(fx)
    for mesh in ORDER:
        todo = [asdict(c) for c in configs.values() if (c.cp, c.tp) == mesh]
        need = list(saves.get(mesh, {}).items())
        if not todo and not need:
            continue
        t0 = time.perf_counter()
        try:
            got = run_local(run_set, mesh[0] * mesh[1], todo, fx, str(save_root), need, timeout_s=timeout_s)[0]
        except LaunchError as e:
            got = [{"seed": cfg["seed"], "error": f"the rank set {mesh[0]}x{mesh[1]} failed: {e}"} for cfg in todo]
        for r in got:
            results[r["seed"]] = r
            bad = check(configs[r["seed"]], r, fx, oracle, notes)
            if bad:
                problems[r["seed"]] = bad
        if progress:
            progress(mesh, len(todo), time.perf_counter() - t0)
    return configs, results, problems, notes


def report(configs: dict, problems: dict) -> str:
    lines = []
    for seed, bad in sorted(problems.items()):
        lines.append(f"FAILED {configs[seed].line()}")
        lines += [f"    {b}" for b in bad[:6]]
        lines.append(f"    re-run: python tools/combos.py --seed {seed}")
    return "\n".join(lines)
