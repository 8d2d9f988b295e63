"""A saved sharded KV cache: one safetensors file per rank, a manifest, validation, re-sharding.

Layout of a saved cache directory::

    manifest.json           format, model identity, dtype, shapes, token count and hash,
                            the mesh it was saved from, how prompts continue it, the shard files
    tokens.safetensors      the token ids the cache holds (``ids [n]``, int64)
    kv-c{C}-t{T}.safetensors  one per rank: ``k.{layer}``, ``v.{layer}`` ``[1, H_kv/T, n_C, d]``
                            and their global positions ``pos [n_C]``; an fp8 cache adds the
                            scales ``ks.{layer}``, ``vs.{layer}`` ``[1, H_kv/T, n_C, G]`` (bf16)

The manifest's ``kv_dtype`` is how the rows are stored (``bfloat16``, ..., ``fp8_e4m3fn``,
``fp8_e4m3fnuz``; fp8 rows are in the rotated basis the manifest's ``rotation`` names). A run
with another ``--kv-dtype`` converts as it loads (fp8 rows dequantized and turned back, or
fresh rows rounded to this run's storage): the launcher says so in one line.

Positions are global, so a cache saved on one mesh loads onto another: each loading rank
takes the positions and KV heads that the new mesh gives it from whichever files hold them.
Writing goes to ``DIR.partial-<nonce>`` and is renamed into place once complete; nothing is
pickled. :func:`validate` checks everything a run can check cheaply before any rank starts
(missing or corrupt manifest, another model or dtype, missing, truncated or corrupt shards)
and raises :class:`KVError` with one line naming the problem.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import struct
import time
import zlib
from pathlib import Path

import torch

from .. import __version__
from ..parallel.ring import chunk_bounds

FORMAT = "treeattn-kv/1"
CHECKSUMS = "crc32"  # a shard file's metadata (JSON): {"rows": R, tensor: each block's CRC-32, 8 hex digits each}
CHECKED_ROWS = 256  # a checked block: this many rows (positions) of one tensor, every head (_Shard.read)
MANIFEST = "manifest.json"
TOKENS = "tokens.safetensors"


class KVError(ValueError):
    """A saved cache that cannot be used here; the message is one line for the user."""


def shard_name(cp_index: int, tp_index: int) -> str:
    return f"kv-c{cp_index}-t{tp_index}.safetensors"


def ids_sha256(ids) -> str:
    return hashlib.sha256(torch.as_tensor(list(ids), dtype=torch.int64).numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------- model identity

_VOLATILE = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "attn_implementation"}


def model_identity(model_dir) -> dict:
    """What makes two checkpoints the same model for a cache: the architecture (config, without
    bookkeeping keys) and a weights fingerprint (every weight file's header, size and 16 samples
    of its bytes; fast at any size)."""
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    arch = {k: v for k, v in cfg.items() if k not in _VOLATILE}
    h = hashlib.sha256()
    for f in sorted(list(d.glob("*.safetensors")) + list(d.glob("*.bin"))):
        size = f.stat().st_size
        h.update(f.name.encode() + str(size).encode())
        with open(f, "rb") as fh:
            if f.suffix == ".safetensors":
                n = struct.unpack("<Q", fh.read(8))[0]
                h.update(fh.read(min(n, 1 << 24)))
            for i in range(16):
                fh.seek(size * i // 16)
                h.update(fh.read(4096))
    return {
        "model_type": cfg.get("model_type"),
        "config_sha256": hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest(),
        "weights_fingerprint": h.hexdigest(),
    }


# ---------------------------------------------------------------- saving (on the ranks)

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
}
_FP8 = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3fnuz": torch.float8_e4m3fnuz}  # kv_dtype -> storage
KV_NAMES = ("float32", "bfloat16", "float16", *_FP8)


def kv_dtype_of(manifest: dict) -> str:
    """How a saved cache's rows are stored (caches saved before fp8 KV: the model's dtype)."""
    return manifest.get("kv_dtype") or manifest.get("dtype")


def conversion(manifest: dict, kv_name: str) -> str | None:
    """One line saying how a saved cache's rows become this run's storage ``kv_name``, or None."""
    saved = kv_dtype_of(manifest)
    if saved == kv_name:
        return None
    how = (
        "rounded to fp8 (lossy)"
        if kv_name in _FP8
        else "dequantized (exact to what was stored)"
        if saved in _FP8
        else f"cast to {kv_name}"
    )
    return f"the saved cache holds {saved} KV; this run stores {kv_name} (--kv-dtype): converted as it loads, {how}"


def _write_streamed(path: Path, entries, metadata: dict) -> None:
    """Write a safetensors file whose tensors come a piece at a time: ``entries`` is a list of
    ``(name, dtype, shape, pieces)`` where ``pieces()`` yields contiguous tensors (on any device)
    whose bytes, in order, are the tensor's. The header is known up front (shapes and dtypes),
    so the file is written front to back straight from the cache's own memory (a device cache
    through one pinned host buffer): a save adds no copy of the shard to the host, whatever its
    size. Each piece's first axis is the tensor's rows (positions: ``[n, d]`` of one head, or
    ``pos [n]``), and every block of :data:`CHECKED_ROWS` rows gets the CRC-32 of its bytes over
    the pieces in order (every head), so a reader checks the blocks it reads and no more."""
    import numpy as np

    R = CHECKED_ROWS
    blocks = {name: -(-_rows_of(shape) // R) for name, _, shape, _ in entries}

    def header(crcs: dict) -> bytes:  # (the checksums fixed-width: the header's length does not change)
        sums = {name: "".join(f"{c:08x}" for c in crcs.get(name, [0] * blocks[name])) for name, *_ in entries}
        out, off = {"__metadata__": {**metadata, CHECKSUMS: json.dumps({"rows": R, **sums}, separators=(",", ":"))}}, 0
        for name, dtype, shape, _ in entries:
            n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            out[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        blob = json.dumps(out, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        return struct.pack("<Q", len(blob)) + blob

    staging = None  # pinned host bytes a device piece is copied through, reused
    crcs = {}
    with open(path, "wb") as f:
        f.write(header({}))
        for name, _, shape, pieces in entries:
            crc = [0] * blocks[name]
            for t in pieces():
                nbytes = t.numel() * t.element_size()
                row = nbytes // max(1, _rows_of(shape))  # bytes of one row of the piece
                if t.device.type != "cpu":
                    if staging is None or staging.numel() < nbytes:
                        staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    staging[:nbytes].view(t.dtype).view(t.shape).copy_(t)
                    t = staging[:nbytes]
                data = np.asarray(t.view(torch.uint8).view(-1))
                for i in range(blocks[name]):
                    crc[i] = zlib.crc32(data[i * R * row : (i + 1) * R * row].data, crc[i])
                f.write(data.data)
            crcs[name] = crc
        f.seek(0)
        f.write(header(crcs))  # with every block's checksum, read back on every load (_Shard.read)
        f.flush()
        os.fsync(f.fileno())


def _rows_of(shape) -> int:
    """How many rows (positions) a saved tensor holds: ``[B, H, n, d]`` or ``pos [n]``."""
    return shape[2] if len(shape) == 4 else shape[0]


def _rows(t, n: int):
    """The bytes of ``t[:, :, :n]`` (``t [B, H, capacity, d]``, or a function returning it, called
    when the pieces are read) as contiguous pieces, no copy."""

    def pieces():
        nonlocal t
        t = t() if callable(t) else t
        for b in range(t.shape[0]):
            for h in range(t.shape[1]):
                yield t[b, h, :n]

    return pieces


def save_shard(tmp: Path, cache, *, cp_index: int, tp_index: int, head0: int) -> None:
    """This rank's shard into ``tmp`` (written to a temporary name, then renamed), streamed
    from the cache's memory (:func:`_write_streamed`)."""
    n = int(cache.host_length[0])
    shape = (cache.batch, cache.kv_heads, n, cache.head_dim)
    entries = []

    def part(i: int, j: int):  # one layer's K, V (fp8: and their scales), read when written
        return lambda: cache.layer_tensors(i)[j]

    for i in range(cache.num_layers):
        entries.append((f"k.{i}", cache.dtype, shape, _rows(part(i, 0), n)))
        entries.append((f"v.{i}", cache.dtype, shape, _rows(part(i, 1), n)))
        if cache.quant is not None:  # fp8: each row's scales, [B, H_kv, n, G] bf16
            sshape = shape[:3] + (cache.quant.groups,)
            entries.append((f"ks.{i}", torch.bfloat16, sshape, _rows(part(i, 2), n)))
            entries.append((f"vs.{i}", torch.bfloat16, sshape, _rows(part(i, 3), n)))
    entries.append(("pos", torch.int64, (n,), lambda: iter([cache.pos[0, :n]])))
    meta = {
        "cp_index": str(cp_index),
        "tp_index": str(tp_index),
        "kv_heads": f"{head0}:{head0 + cache.kv_heads}",
        "format": "pt",
    }
    final = tmp / shard_name(cp_index, tp_index)
    _write_streamed(Path(str(final) + ".tmp"), entries, meta)
    os.replace(str(final) + ".tmp", final)


