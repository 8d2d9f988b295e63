"""--kv-dtype (issue 27): fp8 KV rounded as kvquant.py says and attended exactly as stored on every
route and mesh (oracle: transformers' own attention on keys and values rounded the same way);
other storage dtypes; saved fp8 caches re-sharded and converted; the fidelity check; the bytes."""

from __future__ import annotations

import json
import math

import pytest
import torch

import ranks
from helpers import assert_usage_error, attention_f64, cli, copying_question
from treeattn_cli.engine.pool import BlockPool
from treeattn_cli.engine.job import EngineJob
from treeattn_cli.storage.kvdtypes import token_bytes
from treeattn_cli.storage.kvquant import KVQuant, rotation
from treeattn_cli.engine.sampling import Sampling
from treeattn_cli.parallel.launch import run_local
from treeattn_cli.verify import tiny as tiny_models
from treeattn_kernels import dequantize, partial_attention

NEW = 5
DOC = [(13 * i + 5) % 230 + 20 for i in range(47)]


def _cont(k: int) -> list[int]:
    return [(29 * i + 11) % 230 + 20 for i in range(k)]


@pytest.fixture(scope="module")
def models(tiny):
    return {
        "llama": tiny("llama", seed=3, head_dim=64),  # 2 scales per row
        "gemma2": tiny("gemma2", seed=4),
    }  # window + softcap, d 16: 1 scale


# ---------------------------------------------------------------- the quantizer and the kernels


@pytest.mark.parametrize("d", [64, 48, 16])
def test_rotation_is_orthogonal_so_scores_are_unchanged(d):
    r = rotation(d).double()
    assert torch.allclose(r @ r.t(), torch.eye(d, dtype=torch.float64), atol=1e-6)
    if d & (d - 1) == 0:  # Hadamard: every entry +-1/sqrt(d)
        assert torch.allclose(r.abs(), torch.full((d, d), 1 / math.sqrt(d), dtype=torch.float64), atol=1e-7)
    q, k = torch.randn(5, d, dtype=torch.float64), torch.randn(7, d, dtype=torch.float64)
    off = (r @ r.t() - torch.eye(d, dtype=torch.float64)).abs().max()  # fp32 rotation: ~1e-7, not 0
    bound = d * off * q.abs().max() * k.abs().max() + 1e-12  # |q (R R^T - I) k^T| at most this
    assert torch.allclose((q @ r) @ (k @ r).t(), q @ k.t(), rtol=0, atol=float(bound))


@pytest.mark.parametrize("d,groups", [(128, 4), (64, 2), (48, 1)])
def test_quantize_keeps_every_group_within_e4m3_precision(d, groups):
    """Each group of a row is scaled so its largest magnitude lands at 448 (scales rounded up to
    bf16: nothing clips); every element then carries e4m3's 3 mantissa bits: the error of the
    rotated row is at most 2^-4 of its value, or of the group's subnormal step near zero."""
    quant = KVQuant(d, "cpu")
    assert quant.groups == groups
    x = torch.randn(3, 4, 50, d) * torch.linspace(0.01, 30, 50)[:, None]
    x[..., 3] *= 40  # an outlier channel: the rotation spreads it
    x8, s = quant.quantize(x)
    assert x8.dtype == torch.float8_e4m3fn and s.dtype == torch.bfloat16 and s.shape == (3, 4, 50, groups)
    xr = (x.float() @ quant.r).unflatten(-1, (groups, -1))
    amax = xr.abs().amax(-1)
    assert (s.float() * 448 >= amax * (1 - 2**-12)).all() and (s.float() * 448 <= amax * (1 + 2**-6)).all()
    got = dequantize(x8, s).unflatten(-1, (groups, -1))
    step = s.float()[..., None] * 2**-9  # e4m3's smallest subnormal, in the group's scale
    assert ((got - xr).abs() <= torch.maximum(xr.abs() * 2**-4, step)).all()
    back = quant.restore(x8, s)  # [.., d] in the model's basis again
    assert torch.allclose(back, quant.roundtrip(x), atol=1e-6)
    assert (back - x).norm() <= 0.05 * x.norm()
    again8, again = quant.quantize(back)  # what the cache holds quantizes to itself (prefill attends, then stores)
    assert torch.equal(again, s) and torch.equal(again8.float(), x8.float())


