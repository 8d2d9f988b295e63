"""Room in the ranks' block pools, counted from outside them (docs/architecture.md §12; issue 35).

A server answers "can this request ever be held?" before any rank sees it, from tokens alone:
the ranks' pools (``pool.BlockPool``, one per rank, the same size on every rank) count in blocks
of :data:`PAGE` tokens, and how many blocks a document or a question takes is the engine's
arithmetic (:func:`blocks_held`, :func:`tail_blocks`; ``documents.Documents.make_pool`` sizes
the pools by it), kept here so that the command line speaks in tokens and bytes and gets back a
verdict with its numbers. No torch here.

:class:`PoolRoom` is that view: the sequence shards, the bytes a token of KV takes, the pool's
bytes per rank, and (once the ranks reported it) the pool's real block count. Its verdicts are
one line each, None when the request fits:

* :meth:`PoolRoom.alone` — a document whose KV per rank exceeds the pool even alone;
* :meth:`PoolRoom.request` — a document part and its question and answer beside the pinned
  documents (a request that fits later waits; this one never could);
* :meth:`PoolRoom.pin` — one more pinned document past the share of the pool pins may hold.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE = 64  # tokens per block of the documents' pool (a power of two, a multiple of the split kernel's tile)
# Bytes of the documents' pool per rank when the request names none: it is allocated (and zeroed) at
# once; a GPU takes this much of its free memory at most.
POOL_BYTES = {"cpu": 512 << 20, "cuda": 8 << 30}


def blocks_held(tokens: int, cp: int, page: int = PAGE) -> int:
    """Blocks of ``page`` tokens the even share of a document of ``tokens`` tokens over ``cp``
    sequence shards fills (``serve``'s count of what pinned documents hold)."""
    return -(-(-(-tokens // cp)) // page)


def blocks_per_rank(tokens: int, cp: int, page: int = PAGE) -> int:
    """Blocks a pool must have for a document of ``tokens`` tokens alone, on the largest of its
    ``cp`` shards: the even share and one token (segments cut unevenly), and one block more (a
    shard's tokens need not start at a block)."""
    return blocks_held(tokens + cp, cp, page) + 1


def tail_blocks(tokens: int, cp: int, page: int = PAGE) -> int:
    """Blocks a batch slot's question and answer of ``tokens`` tokens may take on its busiest rank
    (``paged_tail.PagedTail.admit``): the even share, and room for the document beside it
    holding up to a block's worth of tokens more on some ranks (placement fills the ranks that
    hold fewest first)."""
    return blocks_held(tokens, cp, page) + 1


def blocks_in(pool_bytes: int, kv_bytes_per_token: int, page: int = PAGE) -> int:
    """Blocks a pool of ``pool_bytes`` holds, ``kv_bytes_per_token`` per token on the rank (every
    layer's K and V, fp8 scales included), and each token's position."""
    return pool_bytes // (page * kv_bytes_per_token + 8 * page)


@dataclass(frozen=True)
class PoolRoom:
    """The ranks' pools as admission sees them (see the module)."""

    cp: int  # sequence shards (ranks // tensor-parallel width)
    tp: int  # tensor-parallel width (heads split between peers)
    bytes_per_token: int  # KV bytes of one token on all ranks together (prepare.Run.kv_bytes_per_token)
    pool_bytes: int  # each rank's pool (--kv-memory, or what the ranks allocated)
    reported: int = 0  # blocks per rank the ranks reported (the smallest rank's; 0: not yet)
    page: int = PAGE

    def rank_bytes(self, tokens: int) -> int:
        """Bytes of KV a document of ``tokens`` takes on each rank (its even share)."""
        return self.bytes_per_token * -(-tokens // self.cp) // self.tp

    @property
    def blocks(self) -> int:
        """Blocks of each rank's pool: the ranks' own count, else what ``pool_bytes`` holds."""
        return self.reported or blocks_in(self.pool_bytes, self.bytes_per_token // self.tp, self.page)

    def document(self, tokens: int) -> int:
        """Blocks a document of ``tokens`` holds on a rank (its even share)."""
        return blocks_held(tokens, self.cp, self.page)

    def held(self, documents) -> int:
        """Blocks the documents of these token counts hold on a rank together."""
        return sum(self.document(n) for n in documents)

    def alone(self, tokens: int) -> str | None:
        """Why a document of ``tokens`` cannot be held even alone (its KV per rank exceeds the
        pool's bytes), or None: a document that fits alone always gets in, others leave first."""
        per_rank = self.rank_bytes(tokens)
        if per_rank <= self.pool_bytes:
            return None
        return (
            f"the document part of this request ({tokens} tokens) needs {per_rank / 2**20:.1f} MiB of KV cache "
            f"per rank; this server keeps at most {self.pool_bytes / 2**20:.1f} MiB per rank (--kv-memory)"
        )

    def request(self, doc_tokens: int, tail_tokens: int, pinned=()) -> str | None:
        """Why a request can never be held (one line with the numbers), or None: its document
        part of ``doc_tokens`` (0: none to hold, or already resident) and its question and answer
        of ``tail_tokens`` (a batch's tail takes the pool's blocks too: ``paged_tail``) beside the
        pinned documents of ``pinned`` tokens each (they never leave)."""
        need = self.document(doc_tokens) if doc_tokens else 0
        tail = tail_blocks(tail_tokens, self.cp, self.page) if tail_tokens else 0
        total, held = self.blocks, self.held(pinned)
        if need + tail <= total - held:
            return None
        parts = ([f"its document part ({doc_tokens} tokens) {need}"] if need else []) + (
            [f"its question and answer ({tail_tokens} tokens) {tail}"] if tail else []
        )
        what = f"this request needs {need + tail} blocks of the KV pool per rank ({', '.join(parts)})"
        if held:
            return f"{what}; pinned documents hold {held} of its {total} (unpin or delete some: /v1/documents)"
        return f"{what}; the pool holds {total} per rank (--kv-memory)"

    def pin(self, tokens: int, pinned, share: float) -> str | None:
        """Why pinning a document of ``tokens`` beside the pinned ones (``pinned``: their tokens)
        would take pinned documents past ``share`` of the pool, or None."""
        held, need, total = self.held(pinned), self.document(tokens), self.blocks
        limit = int(total * share)
        if held + need <= limit:
            return None
        return (
            f"pinning this document ({tokens} tokens: {need} blocks per rank, "
            f"{self.rank_bytes(tokens) / 2**20:.2f} MiB) next to the pinned ones ({held} blocks) needs "
            f"{held + need} blocks per rank; pinned documents may hold {limit} of the pool's {total} "
            f"({share:.0%} of the KV pool's {self.pool_bytes / 2**20:.1f} MiB (--kv-memory): the rest stays for other "
            f"documents)"
        )
