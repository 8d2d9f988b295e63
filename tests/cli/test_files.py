"""Files a user shares get the permissions the user's umask gives, as ``open()`` would, however
they are written (atomically through a temporary file, or by safetensors): ``--output``, bench's
``--csv`` and ``--plot``, and every file of a saved KV directory (issue 39, item 1)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from treeattn_cli import paths, report
from treeattn_cli.storage import kvstore
from treeattn_cli.engine.paged_shard import PagedShard
from treeattn_cli.engine.pool import BlockPool


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_umask_is_read_without_changing_it(umask):
    assert paths.umask() == umask and paths.umask() == umask


def test_atomic_writes_follow_the_umask(tmp_path, umask):
    want = 0o666 & ~umask
    paths.write_atomic(tmp_path / "answer.txt", "text")
    recs = [{"method": "tree", "scheme": "allreduce", "nproc": 2, "seq_len": 1024, "step_ms_median": 1.0}]
    report.write_csv(recs, tmp_path / "bench.csv")
    pytest.importorskip("matplotlib")
    report.write_plot(recs, tmp_path / "bench.png")
    with open(tmp_path / "plain.txt", "w"):  # what open() gives, for comparison
        pass
    for name in ("answer.txt", "bench.csv", "bench.png", "plain.txt"):
        assert _mode(tmp_path / name) == want, (name, oct(_mode(tmp_path / name)), oct(want))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".treeattn-")]  # no temporary left


def test_a_saved_cache_is_readable_as_a_whole(tmp_path, umask):
    """The shards and the token ids and the manifest: one mode for all (safetensors writes 0600)."""
    c = PagedShard(BlockPool(2, 2, 8, page=8, num_blocks=2), rank=0, world=1)
    for layer in range(2):
        c.append_chunk(layer, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.arange(5))
    tmp, target = tmp_path / "saving", tmp_path / "saved"
    tmp.mkdir()
    kvstore.save_shard(tmp, c, cp_index=0, tp_index=0, head0=0)
    kvstore.finish_save(
        tmp,
        target,
        ids=[1, 2, 3, 4, 5],
        identity={"name": "m"},
        dtype="float32",
        shapes={"layers": 2},
        mesh={"cp": 1, "tp": 1},
        composition={"kind": "raw"},
    )
    files = sorted(p.name for p in target.iterdir())
    assert kvstore.TOKENS in files and kvstore.MANIFEST in files and any(f.startswith("kv-c0-t0") for f in files)
    modes = {f: _mode(target / f) for f in files}
    assert set(modes.values()) == {0o666 & ~umask}, {f: oct(m) for f, m in modes.items()}