@pytest.mark.parametrize("impl", ["torch", "aten"])
def test_partial_attention_on_fp8_rows_is_attention_on_their_values(impl):
    """The kernels read fp8 rows with their scales as the values those rows stand for: ragged
    lengths, GQA, a window and a softcap, against the float64 oracle on the dequantized rows."""
    B, H, Hk, Q, N, d = 2, 4, 2, 3, 37, 64
    quant = KVQuant(d, "cpu")
    q = torch.randn(B, H, Q, d)
    (k8, ks), (v8, vs) = quant.quantize(torch.randn(B, Hk, N, d) * 3), quant.quantize(torch.randn(B, Hk, N, d))
    kv_len = torch.tensor([N, 20])
    q_pos, k_pos = torch.arange(40, 40 + Q), torch.arange(N).expand(B, N)
    o, lse = partial_attention(
        q,
        k8,
        v8,
        k_scale=ks,
        v_scale=vs,
        kv_len=kv_len,
        q_pos=q_pos,
        k_pos=k_pos,
        window=25,
        softcap=20.0,
        impl=impl,
        out_dtype=torch.float32,
    )
    k, v = dequantize(k8, ks), dequantize(v8, vs)
    mask = (
        (torch.arange(N)[None, None] < kv_len[:, None, None])
        & (k_pos[:, None] > q_pos[None, :, None] - 25)
        & (k_pos[:, None] <= q_pos[None, :, None])
    )
    want_o, want_l = attention_f64(q, k, v, mask=mask, softcap=20.0)
    assert torch.allclose(o.double(), want_o, atol=1e-4) and torch.allclose(lse.double(), want_l, atol=1e-4)


@pytest.mark.parametrize("d", [64, 128])
def test_fp8_kv_takes_at_most_055_of_bf16_scales_included(d):
    """The issue's bound, for the cache as allocated and for the projections' formula alike."""
    fp8 = BlockPool(4, 2, d, page=64, num_blocks=2, quant=KVQuant(d, "cpu"))
    bf16 = BlockPool(4, 2, d, page=64, num_blocks=2, dtype=torch.bfloat16)
    assert fp8.bytes_per_token() <= 0.55 * bf16.bytes_per_token()
    assert fp8.bytes_per_token() == token_bytes("fp8", 4, 2, d) and bf16.bytes_per_token() == token_bytes(
        "bfloat16", 4, 2, d
    )
    assert fp8.nbytes() <= 0.55 * bf16.nbytes()


# ---------------------------------------------------------------- one rank against transformers