def finish_save(
    tmp: Path,
    target: Path,
    *,
    ids,
    identity: dict,
    dtype: str,
    shapes: dict,
    mesh: dict,
    composition: dict,
    kv: dict | None = None,
    prefix: dict | None = None,
) -> dict:
    """Rank 0, after every rank wrote its shard: the token ids, the manifest, then the rename
    into place (an older cache at ``target`` is replaced only once the new one is complete).
    ``prefix``: how its document was prefilled (``{"salt", "digests"}``, ``block_reuse.plan``):
    a longer document starting with the same segments loads them from it (``copies.find_prefix``)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file({"ids": torch.as_tensor(list(ids), dtype=torch.int64)}, str(tmp / TOKENS))
    from ..paths import umask

    os.chmod(tmp / TOKENS, 0o666 & ~umask())  # safetensors writes 0600; the shards beside it follow the umask
    shards = []
    for f in sorted(tmp.glob("kv-c*-t*.safetensors")):
        with safe_open(str(f), "pt") as s:
            m = s.metadata()
            h0, h1 = map(int, m["kv_heads"].split(":"))
            n = s.get_slice("pos").get_shape()[0]
        shards.append(
            {
                "file": f.name,
                "cp_index": int(m["cp_index"]),
                "tp_index": int(m["tp_index"]),
                "kv_heads": [h0, h1],
                "tokens": n,
            }
        )
    manifest = {
        "format": FORMAT,
        "treeattn": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": identity,
        "dtype": dtype,
        **(kv or {"kv_dtype": dtype}),
        **shapes,
        "mesh": mesh,
        "composition": composition,
        "tokens": {"count": len(ids), "sha256": ids_sha256(ids)},
        "shards": shards,
        **({"prefix": prefix} if prefix else {}),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    old = None
    if target.exists():
        old = target.with_name(target.name + f".old-{os.getpid()}")
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return manifest


# ---------------------------------------------------------------- validation (before any rank)


def _check_safetensors(f: Path) -> dict:
    """The header of a complete safetensors file, or KVError naming what is wrong with it."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            if n > size:
                raise ValueError
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise KVError(f"saved cache: {f.name} is missing from {f.parent}") from None
    except (OSError, ValueError, struct.error):
        raise KVError(f"saved cache: {f} is corrupt (unreadable safetensors header)") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise KVError(f"saved cache: {f} is truncated or corrupt ({size} bytes, the header says {8 + n + end})")
    return header


