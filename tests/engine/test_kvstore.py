"""Saved caches on disk: streamed layer by layer (host memory of a save or load stays near one
layer, not the shard), and nothing outside the cache directory is ever read."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import peak_anon_growth
from treeattn_cli.engine import kvstore
from treeattn_cli.engine.paged_shard import PagedShard
from treeattn_cli.engine.pool import BlockPool

LAYERS, KV_HEADS, N, D = 16, 4, 4096, 64  # one layer's K + V: 8 MiB; the shard: 128 MiB


def _cache(n=N, fill=True):
    """A document's shard in a pool of its own (as the engine keeps them), ``n`` random tokens."""
    c = PagedShard(BlockPool(LAYERS, KV_HEADS, D, page=64, num_blocks=-(-n // 64) + 1), rank=0, world=1)
    if fill:
        for layer in range(LAYERS):
            c.append_chunk(layer, torch.randn(1, KV_HEADS, n, D), torch.randn(1, KV_HEADS, n, D), torch.arange(n))
        c.set_counts([n])
    return c


def _manifest(tmp):
    f = tmp / kvstore.shard_name(0, 0)
    return {
        "tokens": {"count": N},
        "shards": [{"file": f.name, "cp_index": 0, "tp_index": 0, "kv_heads": [0, KV_HEADS], "tokens": N}],
    }


def test_save_and_load_stream_one_layer_at_a_time(tmp_path):
    """Host memory added by saving a 128 MiB shard, and by loading it back, stays within about
    two layers (16 MiB) plus a little, not the shard; what comes back is what went in."""
    src = _cache()
    layer_bytes = 2 * KV_HEADS * N * D * 4
    _, grown = peak_anon_growth(
        lambda: kvstore.save_shard(tmp_path, src, cp_index=0, tp_index=0, head0=0), probes=[(kvstore, "_rows")]
    )  # memory read at every piece written
    assert grown <= 2 * layer_bytes + (8 << 20), (grown, layer_bytes)
    from safetensors import safe_open

    with safe_open(str(tmp_path / kvstore.shard_name(0, 0)), "pt") as f:  # a valid safetensors file
        assert torch.equal(f.get_tensor("k.3"), src.view(3)[0]) and torch.equal(f.get_tensor("pos"), torch.arange(N))
    dst = _cache(fill=False)  # (its pool is allocated: not what a load adds)
    _, grown = peak_anon_growth(
        lambda: kvstore.load_into(tmp_path, _manifest(tmp_path), dst, cp=1, cp_index=0, head0=0),
        probes=[(dst, "fill_layer")],
    )  # read as each layer's K/V arrive
    assert grown <= 2 * layer_bytes + (8 << 20), (grown, layer_bytes)
    for layer in (0, LAYERS - 1):
        assert torch.equal(dst.view(layer)[0], src.view(layer)[0])
        assert torch.equal(dst.view(layer)[1], src.view(layer)[1])
    assert dst.host_length.tolist() == [N] and torch.equal(dst.pos[0, :N], torch.arange(N))


@pytest.mark.parametrize(
    "name", ["../elsewhere.safetensors", "/etc/passwd", "sub/kv-c0-t0.safetensors", "..", "kv-c0-t0.safetensors\x00"]
)
def test_manifest_names_only_files_inside_the_cache(tmp_path, name):
    """A manifest whose shard entry points outside its directory (or anywhere but a plain file
    name in it) is refused with one line; the file it names is never opened."""
    src = _cache(n=8)
    d = tmp_path / "kv"
    d.mkdir()
    kvstore.save_shard(d, src, cp_index=0, tp_index=0, head0=0)
    ids = list(range(8))
    kvstore.finish_save(
        d,
        tmp_path / "saved",
        ids=ids,
        identity={"m": 1},
        dtype="float32",
        shapes={"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": D},
        mesh={"nproc": 1, "tp": 1, "cp": 1},
        composition={"kind": "raw"},
    )
    saved = tmp_path / "saved"
    m = json.loads((saved / kvstore.MANIFEST).read_text())
    assert kvstore.validate(
        saved, identity={"m": 1}, dtype="float32", shapes={"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": D}
    )
    (tmp_path / "elsewhere.safetensors").write_bytes((saved / m["shards"][0]["file"]).read_bytes())
    m["shards"][0]["file"] = name
    (saved / kvstore.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(kvstore.KVError, match="not a plain file name"):
        kvstore.validate(
            saved, identity={"m": 1}, dtype="float32", shapes={"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": D}
        )
