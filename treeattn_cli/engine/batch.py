"""Many questions about one document at once: continuous batching over the shared, sharded
document (DESIGN.md §11; cascade attention).

The document stays in the engine's cache, one shard per rank, and is never copied per question.
Each question lives in a slot of a small second cache, the *tail* (batch = slots): its own
tokens, spread over the ranks like decode tokens. Per step every rank runs the model on one
token of every busy slot; per layer its attention reads its document shard once for all of
them (the slots' queries are rows of one kernel call) and each slot's tail rows, merges the two
partials by LSE, and one merge across the ranks serves the whole batch (``attention._cascade``).

A question enters a free slot with a prefill of all its tokens at once (every new question of
that moment together, left-padded to one length); when its answer ends, the next question
takes the slot. Rank 0 samples every slot with the slot's own generator (each answer starts
from the seed, as one alone would), decides stops per slot, and broadcasts the step's tokens
and decisions, so all ranks follow the same schedule. Answers are exactly those of each
question alone after the document.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .cache import ShardedKVCache
from .decode import STOP_CODES, STOP_IDS, Sampling, sample

_IDLE = -1  # a slot with nothing to report this round
_ALL_STOPPED = -2  # the launcher interrupted the batch


@dataclass
class _Slot:
    question: int  # index into the batch's questions
    prompt: int  # tokens of the question
    position: int  # global position of the next token to feed
    gen: object  # rank 0: the slot's sampling generator
    t_start: float  # when the question entered its slot
    t_batch: float  # when the batch began (time to first token counts from there)
    prefill_s: float = 0.0
    tokens: list = field(default_factory=list)
    t_first: float | None = None
    t_last: float | None = None


class BatchDecoder:
    """Continuous batching of questions after the document in ``dec``'s cache, ``slots`` at a time."""

    def __init__(self, dec, slots: int, capacity: int):
        self.dec = dec
        self.slots = slots
        doc = dec.cache
        self.doc_tokens = dec.total
        cp = dec.comm.world
        self.tail = ShardedKVCache(doc.num_layers, slots, doc.kv_heads, doc.head_dim, dtype=doc.dtype,
                                   device=doc.device, rank=doc.rank, world=doc.world,
                                   capacity=-(-capacity // cp) + 2)

    @torch.inference_mode()
    def run(self, questions: list[list[int]], *, max_new_tokens: int, sampling: Sampling,
            stop_check=None, interrupted=None, on_token=None, on_answer=None) -> list[dict]:
        """Answer every question; returns (on every rank) one summary per question, in order.
        Rank 0 only: ``stop_check(ids) -> reason | None``, ``interrupted() -> bool``,
        ``on_token(question, token)``, ``on_answer(question, summary)`` as each answer ends."""
        dec, S = self.dec, self.slots
        lead = dec.world.rank == 0
        queue = deque(range(len(questions)))
        slots: list[_Slot | None] = [None] * S
        logits = None  # rank 0: [S, V], the latest logits of every slot that has some
        ready = [False] * S
        out: list[dict | None] = [None] * len(questions)
        t0 = time.perf_counter()
        msg = torch.zeros(S + 1, 2, dtype=torch.int64, device=dec.device)
        while True:
            free = [b for b in range(S) if slots[b] is None]
            new = []
            while free and queue:
                b = free.pop(0)
                qi = queue.popleft()
                slots[b] = _Slot(qi, len(questions[qi]), self.doc_tokens + len(questions[qi]),
                                 torch.Generator(device=dec.device).manual_seed(sampling.seed) if lead else None,
                                 time.perf_counter(), t0)
                new.append(b)
            if new:
                lg = self._prefill(new, [questions[slots[b].question] for b in new])
                for b in new:
                    slots[b].prefill_s = time.perf_counter() - slots[b].t_start
                logits = self._place(logits, lg, new)
                for b in new:
                    ready[b] = True
            if not any(slots):
                break
            if lead:  # every ready slot's next token and whether its answer ends
                msg.fill_(_IDLE)
                stop_all = interrupted is not None and interrupted()
                for b in range(S):
                    if not ready[b]:
                        continue
                    s = slots[b]
                    tok = int(sample(logits[b:b + 1], sampling, s.gen)[0])
                    s.tokens.append(tok)
                    reason = stop_check(s.tokens) if stop_check else None
                    if reason is None and stop_all:
                        reason = "interrupted"
                    if reason is None and len(s.tokens) == max_new_tokens:
                        reason = "length"
                    msg[b, 0], msg[b, 1] = tok, STOP_IDS[reason]
                msg[S, 0] = _ALL_STOPPED if stop_all else 0
            dec.world.broadcast(msg, src=0)
            rows = msg.tolist()
            now = time.perf_counter()
            going = [False] * S
            for b in range(S):
                if not ready[b]:
                    continue
                s = slots[b]
                tok, reason = rows[b][0], STOP_CODES[rows[b][1]]
                if not lead:
                    s.tokens.append(tok)
                s.t_first = s.t_first or now
                s.t_last = now
                if lead and on_token is not None:
                    on_token(s.question, tok)
                if reason is None:
                    going[b] = True
                    continue
                out[s.question] = self._summary(s, reason)
                if lead and on_answer is not None:
                    on_answer(s.question, {**out[s.question], "token_ids": list(s.tokens)})
                slots[b] = None
            ready = [False] * S
            if rows[S][0] == _ALL_STOPPED:  # Ctrl-C: the answers so far end; the rest are not started
                queue.clear()
                for b in range(S):
                    if slots[b] is not None:  # busy but not ready this round: nothing pending
                        out[slots[b].question] = self._summary(slots[b], "interrupted")
                        if lead and on_answer is not None:
                            on_answer(slots[b].question, {**out[slots[b].question],
                                                          "token_ids": list(slots[b].tokens)})
                        slots[b] = None
                break
            if any(going):
                lg = self._step([slots[b].tokens[-1] if going[b] else 0 for b in range(S)],
                                [slots[b].position if going[b] else 0 for b in range(S)], going)
                for b in range(S):
                    if going[b]:
                        slots[b].position += 1
                        ready[b] = True
                logits = lg if lead else None
        return out

    def _summary(self, s: _Slot, reason) -> dict:
        n = len(s.tokens)
        decode_s = (s.t_last - s.t_first) if n > 1 else 0.0
        return {"prompt_tokens": s.prompt, "context_tokens": self.doc_tokens + s.prompt, "new_tokens": n,
                "ttft_s": (s.t_first or s.t_start) - s.t_batch, "prefill_s": s.prefill_s,
                "prefill_tokens_per_s": s.prompt / s.prefill_s if s.prefill_s else None,
                "decode_tokens_per_s": (n - 1) / decode_s if decode_s else None,
                "stop_reason": reason, "prefill_method": "batched"}

    def _place(self, logits, lg, rows):
        """Rank 0: the logits of ``rows`` into the per-slot table."""
        if self.dec.world.rank != 0:
            return None
        if logits is None:
            logits = torch.zeros(self.slots, lg.shape[-1], dtype=lg.dtype, device=lg.device)
        logits[rows] = lg
        return logits

    def _prefill(self, rows: list[int], prompts: list[list[int]]):
        """Every token of the questions entering slots ``rows``, in one forward (left-padded to
        the longest, padding kept nowhere); their last position's logits ``[len(rows), V]``."""
        dec = self.dec
        T = max(len(p) for p in prompts)
        ids = torch.zeros(len(rows), T, dtype=torch.int64)
        pos = torch.full((len(rows), T), -1, dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, T - len(p):] = torch.tensor(p)
            pos[i, T - len(p):] = torch.arange(self.doc_tokens, self.doc_tokens + len(p))
        self.tail.reset_rows(rows)
        self.tail.begin_extend(rows, pos)
        return self._forward(ids, pos, rows, step=False, finish=self.tail.end_extend)

    def _step(self, tokens: list[int], positions: list[int], going: list[bool]):
        """One token for every slot that goes on (the others are written off): logits ``[S, V]``."""
        self.tail.begin_step(torch.tensor(positions), active=going)
        pos = torch.tensor(positions, dtype=torch.int64)[:, None]
        return self._forward(torch.tensor(tokens)[:, None], pos, list(range(self.slots)), step=True,
                             finish=self.tail.end_step)

    def _forward(self, ids, pos, rows, *, step: bool, finish):
        dec = self.dec
        actx = dec.actx
        dev = dec.device
        pos_dev = pos.to(dev)
        actx.phase, actx.tail, actx.rows, actx.step, actx.positions = "cascade", self.tail, rows, step, pos_dev
        try:
            logits = dec._forward(ids.to(dev), pos_dev.clamp(min=self.doc_tokens), want_logits=dec.comm.rank == 0)
        finally:
            actx.phase, actx.tail = "decode", None
        finish()
        return logits