def validate(kv_dir, *, identity: dict, dtype: str, shapes: dict) -> dict:
    """The manifest of the cache in ``kv_dir`` after checking it fits this run; KVError otherwise."""
    d = Path(kv_dir)
    if not d.is_dir():
        raise KVError(f"saved cache not found: {d}")
    try:
        m = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        raise KVError(f"{d} has no {MANIFEST}: not a saved treeattn cache, or its save did not finish") from None
    except (OSError, ValueError):
        raise KVError(f"{d / MANIFEST} is corrupt (not JSON)") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise KVError(f"{d / MANIFEST}: not a {FORMAT} manifest")
    if m.get("model") != identity:
        saved = (m.get("model") or {}).get("model_type")
        raise KVError(
            f"{d} was saved from another model ({saved}, config or weights differ from "
            f"{identity.get('model_type')} here)"
        )
    if m.get("dtype") != dtype:
        raise KVError(f"{d} holds a {m.get('dtype')} cache; this run is {dtype} (pass --dtype {m.get('dtype')})")
    for key in ("layers", "kv_heads", "head_dim"):
        if m.get(key) != shapes[key]:
            raise KVError(f"{d}: {key} {m.get(key)} does not match the model's {shapes[key]}")
    kv = kv_dtype_of(m)
    if kv not in KV_NAMES:
        raise KVError(f"{d} holds KV stored as {str(kv)[:40]!r}, which this version cannot read")
    fp8 = kv in _FP8
    if fp8:
        from .kvquant import rotation_name

        from .kvdtypes import scale_groups

        if m.get("rotation") != rotation_name(shapes["head_dim"]) or m.get("scale_groups") != scale_groups(
            shapes["head_dim"]
        ):
            raise KVError(
                f"{d}: its fp8 rows are in a basis or scale layout this version does not know "
                f"({str(m.get('rotation'))[:40]}, {str(m.get('scale_groups'))[:8]} scales per row)"
            )
    ids = load_ids(d)
    if len(ids) != m["tokens"]["count"] or ids_sha256(ids) != m["tokens"]["sha256"]:
        raise KVError(f"{d / TOKENS} does not match the manifest's token count and hash")
    covered = 0
    for s in m["shards"]:
        if not _plain_name(s.get("file")):  # only files of this directory are ever read
            raise KVError(f"{d / MANIFEST}: shard {str(s.get('file'))[:80]!r} is not a plain file name in {d}")
        header = _check_safetensors(d / s["file"])
        kinds = ("k", "v", "ks", "vs") if fp8 else ("k", "v")
        want = {f"{kind}.{i}" for kind in kinds for i in range(shapes["layers"])} | {"pos"}
        if not want <= set(header):
            raise KVError(f"saved cache: {s['file']} lacks tensors {sorted(want - set(header))[:3]}")
        if header["pos"]["shape"] != [s["tokens"]] or header["k.0"]["shape"][2] != s["tokens"]:
            raise KVError(f"saved cache: {s['file']} does not match the manifest")
        if s["tp_index"] == 0:
            covered += s["tokens"]
    if covered != m["tokens"]["count"]:
        raise KVError(f"{d}: the shards hold {covered} positions, the manifest {m['tokens']['count']}")
    return m