def _hf_logits(model_dir, ids, kv_round=None):
    from transformers import AutoModelForCausalLM

    attn = tiny_models.rounded_attention(kv_round) if kv_round is not None else "eager"
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    with torch.inference_mode():
        return m(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()  # [T, V]


@pytest.mark.parametrize("kind,kv", [("llama", "fp8"), ("gemma2", "fp8"), ("llama", "bfloat16")])
def test_one_rank_logits_are_transformers_on_rounded_kv(models, kind, kv):
    """A prefill in two segments (the second meets the stored cache) and decode steps on one
    rank, through the engine as commands run them (the document in the block pool, the answer a
    batch of one), equal transformers' eager attention fed keys and values rounded as stored, and
    differ from it fed full-precision ones by far more: the pool really stores, and reads, rounded
    rows. Every step's whole distribution is compared (``logprobs`` of the whole vocabulary)."""
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.job import EngineJob
    from treeattn_cli.storage.kvquant import storage
    from treeattn_cli.engine.attention import register
    from treeattn_cli.model.load import load_model, shapes
    from treeattn_cli.engine.sampling import Sampling
    from treeattn_cli.parallel.launch import RankContext

    model_dir = models[kind]
    sh = shapes(load_model(model_dir, torch.float32, torch.device("cpu"), attention=register()).config)
    _, quant, _ = storage(kv, torch.float32, "cpu", sh["head_dim"])
    got = {}
    ctx = RankContext(
        rank=0,
        world=1,
        local_rank=0,
        backend="gloo",
        device="cpu",
        timeout_s=60.0,
        emit=lambda kind, p: got.__setitem__("rec", p) if kind == "answer" else None,
    )
    job = EngineJob(str(model_dir), [], dtype="float32", kv_dtype=kv, speculate="off")
    ids = DOC[:24]
    Engine(ctx, job).serve(
        [
            {"op": "append", "ids": ids, "piece": 12},
            {"op": "decode", "max_new_tokens": 6, "sampling": vars(Sampling()), "logprobs": tiny_models.VOCAB},
            {"op": "stop"},
        ]
    )
    rec = got["rec"]
    ids = ids + rec["token_ids"][:5]
    out = torch.full((6, tiny_models.VOCAB), float("-inf"))
    for i, lp in enumerate(rec["logprobs"]):
        top = torch.tensor(lp["top"], dtype=torch.float64)  # [V, 2]: (id, logprob)
        out[i, top[:, 0].long()] = top[:, 1].float()
    got = out  # log-probabilities after positions 23 .. 28
    rnd = quant.roundtrip if quant is not None else (lambda x: x.to(torch.bfloat16).float())
    want = torch.log_softmax(_hf_logits(model_dir, ids, rnd)[23:29], -1)
    plain = torch.log_softmax(_hf_logits(model_dir, ids)[23:29], -1)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 2e-4 * scale, (got - want).abs().max() / scale
    assert (plain - want).abs().max() >= 20 * max((got - want).abs().max(), 1e-6 * scale)


# ---------------------------------------------------------------- every route, several meshes


def _session(model, kv: str, cp: int, route=None, speculate="off", batch=False, copying=None):
    """The requests of one engine session: the document, then each continuation decoded and
    rolled back (``copying``: one more, a question whose answer copies, so drafts are made and
    kept), then (``batch``) the questions as one batch."""
    reqs = [{"op": "append", "ids": DOC}, {"op": "mark", "name": "doc"}]
    conts = [_cont(k) for k in sorted({1, cp - 1 or 1, cp + 1, 9})]  # replicated appends, and ring routes
    for c in conts + ([copying] if copying else []):
        reqs += [
            {"op": "append", "ids": c},
            {
                "op": "decode",
                "seq": 0,
                "max_new_tokens": NEW,
                "sampling": vars(Sampling()),
                "keep": False,
                "speculate": speculate,
            },
            {"op": "rollback", "name": "doc"},
        ]
    if batch:
        qs = [_cont(3), _cont(9), _cont(1)] + ([copying] if copying else [])
        reqs.append(
            {
                "op": "batch",
                "questions": qs,
                "slots": 2,
                "max_new_tokens": NEW,
                "sampling": vars(Sampling()),
                "speculate": speculate,
            }
        )
    job = EngineJob(str(model), [], max_new_tokens=NEW, dtype="float32", kv_dtype=kv, reserve=len(DOC) + 64)
    return job, reqs + [{"op": "stop"}], route


def _oracle(model, kv, lengths):
    d = json.loads((model / "config.json").read_text())["head_dim"]
    rnd = KVQuant(d, "cpu").roundtrip if kv == "fp8" else None
    return [tiny_models.hf_greedy(model, DOC + _cont(k), NEW, kv_round=rnd) for k in lengths]


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_cache_is_exact_to_its_rounding_on_every_route(models, world):
    """cp 2 and 3: pass-Q and pass-KV appends, appends shorter than cp (the replicated route),
    speculation (drafts verified as a cache extension) and a batch of questions (cascade over
    the fp8 document plus an fp8 tail): token ids equal transformers' greedy decode with keys
    and values rounded as stored. (A window + softcap family on cp 3.)"""
    lengths = sorted({1, world - 1 or 1, world + 1, 9})
    m = models["llama"]
    rnd = KVQuant(64, "cpu").roundtrip
    copying = copying_question(m, DOC, kv_round=rnd)
    sessions = [
        _session(m, "fp8", world, None),
        _session(m, "fp8", world, "pass-kv"),
        _session(m, "fp8", world, None, speculate="ngram:4", batch=True, copying=copying),
    ]
    if world == 3:
        sessions.append(_session(models["gemma2"], "fp8", world))
    got = run_local(ranks.engine_sessions_full, world, sessions, timeout_s=120)[0]
    want = _oracle(m, "fp8", lengths)
    batch_want = _oracle(m, "fp8", [3, 9, 1])
    copied = tiny_models.hf_greedy(m, DOC + copying, NEW, kv_round=rnd)
    assert got[0]["answers"] == want and got[1]["answers"] == want
    assert got[2]["answers"] == want + [copied] and got[2]["batch"] == batch_want + [copied]
    spec = got[2]["speculation"]  # decodes, then the batch's answers: the copying question drafted and kept
    assert all(s["mode"] == "ngram" for s in spec) and len(spec) == len(lengths) + 1 + 4, spec
    for s in (spec[len(lengths)], spec[-1]):
        assert s["drafted"] > 0 and s["accepted"] > 0, spec
    assert got[0]["summary"]["kv_dtype"] == "fp8_e4m3fn"
    assert got[0]["summary"]["kv_bytes_per_token"] == token_bytes("fp8", 2, 2, 64)  # all ranks: one copy per token
    if world == 3:
        assert got[3]["answers"] == _oracle(models["gemma2"], "fp8", lengths)


# ---------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    f = tmp_path_factory.mktemp("kvdoc") / "doc.txt"
    f.write_text("the archive lists seven towers, a bridge of iron, and two clocks that never agree. " * 2)
    return f


def _gen(*args):
    from typer.testing import CliRunner

    from treeattn_cli.main import app

    r = CliRunner().invoke(
        app, ["generate", *args, "--dtype", "float32", "--max-new-tokens", str(NEW), "--json", "--no-chat"]
    )
    assert r.exit_code == 0, (r.output, r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_saved_fp8_cache_reshards_and_converts(models, doc, tmp_path, monkeypatch):
    """An fp8 cache saved from 2 ranks records its storage (dtype, rotation, scales) and loads
    onto 3 ranks as fp8 (the same answer as transformers on rounded keys and values; and
    through `chat --batch`, whose per-question tails are fp8 too), and onto
    2 ranks with the model's dtype, converted as it loads and said in one line (the document's
    rows keep their fp8 values; the question's are full precision). A layout this version does
    not know is refused in one line."""
    from treeattn_cli.cli import prompt as P
    from treeattn_cli.model.load import load_tokenizer

    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path / "cache"))
    m = models["llama"]
    kv = tmp_path / "kv"
    rec, err = _gen(
        "--model", str(m), "--prompt-file", str(doc), "--nproc", "2", "--kv-dtype", "fp8", "--save-kv", str(kv)
    )
    assert rec["kv_dtype"] == "fp8_e4m3fn" and rec["kv_bytes_per_token"] == token_bytes("fp8", 2, 2, 64)
    assert "no fidelity check is recorded" in err
    man = json.loads((kv / "manifest.json").read_text())
    assert (man["kv_dtype"], man["rotation"], man["scale_groups"], man["dtype"]) == (
        "fp8_e4m3fn",
        "hadamard-64",
        2,
        "float32",
    )
    from safetensors import safe_open

    with safe_open(str(kv / "kv-c0-t0.safetensors"), "pt") as f:
        assert f.get_tensor("k.1").dtype == torch.float8_e4m3fn and f.get_tensor("ks.1").dtype == torch.bfloat16
        assert f.get_tensor("vs.0").shape[-1] == 2
    tok = load_tokenizer(m)
    doc_ids = P.build_ids(tok, doc.read_text(), chat=False)
    q_ids = P.question_ids(tok, " and then", man["composition"])
    quant = KVQuant(64, "cpu")
    n = len(doc_ids)
    loaded, err = _gen(
        "--model", str(m), "--load-kv", str(kv), "--prompt", " and then", "--nproc", "3", "--kv-dtype", "fp8"
    )
    assert "convert" not in err
    assert loaded["token_ids"] == tiny_models.hf_greedy(m, doc_ids + q_ids, NEW, kv_round=quant.roundtrip)
    qs = tmp_path / "qs.txt"
    qs.write_text(" and then\n who keeps it\n")
    from typer.testing import CliRunner

    from treeattn_cli.main import app

    r = CliRunner().invoke(
        app,
        [
            "chat",
            "--model",
            str(m),
            "--load-kv",
            str(kv),
            "--questions",
            str(qs),
            "--nproc",
            "2",
            "--kv-dtype",
            "fp8",
            "--dtype",
            "float32",
            "--max-new-tokens",
            str(NEW),
            "--json",
            "--batch",
            "2",
        ],
    )
    assert r.exit_code == 0, r.output
    chat = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert [c["token_ids"] for c in chat] == [
        tiny_models.hf_greedy(m, doc_ids + P.question_ids(tok, q, man["composition"]), NEW, kv_round=quant.roundtrip)
        for q in (" and then", " who keeps it")
    ]
    assert chat[0]["kv_dtype"] == "fp8_e4m3fn" and chat[0]["kv_bytes_per_token"] == token_bytes("fp8", 2, 2, 64)
    converted, err = _gen("--model", str(m), "--load-kv", str(kv), "--prompt", " and then", "--nproc", "2")
    assert "holds fp8_e4m3fn KV; this run stores float32" in err and converted["kv_dtype"] == "float32"

    def doc_rounded(x):  # the document's positions as stored in fp8, the rest as computed
        return torch.cat([quant.roundtrip(x[:, :, :n]), x[:, :, n:]], dim=2)

    assert converted["token_ids"] == tiny_models.hf_greedy(m, doc_ids + q_ids, NEW, kv_round=doc_rounded)
    man["scale_groups"] = 3
    (kv / "manifest.json").write_text(json.dumps(man))
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(m),
            "--load-kv",
            str(kv),
            "--prompt",
            "x",
            "--dtype",
            "float32",
            "--kv-dtype",
            "fp8",
            "--nproc",
            "2",
        ],
    )
    assert_usage_error(r, "scale layout")


