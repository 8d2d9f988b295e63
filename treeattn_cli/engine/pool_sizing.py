"""How big a rank's block pool is made (``documents.Documents.make_pool``): from the request's
numbers, the model's context, and the memory free on this rank; the same number of blocks on
every rank (one collective), so one admission rule holds for all of them."""

from __future__ import annotations


from ..memory import free_memory
from .pool import BlockPool
from .room import PAGE, POOL_BYTES, blocks_per_rank, tail_blocks


def make_pool(opts: dict, eng) -> tuple[BlockPool, int]:
    """This rank's pool for engine ``eng`` (its KV format, world, mesh, model): ``pool_blocks``
    blocks (tests), or the blocks a document of ``pool_for`` tokens takes on its largest shard
    (``chat``: its document) and the tails of ``tail_slots`` questions of ``tails`` tokens each,
    question and answer (``room.tail_blocks``; the batch's tail lives in the pool too), and with
    ``grow`` (``chat``: the document may grow by a conversation's turns, and a question may be as
    long as the context allows) at least the default pool, never more than the model's whole
    context and those tails take, or ``pool`` bytes (default ``room.POOL_BYTES`` of the device; a
    GPU gives at most 0.9 of its free memory), or ``pool_fraction`` of the memory free now (a
    GPU's free memory; on a CPU the available memory, shared by the ranks); ``page`` tokens per
    block (tests: small blocks). Returns ``(pool, bytes free on this rank)``."""
    c, world = eng.kv, eng.world
    page = int(opts.get("page") or PAGE)  # tests: small blocks
    per = BlockPool.bytes_per_block(
        c.num_layers, c.kv_heads, c.head_dim, page, c.dtype, c.quant.groups if c.quant else 0
    )
    free = free_memory(c.device, ranks=world.world)
    if opts.get("pool_blocks"):  # an exact count (tests of a full pool)
        want = int(opts["pool_blocks"]) * per
    elif opts.get("pool_for"):
        cp = eng.mesh.cp
        tails = int(opts.get("tail_slots") or 1) * tail_blocks(int(opts.get("tails") or 0), cp, page)
        want = (blocks_per_rank(int(opts["pool_for"]), cp, page) + tails) * per
        if opts.get("grow"):
            default = POOL_BYTES.get(c.device.type, POOL_BYTES["cuda"])
            if c.device.type == "cuda":
                default = min(default, int(0.9 * free))
            context = getattr(eng.model.config, "max_position_embeddings", None)
            whole = (blocks_per_rank(context, cp, page) + tails) * per if context else default
            want = max(want, min(default, whole))
    elif opts.get("pool_fraction"):
        want = int(float(opts["pool_fraction"]) * free)
    else:
        want = int(opts.get("pool") or POOL_BYTES.get(c.device.type, POOL_BYTES["cuda"]))
        if c.device.type == "cuda":
            want = min(want, int(0.9 * free))
    blocks = world.all_min(want // per)  # every rank the same count: one admission rule
    if blocks < 1:
        raise ValueError(
            f"--kv-memory holds no block of the documents' pool: a block of {page} tokens "
            f"takes {per:,} bytes per rank, this rank's share is {want:,} bytes"
        )
    return BlockPool(
        c.num_layers,
        c.kv_heads,
        c.head_dim,
        page=page,
        num_blocks=blocks,
        dtype=c.dtype,
        device=c.device,
        quant=c.quant,
    ), free