def _plain_name(name) -> bool:
    """A file name of the cache directory itself: no separator, no parent, nothing odd."""
    import re

    return (
        isinstance(name, str)
        and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}", name) is not None
        and ".." not in name
    )


def load_ids(d: Path) -> list[int]:
    from safetensors.torch import load_file

    _check_safetensors(Path(d) / TOKENS)
    try:
        return load_file(str(Path(d) / TOKENS))["ids"].tolist()
    except Exception:
        raise KVError(f"{Path(d) / TOKENS} is corrupt") from None


# ---------------------------------------------------------------- loading (on the ranks)


def as_saved(manifest: dict, cp: int) -> bool:
    """Whether a saved cache goes back onto ``cp`` sequence shards as it was cut: saved from
    as many, each rank then takes its own shard whole, in its order (a document that left memory
    comes back bit for bit what it was: the same keys on the same ranks, so every answer over it
    is the one it gave before, issue 49); else the positions are cut again (:func:`shard_counts`)."""
    return (
        sorted({s["cp_index"] for s in manifest["shards"]}) == list(range(cp))
        and manifest.get("mesh", {}).get("cp") == cp
    )


def shard_counts(manifest: dict, cp: int) -> list[int]:
    """Every rank's tokens once a saved cache is loaded onto ``cp`` sequence shards: each saved
    shard's (:func:`as_saved`), or contiguous balanced chunks of the positions."""
    if as_saved(manifest, cp):
        n = {s["cp_index"]: s["tokens"] for s in manifest["shards"]}
        return [n[c] for c in range(cp)]
    b = chunk_bounds(manifest["tokens"]["count"], cp)
    return [b[i + 1] - b[i] for i in range(cp)]