def test_check_measures_fidelity_and_records_it(models, doc, tmp_path, monkeypatch):
    """`check --kv-dtype K --prompt-file DOC`: top-1 agreement, mean KL and greedy agreement
    against the model's dtype (fp16 KV drifts far less than fp8: the measure sees the rounding);
    the verdict follows the thresholds; once recorded, generate no longer says none is."""
    from typer.testing import CliRunner

    from treeattn_cli.main import app

    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path / "cache"))
    m = models["llama"]
    recs = {}
    for kv in ("fp8", "float16"):
        r = CliRunner().invoke(
            app,
            [
                "check",
                "--kv-dtype",
                kv,
                "--prompt-file",
                str(doc),
                "--model",
                str(m),
                "--max-new-tokens",
                "8",
                "--json",
                "--quiet",
            ],
        )
        recs[kv] = rec = json.loads(r.stdout)
        assert r.exit_code == (0 if rec["ok"] else 1), r.output
        assert rec["ok"] == (rec["top1_agreement"] >= 0.95 and rec["kl_mean"] <= 0.01)
        assert rec["ok"] or kv == "fp8", rec  # fp16 KV on a float32 model passes whatever the model
        assert 0 <= rec["top1_agreement"] <= 1 and 0 <= rec["greedy_agreement"] <= 1 and rec["greedy_tokens"] == 8
        assert rec["reference"] == "float32" and rec["tokens"] > 100
    assert recs["fp8"]["kv_dtype"] == "fp8_e4m3fn" and recs["fp8"]["kl_mean"] > 0
    assert recs["float16"]["kl_mean"] < recs["fp8"]["kl_mean"] / 50
    b = recs["fp8"]["kv_bytes_per_token"]
    assert b["test"] == token_bytes("fp8", 2, 2, 64) and b["reference"] == token_bytes("float32", 2, 2, 64)
    _, err = _gen("--model", str(m), "--prompt", "x y z", "--nproc", "2", "--kv-dtype", "fp8")
    assert "fidelity" not in err
    # a drift beyond the thresholds fails: with the KL bound under what fp8 measured, the verdict
    # turns and check exits 1 (so the verdict is not the same whatever was measured)
    from treeattn_cli.verify import fidelity

    monkeypatch.setitem(fidelity.THRESHOLDS, "kl_mean", recs["fp8"]["kl_mean"] / 2)
    r = CliRunner().invoke(
        app,
        [
            "check",
            "--kv-dtype",
            "fp8",
            "--prompt-file",
            str(doc),
            "--model",
            str(m),
            "--max-new-tokens",
            "8",
            "--json",
            "--quiet",
        ],
    )
    strict = json.loads(r.stdout)
    assert r.exit_code == 1 and strict["ok"] is False and strict["kl_mean"] == recs["fp8"]["kl_mean"], r.output
    for args, needle in (
        (["--kv-dtype", "fp8"], "--prompt-file"),
        (["--kv-dtype", "fp4", "--prompt-file", str(doc)], "--kv-dtype"),
        (["--kv-dtype", "float32", "--prompt-file", str(doc)], "nothing to compare"),
    ):
        assert_usage_error(CliRunner().invoke(app, ["check", "--model", str(m), *args]), needle)
    assert_usage_error(cli("generate", "--kv-dtype", "fp4", "--prompt", "x"), "--kv-dtype")


