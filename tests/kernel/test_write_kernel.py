"""Keys and values into the block pool in one launch (``treeattn_kernels.write_triton``, issue 51
item 2) against its torch reference (``write_ref``: what ``BlockPool.write`` did before), Triton
interpreted here with a GPU's rounding (``interpreted.round_as_gpus_do``): a plain store and an
fp8 store of unrotated rows bit for bit; rotated rows bit for bit but where the rotation's fp32
sums, in another order, land on the other side of a rounding (one code, rarely); a token's bytes
its own in any batch; on the GPU's branches the pool's write is one launch a layer."""

from __future__ import annotations

import collections

import pytest
import torch

pytest.importorskip("triton")

from treeattn_kernels import write_kv, write_kv_ref  # noqa: E402
from treeattn_kernels.write_triton import writable  # noqa: E402

BLOCKS, PAGE = 5, 16


def _rows(n, H, d, seed):
    g = torch.Generator().manual_seed(seed)
    size = torch.logspace(-3, 2, n * H * d)[torch.randperm(n * H * d, generator=g)].reshape(n, H, d)  # of every size
    return torch.randn(n, H, d, generator=g) * size, torch.randn(n, H, d, generator=g) * 3


def _stores(H, d, dtype, fp8: bool):
    k, v = torch.zeros(BLOCKS, H, PAGE, d, dtype=dtype), torch.zeros(BLOCKS, H, PAGE, d, dtype=dtype)
    if not fp8:
        return k, v, None, None
    return k, v, *(torch.zeros(BLOCKS, H, PAGE, d // 32, dtype=torch.bfloat16) for _ in range(2))


def _write(impl, rows, slots, dtype, rotation=None):
    k, v = rows
    stores = _stores(k.shape[1], k.shape[2], dtype, rotation is not None)
    write_kv(*stores[:2], slots, k, v, *stores[2:], rotation, impl=impl)
    return [_bits(s) for s in stores if s is not None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_plain_write_is_the_reference_bit_for_bit(dtype):
    rows = _rows(19, 3, 64, 1)
    slots = torch.randperm(BLOCKS * PAGE, generator=torch.Generator().manual_seed(2))[:19]
    for got, want in zip(_write("triton", rows, slots, dtype), _write("torch", rows, slots, dtype)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("d,H", [(64, 3), (128, 8)])
def test_an_fp8_write_is_the_reference(fp8, d, H):
    """Unrotated (the identity: its sums are exact in any order): every code and scale the
    reference's. Rotated (Hadamard): the same but for a code where the fp32 sums round apart."""
    from treeattn_cli.storage.kvquant import rotation

    rows = _rows(21, H, d, d)
    slots = torch.randperm(BLOCKS * PAGE, generator=torch.Generator().manual_seed(3))[:21]
    got = _write("triton", rows, slots, fp8, torch.eye(d))
    want = _write("torch", rows, slots, fp8, torch.eye(d))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    got = _write("triton", rows, slots, fp8, rotation(d))
    want = _write("torch", rows, slots, fp8, rotation(d))
    for a, b in zip(got, want):
        same = (a == b).float().mean().item()
        assert same >= 0.999, same


def test_a_tokens_bytes_are_its_own_in_any_batch():
    from treeattn_cli.storage.kvquant import rotation

    rows = _rows(12, 8, 128, 5)
    slots = torch.arange(12) * 3 + 1
    together = _write("triton", rows, slots, torch.float8_e4m3fn, rotation(128))
    alone = _stores(8, 128, torch.float8_e4m3fn, True)
    for i in range(12):
        one = slice(i, i + 1)
        write_kv(*alone[:2], slots[one], rows[0][one], rows[1][one], *alone[2:], rotation(128), impl="triton")
    alone = [_bits(s) for s in alone]
    for a, b in zip(together, alone):
        assert torch.equal(a, b)


@pytest.mark.parametrize("H", [8, 20])  # one tile of heads, and two (16 + 4)
def test_a_prefill_attends_the_bits_the_write_stores(H, monkeypatch):
    """On the GPU's branches ``KVQuant.quantize`` (what ``pool.as_stored`` rounds a prefill's
    fresh keys with) runs the write's own kernel: for the same rows, the bits the pool holds."""
    from treeattn_kernels import quantize

    from treeattn_cli.storage.kvquant import KVQuant, rotation

    d = 128
    k, v = _rows(7, H, d, H)
    slots = torch.arange(7) * 5 + 2
    stores = [torch.zeros(BLOCKS * 4, H, PAGE, d, dtype=torch.float8_e4m3fn) for _ in range(2)]
    scales = [torch.zeros(BLOCKS * 4, H, PAGE, d // 32, dtype=torch.bfloat16) for _ in range(2)]
    write_kv(*stores, slots, k, v, *scales, rotation(d), impl="triton")
    from treeattn_kernels import targets

    monkeypatch.setenv("TREEATTN_KERNEL", "triton")  # (the GPU's branches)
    for x, store, scale in ((k, stores[0], scales[0]), (v, stores[1], scales[1])):
        targets._state["counted"] = []
        try:
            x8, s = KVQuant(d, "cpu").quantize(x)
            launched = targets._state["counted"]
        finally:
            targets._state["counted"] = None
        assert launched == ["_write_kernel"], launched  # the write's kernel rounded them (the interpreter's
        # sums may agree with torch's: which path ran is what a GPU's bits depend on)
        b, o = slots // PAGE, slots % PAGE
        assert torch.equal(_bits(x8), _bits(store[b, :, o])) and torch.equal(_bits(s), _bits(scale[b, :, o]))
    x8, s = quantize(k, torch.eye(d), torch.float8_e4m3fn, d // 32, impl="triton")  # unrotated: the reference's
    r8, rs = quantize(k, torch.eye(d), torch.float8_e4m3fn, d // 32, impl="torch")
    assert torch.equal(_bits(x8), _bits(r8)) and torch.equal(_bits(s), _bits(rs))


def test_shapes_the_kernel_does_not_take_go_to_the_reference():
    k = torch.zeros(3, 2, 96)
    assert not writable(torch.zeros(BLOCKS, 2, PAGE, 96), k)  # d = 96: not a power of two
    assert writable(torch.zeros(BLOCKS, 2, PAGE, 64), torch.zeros(3, 2, 64))
    rows = _rows(4, 2, 96, 9)
    slots = torch.tensor([0, 5, 17, 40])
    got = _write("triton", rows, slots, torch.bfloat16)  # (the reference, through write_kv)
    stores = _stores(2, 96, torch.bfloat16, False)
    write_kv_ref(*stores[:2], slots, *rows)
    assert torch.equal(got[0], stores[0].view(torch.int16))
    strided = torch.randn(4, 2, 128)[..., ::2]  # rows of stride 2 along d: the reference takes them
    assert not writable(torch.zeros(BLOCKS, 2, PAGE, 64), strided)
    stores = _stores(2, 64, torch.bfloat16, False)
    write_kv(*stores[:2], slots, strided, strided, impl="triton")
    assert torch.equal(stores[0][slots // PAGE, :, slots % PAGE], strided.to(torch.bfloat16))


def test_an_fp8_pool_write_is_one_launch_on_the_gpus_branches(monkeypatch):
    """``BlockPool.write`` of an fp8 pool on the GPU's branches: one Triton launch and no other
    device operation (the torch path: ~34 a layer), the pool holding the reference's bytes."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from treeattn_kernels import targets

    from treeattn_cli.bench.census import _launches
    from treeattn_cli.engine.pool import BlockPool
    from treeattn_cli.storage.kvquant import KVQuant

    quant = KVQuant(128, "cpu")
    pools = [BlockPool(1, 8, 128, page=PAGE, num_blocks=BLOCKS, dtype=quant.dtype, quant=quant) for _ in range(2)]
    k, v = _rows(3, 8, 128, 4)
    slots = torch.tensor([2, 17, 33])

    class Count(TorchDispatchMode):
        ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = len(targets._state["counted"])
            out = func(*args, **(kwargs or {}))
            if _launches(func) and len(targets._state["counted"]) == before:
                self.ops[func.overloadpacket.__name__] += 1
            return out

    monkeypatch.setenv("TREEATTN_KERNEL", "triton")
    targets._state["counted"] = []
    try:
        with Count():
            pools[0].write(0, slots, k, v)
        launched = list(targets._state["counted"])
    finally:
        targets._state["counted"] = None
    assert launched == ["_write_kernel"] and not Count.ops, (launched, Count.ops)
    monkeypatch.delenv("TREEATTN_KERNEL")
    pools[1].write(0, slots, k, v)  # the CPU's path: the reference
    for name in ("k", "v", "ks", "vs"):
        a, b = (_bits(getattr(p, name)[0]) for p in pools)
        assert (a == b).float().mean().item() >= 0.999, name


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
