"""Saved caches on disk: streamed layer by layer (host memory of a save or load stays near one
layer, not the shard), and nothing outside the cache directory is ever read."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import peak_anon_growth
from treeattn_cli.storage import kvstore
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


def _saved(tmp, n):
    """A shard of ``n`` random tokens saved to ``tmp`` (kvstore's own write), and the cache it came from."""
    src = _cache(n=n)
    kvstore.save_shard(tmp, src, cp_index=0, tp_index=0, head0=0)
    return src, tmp / kvstore.shard_name(0, 0)


def _flip(path, name, head, row):
    """One bit of tensor ``name``'s ``row`` of KV head ``head`` flipped in the file at ``path``."""
    import struct

    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    entry = json.loads(data[8 : 8 + n])[name]
    rows = entry["shape"][2]
    at = 8 + n + entry["data_offsets"][0] + ((head * rows + row) * D + 5) * 4
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_damaged_block_is_found_by_its_own_checksum_and_a_prefix_reads_only_its_blocks(tmp_path):
    """Each block of CHECKED_ROWS rows of a saved tensor carries its own CRC-32 (issue 52): a
    flipped bit in block 2 of ``k.5`` (head 1) is named with its rows when the whole shard
    loads, while a prefix that ends before block 2 (a longer document's first segments) loads
    and is what was saved."""
    R = kvstore.CHECKED_ROWS
    n = 3 * R + 10
    src, path = _saved(tmp_path, n)
    _flip(path, "k.5", head=1, row=2 * R + 3)
    man = {
        "tokens": {"count": n},
        "mesh": {"cp": 1},
        "shards": [{"file": path.name, "cp_index": 0, "tp_index": 0, "kv_heads": [0, KV_HEADS], "tokens": n}],
    }
    with pytest.raises(kvstore.KVError, match=rf"k\.5, block 2 \(rows {2 * R}-{3 * R - 1}\): its bytes do not match"):
        kvstore.load_into(tmp_path, man, _cache(n=n, fill=False), cp=1, cp_index=0, head0=0)
    dst = _cache(n=n, fill=False)
    assert kvstore.load_into(tmp_path, man, dst, cp=1, cp_index=0, head0=0, upto=[2 * R - 7]) == [2 * R - 7]
    assert dst.host_length.tolist() == [2 * R - 7]
    for layer in (0, 5):
        assert torch.equal(dst.view(layer)[0], src.view(layer)[0][:, :, : 2 * R - 7])
        assert torch.equal(dst.view(layer)[1], src.view(layer)[1][:, :, : 2 * R - 7])


def test_a_file_with_one_checksum_per_tensor_still_loads_and_is_checked(tmp_path):
    """Shards saved before blocks (one CRC-32 per tensor, no ``rows``) load as one block each."""
    import zlib

    from safetensors.torch import load_file, save_file

    src, path = _saved(tmp_path, 40)
    tensors = load_file(str(path))
    sums = {k: f"{zlib.crc32(t.contiguous().view(torch.uint8).numpy().data):08x}" for k, t in tensors.items()}
    save_file(
        tensors,
        str(path),
        metadata={
            "cp_index": "0",
            "tp_index": "0",
            "kv_heads": f"0:{KV_HEADS}",
            "format": "pt",
            kvstore.CHECKSUMS: json.dumps(sums),
        },
    )
    man = {
        "tokens": {"count": 40},
        "mesh": {"cp": 1},
        "shards": [{"file": path.name, "cp_index": 0, "tp_index": 0, "kv_heads": [0, KV_HEADS], "tokens": 40}],
    }
    dst = _cache(n=40, fill=False)
    kvstore.load_into(tmp_path, man, dst, cp=1, cp_index=0, head0=0)
    assert torch.equal(dst.view(3)[0], src.view(3)[0])
    _flip(path, "v.2", head=0, row=7)
    with pytest.raises(kvstore.KVError, match=r"\(v\.2: its bytes do not match their checksum\)"):
        kvstore.load_into(tmp_path, man, _cache(n=40, fill=False), cp=1, cp_index=0, head0=0)