def test_bench_projects_what_fp8_fits_and_reads():
    """`bench --simulate --max-context`: fp8 KV fits about 1.9x the bf16 context on 8 x H100
    (8B and 70B), and the decode projection reads about half the KV bytes."""
    r = cli("bench", "--simulate", "dgx-h100", "--max-context", "--gpus", "8", "--json")
    assert r.exit_code == 0, r.output
    best = {(x["model"], x["kv_dtype"]): x for x in json.loads(r.stdout) if x.get("best")}
    for shape in ("llama-3.1-8b", "llama-3.1-70b"):
        bf, f8 = best[(shape, "bfloat16")], best[(shape, "fp8")]
        assert bf["tp"] == f8["tp"] == 8 and 1.85 <= f8["max_context"] / bf["max_context"] <= 1.95
        assert f8["kv_bytes_per_token"] <= 0.55 * bf["kv_bytes_per_token"]
    rows = {}
    for kv in ("auto", "fp8"):
        r = cli(
            "bench",
            "--simulate",
            "dgx-h100",
            "--model-shape",
            "llama-3.1-8b",
            "--gpus",
            "8",
            "--seq-len",
            "1M",
            "--kv-dtype",
            kv,
            "--json",
        )
        assert r.exit_code == 0, r.output
        rows[kv] = {x["tp"]: x for x in json.loads(r.stdout)}
    assert 0.5 <= rows["fp8"][1]["kv_ms"] / rows["auto"][1]["kv_ms"] <= 0.55