class _Shard:
    """A saved shard file open for reading, its checksums parsed once; KVError when it cannot be
    opened (cut or removed since it was validated)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path, self.f = path, None
        try:
            self.f = safe_open(str(path), "pt").__enter__()
            sums = json.loads((self.f.metadata() or {}).get(CHECKSUMS, "{}"))
        except Exception as e:
            self.close()
            raise KVError(f"saved cache: {path} is unreadable ({_why(e)})") from None
        self.rows = sums.pop("rows", None)  # None: one checksum per tensor (files saved before blocks)
        self.sums = sums  # tensor -> its blocks' CRC-32s, 8 hex digits each (none: saved before checksums)

    def read(self, name: str, upto: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (``[B, H, n, d]`` or ``pos [n]``), its rows ``[0, upto)`` (None: all), after
        checking the bytes of every block it reads against their CRC-32s (only those blocks are
        read); KVError naming the file, tensor and block when they differ or cannot be read."""
        try:
            sl = self.f.get_slice(name)
            shape = sl.get_shape()
            n = _rows_of(shape)
            R = self.rows or max(1, n)
            z = n if upto is None else min(n, -(-upto // R) * R)  # whole blocks
            t = sl[:, :, :z, :] if len(shape) == 4 else sl[:z]
        except Exception as e:  # (safetensors' errors: a file cut or changed since it was validated)
            raise KVError(f"saved cache: {self.path} is unreadable ({name}: {_why(e)})") from None
        want = self.sums.get(name)
        if want is not None:
            heads = [t[b, h] for b in range(t.shape[0]) for h in range(t.shape[1])] if t.dim() == 4 else [t]
            for i in range(-(-z // R)):
                crc = 0
                for x in heads:
                    crc = zlib.crc32(x[i * R : (i + 1) * R].contiguous().view(torch.uint8).numpy().data, crc)
                if f"{crc:08x}" != want[8 * i : 8 * i + 8]:
                    where = f", block {i} (rows {i * R}-{min(n, (i + 1) * R) - 1})" if -(-n // R) > 1 else ""
                    raise KVError(
                        f"saved cache: {self.path} is corrupt ({name}{where}: its bytes do not match their checksum)"
                    )
        return t if upto is None or upto == z else (t[:, :, :upto] if t.dim() == 4 else t[:upto])

    def close(self) -> None:
        if self.f is not None:
            self.f.__exit__(None, None, None)
            self.f = None


def _why(e: Exception) -> str:
    return str(e).splitlines()[0][:80] if str(e) else type(e).__name__


def load_into(
    kv_dir, manifest: dict, cache, *, cp: int, cp_index: int, head0: int, upto: list[int] | None = None
) -> list[int]:
    """Fill ``cache`` with this rank's part of a saved cache under the current mesh: its own
    saved shard where the cache was saved on as many sequence shards (:func:`as_saved`), else
    positions ``chunk_bounds(n, cp)[cp_index]`` (contiguous, balanced); KV heads ``head0 ..
    head0 + cache.kv_heads``, taken from whichever saved shards hold them, one layer at a time
    (the host holds one layer of a saved file, never the part whole), each block checked
    against its checksum as it is read (:meth:`_Shard.read`: KVError when one differs).
    ``upto``: every rank's tokens of a prefix of the saved shards to load, not all (a longer
    document's first segments, :func:`prefix_of`; as saved only). Returns every rank's token
    count (the same on all ranks)."""
    d = Path(kv_dir)
    n = manifest["tokens"]["count"]
    b = chunk_bounds(n, cp)
    lo, hi = b[cp_index], b[cp_index + 1]
    own = as_saved(manifest, cp)
    assert upto is None or own, "a prefix loads onto the mesh it was saved from"
    mine = None if upto is None else upto[cp_index]
    h0, h1 = head0, head0 + cache.kv_heads
    saved = kv_dtype_of(manifest)
    quant = cache.quant
    raw = quant is not None and quant.name == saved  # fp8 rows copied as stored, with their scales
    restore = None  # saved fp8 rows this cache stores otherwise: back to the model's basis first
    if saved in _FP8 and not raw:
        from .kvquant import KVQuant

        restore = KVQuant(cache.head_dim, "cpu", _FP8[saved])
    by_cp: dict[int, list] = {}
    for s in manifest["shards"]:
        by_cp.setdefault(s["cp_index"], []).append(s)
    sources = []  # per saved sequence shard: (its files holding my heads, contiguous read [a, z), picks)
    pos_parts = []
    for c in sorted(by_cp):
        if own and c != cp_index:
            continue
        entries = sorted(
            (s for s in by_cp[c] if s["kv_heads"][0] < h1 and s["kv_heads"][1] > h0), key=lambda s: s["kv_heads"][0]
        )
        f = _Shard(d / entries[0]["file"])
        try:
            pos = f.read("pos", mine)
        finally:
            f.close()
        idx = torch.arange(pos.numel()) if own else ((pos >= lo) & (pos < hi)).nonzero().flatten()
        if idx.numel() == 0:
            continue
        a, z = int(idx[0]), int(idx[-1]) + 1
        sources.append((entries, a, z, idx - a))  # the selected positions inside the read [a, z)
        pos_parts.append(pos[idx])
    pos = torch.cat(pos_parts) if pos_parts else torch.zeros(0, dtype=torch.int64)
    # keys in position order (the kernels skip whole blocks by position; a shard as saved is in it already)
    order = torch.arange(pos.numel()) if own else torch.argsort(pos)
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel())  # where each selected position goes in the shard
    counts = shard_counts(manifest, cp) if upto is None else list(upto)
    cache.begin_fill(pos[order], counts)
    first = 0
    with contextlib.ExitStack() as stack:
        for entries, a, z, span in sources:  # each saved piece straight into its slots and heads
            files = [_Shard(d / s["file"]) for s in entries]
            for f in files:
                stack.callback(f.close)
            slots = slot[first : first + span.numel()]
            first += span.numel()
            whole = span.numel() == z - a
            for layer in range(cache.num_layers):
                for s, f in zip(entries, files):
                    s0 = max(h0, s["kv_heads"][0]) - s["kv_heads"][0]
                    s1 = min(h1, s["kv_heads"][1]) - s["kv_heads"][0]
                    at = slice(s["kv_heads"][0] + s0 - h0, s["kv_heads"][0] + s1 - h0)  # my heads it holds
                    k = f.read(f"k.{layer}", mine)[:, s0:s1, a:z, :]
                    v = f.read(f"v.{layer}", mine)[:, s0:s1, a:z, :]
                    scales = None
                    if saved in _FP8:
                        scales = (
                            f.read(f"ks.{layer}", mine)[:, s0:s1, a:z, :],
                            f.read(f"vs.{layer}", mine)[:, s0:s1, a:z, :],
                        )
                    if not whole:
                        k, v = k[:, :, span], v[:, :, span]
                        scales = scales and (scales[0][:, :, span], scales[1][:, :, span])
                    if restore is not None:
                        k, v, scales = restore.restore(k, scales[0]), restore.restore(v, scales[1]), None
                    cache.fill_layer(layer, k, v, slots, at, scales=scales if raw else None)
                    del k, v, scales
    return counts
