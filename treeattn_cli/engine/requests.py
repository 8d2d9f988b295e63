"""What is asked of the engine and what comes back, typed: a request (:class:`Ask`: its tokens,
its sampling, its document :class:`DocRef`) and the events of its answer (:class:`Token`,
:class:`Began`, :class:`Done`, :class:`Failed`).

Between the launching process and the ranks a request travels as JSON (``comm.post_request``,
``comm.post_join``): :meth:`Ask.wire` writes it, :meth:`Ask.read` reads it back on every rank,
filling what it leaves out from its batch's defaults. Every command asks this way: ``generate``
(one request over its prompt as a document), ``chat`` (a request per question), ``serve`` (a
request per HTTP request, ``serving/front.py``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from .sampling import Sampling


def document_key(ids) -> str:
    """The name a document's tokens go by in the engine's documents and a cache directory
    (``serve``'s documents, ``chat``'s and ``generate``'s with ``--cache-dir``): equal tokens,
    equal name."""
    import hashlib

    return hashlib.sha256(" ".join(map(str, ids)).encode()).hexdigest()[:24]


@dataclass
class DocRef:
    """The document a request continues (``documents.Documents.get``): its key and tokens; where
    a saved copy is (``manifest`` of ``--cache-dir``'s, or ``load_from``); what the request does
    to it: ``pin`` it (True / False) or, with nothing to answer, ``action`` it (``"evict"``: out
    of memory, saved first; ``"drop"``: out of memory and its cached blocks freed). ``generate``
    asks more of its prompt's: its prefill's ``progress`` reported, its ``last_logits`` kept
    (the answer starts from them), the cache saved to ``save_to`` with ``save_meta``, cut in
    ``piece``-token segments."""

    key: str | None
    ids: list[int]
    manifest: dict | None = None
    pin: bool | None = None
    action: str | None = None
    load_from: str | None = None
    progress: bool = False
    last_logits: bool = False
    save_to: str | None = None
    save_meta: dict | None = None
    piece: int | None = None

    def wire(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}


@dataclass
class Ask:
    """One request: the tokens it adds after its document (``doc``; none: the engine's own
    tokens), how many to answer and how (``sampling``, ``stop`` strings, ``eos_ids``,
    ``speculate``: off | auto | ngram:K), and what its record carries: ``logprobs`` (each token's
    and this many alternatives), ``digest`` (of the logits each token came from), ``cite`` (its
    attention over spans of the document: ``cite.Citation``). ``keep``: its question (``"question"``)
    or question and answer (True) stay in its document (a conversation's turn)."""

    ids: list[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    eos_ids: list[int] = field(default_factory=list)
    speculate: str = "off"
    doc: DocRef | None = None
    logprobs: int | None = None
    digest: bool = False
    cite: dict | None = None
    keep: bool | str = False
    drop_pending: bool = False  # a kept turn that does not feed its document's last answer token

    def wire(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["sampling"] = asdict(self.sampling)
        out["doc"] = self.doc.wire() if self.doc is not None else None
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def read(cls, q: dict | list, defaults: dict | None = None) -> "Ask":
        """A request from its JSON (a bare list: tokens that continue the engine's own), what it
        leaves out (or sets to None) taken from ``defaults`` (its batch's)."""
        spec = {k: v for k, v in (defaults or {}).items() if v is not None}
        spec.update({k: v for k, v in ({"ids": q} if isinstance(q, list) else q).items() if v is not None})
        unknown = set(spec) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"a request has unknown field(s): {', '.join(sorted(unknown))}")
        sampling = spec.pop("sampling", None)
        doc = spec.pop("doc", None)
        return cls(
            **{**spec, "ids": list(spec["ids"])},
            sampling=Sampling(**(sampling or {})),
            doc=DocRef(**doc) if isinstance(doc, dict) else doc,
        )


# -- the events of a request's answer, in order: Began, Token..., then Done or Failed ----------------


@dataclass
class Began:
    """Its document is resident and its answer begins: how the document got there (``source``:
    memory, disk, prefill; for a documents-API request the outcome: document, evicted, dropped,
    absent, busy) and how many of its tokens were found cached."""

    source: str
    cached: int


@dataclass
class Token:
    token: int


@dataclass
class Done:
    """The answer's record (``batch._Slot.record``: ``token_ids``, ``stop_reason``, timings...)."""

    record: dict

    @property
    def stop_reason(self):
        return self.record.get("stop_reason")


@dataclass
class Failed:
    """The engine cannot answer (its ranks are gone, it is shutting down): why."""

    reason: str


# -- what generate asks ---------------------------------------------------------------------


def generate_requests(job) -> list[dict]:
    """``generate`` as requests: the prompt a document in the ranks' block pool, the answer a
    question over it (``Engine._op_generate``); the ring baseline (``decode_method="ring"``,
    ``bench``) as appends and a decode of the engine's own tokens (:func:`single_requests`)."""
    if job.decode_method != "ring":
        return [{"op": "generate"}, {"op": "stop"}]
    return single_requests(job)


def single_requests(job) -> list[dict]:
    """``generate`` as operations on the engine's own tokens (the ring baseline, and tests): load
    a saved cache (``--load-kv``), append the prompt, decode, and with ``--save-kv`` save the
    cache of the prompt."""
    reqs = []
    if job.load_kv:
        reqs.append({"op": "load", "dir": job.load_kv, "manifest": job.load_manifest})
    reqs.append({"op": "append", "ids": list(job.prompt_ids), "piece": job.prefill_chunk})
    if job.save_kv:
        reqs.append({"op": "mark", "name": "prompt"})
    reqs.append(
        {
            "op": "decode",
            "seq": 0,
            "max_new_tokens": job.max_new_tokens,
            "stop": list(job.stop),
            "eos_ids": list(job.eos_ids),
            "sampling": vars(job.sampling),
            "keep": False,
            # the ring baseline decodes a token at a time: its blocks rotate for one query row
            "speculate": job.speculate if job.decode_method != "ring" else "off",
            "logprobs": job.logprobs,
            "cite": job.cite,
        }
    )
    if job.save_kv:
        reqs += [{"op": "rollback", "name": "prompt"}, {"op": "save", "dir": job.save_kv, **job.save_meta}]
    return reqs + [{"op": "stop"}]
