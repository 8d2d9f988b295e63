"""Reliability and security: lost ranks, Ctrl-C, leftovers, loopback-only sockets, bad files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treeattn_cli.parallel.launch import alive
from treeattn_cli.verify import tiny as tiny_models

from helpers import assert_usage_error, cli, cmdline, descendants, rank_pids, still_running

TREEATTN = str(Path(sys.executable).with_name("treeattn"))


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """A tiny model made slow enough per token that a run lasts seconds (more layers, wider)."""
    d = tmp_path_factory.mktemp("rel") / "llama"
    return tiny_models.make_model(
        "llama", d, hidden_size=256, intermediate_size=1024, num_hidden_layers=8, max_position_embeddings=4096
    )


def _start(model, *extra, nproc=2, tokens=3800):  # about a minute of work: never done before the event
    return subprocess.Popen(
        [
            TREEATTN,
            "generate",
            "--model",
            str(model),
            "--prompt",
            "hello world " * 20,
            "--no-chat",
            "--nproc",
            str(nproc),
            "--max-new-tokens",
            str(tokens),
            "--temperature",
            "0",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )


def _wait_for_output(proc, nbytes=20, timeout=60):
    """Read stdout until some generated text has streamed; returns it."""
    os.set_blocking(proc.stdout.fileno(), False)
    got, t0 = b"", time.monotonic()
    while len(got) < nbytes and time.monotonic() - t0 < timeout:
        chunk = proc.stdout.read() or b""
        got += chunk
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    return got


def _listening_sockets_of(pids):
    """(address, port) of TCP sockets in LISTEN state owned by ``pids``."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                addr, port = f[1].split(":")
                out.append((addr, int(port, 16), v6))
    return out


def _is_loopback(addr_hex: str, v6: bool) -> bool:
    if not v6:
        return addr_hex == "0100007F"  # 127.0.0.1, little endian
    return addr_hex in ("00000000000000000000000001000000",)  # ::1


def test_sockets_listen_on_loopback_only(slow_model):
    proc = _start(slow_model, nproc=2)
    try:
        assert _wait_for_output(proc, 5)
        pids = [proc.pid] + descendants(proc.pid)
        socks = _listening_sockets_of(pids)
        assert socks, "expected the rendezvous and gloo listeners"
        bad = [s for s in socks if not _is_loopback(s[0], s[2])]
        assert not bad, bad
    finally:
        proc.kill()
        proc.wait()


def test_killed_rank_is_named_and_tokens_are_kept(slow_model, tmp_path):
    out = tmp_path / "out.txt"
    proc = _start(slow_model, "--timeout", "5", "--output", str(out), nproc=2)
    early = _wait_for_output(proc, 10)
    assert early, proc.stderr.read()
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[1], signal.SIGKILL)
    t0 = time.monotonic()
    rest, err = proc.communicate(timeout=60)
    # a deadline: --timeout 5, the launcher's 5 s grace, and room for a loaded 2-core machine
    assert time.monotonic() - t0 < 5 + 5 + 20
    assert proc.returncode == 1
    assert "rank 1" in err.decode() and "SIGKILL" in err.decode(), err
    assert "Traceback" not in err.decode()
    text = early + rest  # bytes: a generated "\r" must stay a "\r" (read_text() would make it "\n")
    assert text.strip() and out.read_bytes().strip() == text.strip()
    assert not [p for p in descendants(proc.pid)]


def _wait_for_ranks(proc, n=2, timeout=60):
    """Wait until the launcher's ``n`` rank processes exist (the event a --json run offers:
    nothing streams); returns their pids."""
    t0 = time.monotonic()
    while len(rank_pids(proc.pid)) < n and time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.stderr.read().decode()[-1000:]
        time.sleep(0.05)
    return rank_pids(proc.pid)


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_stops_everything_and_keeps_text(slow_model, as_json):
    """Ctrl-C at any moment of a run: streamed, once text has come; with --json, as soon as the
    ranks exist (however far they got, the record holds exactly what was generated)."""
    proc = _start(slow_model, *(["--json"] if as_json else []), nproc=2)
    if as_json:
        assert len(_wait_for_ranks(proc)) == 2
    else:
        assert _wait_for_output(proc, 10)
    ranks = rank_pids(proc.pid)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    # "stops at once": a deadline, generous for a loaded 2-core machine (a minute of work was left)
    assert time.monotonic() - t0 < 20, time.monotonic() - t0
    assert proc.returncode == 130, err.decode()
    assert "Traceback" not in err.decode()
    assert not still_running(ranks)
    if as_json:
        rec = json.loads(out.decode().strip().splitlines()[-1])
        assert rec["stop_reason"] == "interrupted" and isinstance(rec["token_ids"], list)
        from treeattn_cli.model.load import load_tokenizer

        assert rec["text"] == load_tokenizer(slow_model).decode(rec["token_ids"], skip_special_tokens=True)


def _eventually(pred, timeout=10.0) -> bool:
    """Poll ``pred`` until it holds (True) or ``timeout`` seconds pass (False)."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.05)
    return True


def _listening(pid):
    return set(_listening_sockets_of([pid]))


def test_runs_in_a_row_leave_nothing_behind(tmp_path, monkeypatch):
    """8 runs in a row (in this process: the launcher stays warm) leave no rank process, no
    listening socket, no temporary file and no shared-memory segment; two runs of the console
    script leave no process at all. A busy MASTER_PORT does not matter (the OS picks the port)."""
    import tempfile

    from typer.testing import CliRunner

    from treeattn_cli.main import app

    d = tiny_models.make_model("llama", tmp_path / "m")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    args = ["generate", "--model", str(d), "--no-chat", "--nproc", "2", "--max-new-tokens", "2", "--json"]
    CliRunner().invoke(app, [*args, "--prompt", "warm up"])  # starts the fork server
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    socks_before = _listening(os.getpid())
    before = set(descendants(os.getpid()))
    for i in range(8):  # what one run leaves shows after it; eight show what piles up slowly
        r = CliRunner().invoke(app, [*args, "--prompt", f"run {i}", "--output", str(tmp_path / "o.txt")])
        assert r.exit_code == 0, r.output
    busy.close()
    # the last run's ranks are reaped and the store's server thread closes its socket just after
    # the run returns: wait for that, a bounded poll rather than a fixed sleep
    assert _eventually(lambda: set(descendants(os.getpid())) <= before), "rank processes left behind"
    assert _eventually(lambda: _listening(os.getpid()) <= socks_before), "listening sockets left behind"
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("pymp-")] == []
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert shm_after <= shm_before, shm_after - shm_before
    for i in range(2):  # the console script: its whole process tree goes away
        p = subprocess.Popen(
            [TREEATTN, *args, "--prompt", f"cli {i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ),
        )
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode(errors="replace")[-3000:]

    def leftover():
        return [q for q in os.listdir("/proc") if q.isdigit() and str(d) in cmdline(int(q))]

    assert _eventually(lambda: not leftover()), leftover()


# ---------------------------------------------------------------- bad model files


def _gen(*args):
    return subprocess.run(
        [TREEATTN, "generate", "--prompt", "hi", "--no-chat", "--max-new-tokens", "2", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_truncated_safetensors(tmp_path):
    d = tiny_models.make_model("llama", tmp_path / "m")
    f = next(d.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert_usage_error(_gen("--model", str(d)), "corrupt safetensors")


def test_garbage_safetensors(tmp_path):
    d = tiny_models.make_model("llama", tmp_path / "m")
    next(d.glob("*.safetensors")).write_bytes(b"\xff" * 100)
    assert_usage_error(_gen("--model", str(d)), "corrupt safetensors")


def test_pickled_weights_need_opt_in(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    d = tiny_models.make_model("llama", tmp_path / "m")
    m = AutoModelForCausalLM.from_pretrained(d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    torch.save(m.state_dict(), d / "pytorch_model.bin")
    assert_usage_error(_gen("--model", str(d)), "--allow-pickle")
    r = _gen("--model", str(d), "--allow-pickle", "--nproc", "1")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("content,needle", [(b"", "empty"), (b"\xff\xfe\x00bad", "not"), (b"caf\xe9", "UTF-8")])
def test_bad_prompt_files(tmp_path, content, needle):
    d = tiny_models.make_model("llama", tmp_path / "m")
    f = tmp_path / "p.txt"
    f.write_bytes(content)
    assert_usage_error(cli("generate", "--model", str(d), "--prompt-file", str(f)), needle)


def test_prompt_longer_than_context(tmp_path):
    d = tiny_models.make_model("llama", tmp_path / "m", max_position_embeddings=64)
    assert_usage_error(cli("generate", "--model", str(d), "--prompt", "x" * 100, "--no-chat"), "context of 64 tokens")


def test_debug_shows_the_traceback(tmp_path):
    r = subprocess.run(
        [TREEATTN, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x", "--debug"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 1 and "Traceback" in r.stderr and "model path not found" in r.stderr  # raised, whole


def test_nccl_without_gpus():
    r = subprocess.run(
        [TREEATTN, "generate", "--prompt", "x", "--backend", "nccl", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert_usage_error(r, "nccl")


def test_full_context_generation_is_exact(tmp_path):
    """A prompt that fills the context up to the last new token: still transformers' tokens."""
    from typer.testing import CliRunner

    from treeattn_cli.main import app
    from treeattn_cli.model.load import load_tokenizer

    d = tiny_models.make_model("qwen2", tmp_path / "m", max_position_embeddings=96)
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(90))
    ids = load_tokenizer(d)(prompt)["input_ids"]
    ref = tiny_models.hf_greedy(d, ids, 6)
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(d),
            "--prompt",
            prompt,
            "--no-chat",
            "--nproc",
            "3",
            "--max-new-tokens",
            "6",
            "--json",
            "--dtype",
            "float32",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == ref
    r = CliRunner().invoke(
        app, ["generate", "--model", str(d), "--prompt", prompt, "--no-chat", "--max-new-tokens", "7"]
    )
    assert r.exit_code == 2


def test_dtype_the_device_cannot_run(monkeypatch):
    import torch

    from treeattn_cli.model.load import ModelError, pick_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(ModelError, match="cannot run bfloat16"):
        pick_dtype("bfloat16", torch.device("cuda", 0))
    assert pick_dtype("auto", torch.device("cuda", 0)) == torch.float32
    with pytest.raises(ModelError, match="unknown dtype"):
        pick_dtype("int4", torch.device("cpu"))


# ---------------------------------------------------------------- signals and failed ranks


def test_sigterm_stops_everything_and_keeps_text(slow_model, tmp_path):
    """SIGTERM (Slurm, Kubernetes, systemd, `timeout`) behaves like Ctrl-C: every rank stops at
    once, the text so far is kept (--output, the --json record, stop_reason "terminated"), exit
    status 143, and the whole process tree (ranks, fork server, resource tracker) is gone."""
    out = tmp_path / "out.txt"
    proc = _start(slow_model, "--output", str(out), nproc=2)  # a minute of work
    early = _wait_for_output(proc, 10)  # the event: generated text has streamed
    assert early, proc.stderr.read()
    tree = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err.decode()
    assert "Traceback" not in err.decode()
    assert err.decode().strip().splitlines()[-1].endswith("terminated]"), err.decode()  # the stats line
    # bytes, not read_text(): the random model may emit "\r", which text mode would turn into "\n"
    assert out.read_bytes().strip() == (early + rest).strip()  # stdout ends the stream with a newline
    assert not still_running(tree), [cmdline(p) for p in still_running(tree, 0)]


def test_launcher_killed_outright_leaves_no_process(slow_model):
    """SIGKILL of the launcher (the OOM killer, a closed terminal): its ranks, fork server and
    resource tracker exit within seconds instead of running on as orphans (on GPUs they would
    hold device memory)."""
    proc = _start(slow_model, nproc=2)  # a minute of work left when it is killed
    assert _wait_for_output(proc, 10)
    tree = descendants(proc.pid)
    assert len(rank_pids(proc.pid)) == 2
    proc.kill()
    proc.wait(timeout=10)
    left = still_running(tree, within=5)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, [cmdline(p) for p in left]


def test_prompt_without_tokens_is_refused(tmp_path):
    """A tokenizer whose vocabulary covers none of the text (word-level files beside a qwen2
    model: transformers picks the model type's byte-level class) gave zero tokens and crashed
    in every rank; now: exit 2 before any rank starts, one line naming the tokenizer class."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tiny_models.make_model("qwen2", tmp_path / "q")
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "alpha": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    r = _gen("--model", str(d))  # prompt "hi"
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "no tokens after tokenization" in err[0] and "Qwen2Tokenizer" in err[0], err


@pytest.mark.parametrize("source", ["stdin", "fifo"])
def test_endless_prompt_is_refused_quickly_with_flat_memory(tmp_path, source):
    """An endless prompt (`yes | treeattn generate`, a FIFO fed forever) is read up to a bound
    derived from the model's context, then refused: exit 2 within seconds, one line naming
    the limit, memory bounded by it (it was read whole until the process died)."""
    d = tiny_models.make_model("llama", tmp_path / "m")  # 512-token context: a 1 MiB bound
    # The peak is the kernel's own (ru_maxrss), taken by a small wrapper process of its child: a
    # process forked from this one (pytest, maybe 1.5 GB by now) would count this one's memory
    # too, since Linux carries the old image's high-water mark across exec.
    peak_file = tmp_path / "maxrss"
    wrap = (
        "import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
        "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
        "sys.exit(rc)"
    )
    cmd = [sys.executable, "-c", wrap, str(peak_file), TREEATTN, "generate", "--model", str(d), "--no-chat"]
    out_f, err_f = open(tmp_path / "out", "wb"), open(tmp_path / "err", "wb")
    t0 = time.monotonic()
    if source == "fifo":
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        feeder = subprocess.Popen(f"exec yes 'all work and no play' > {fifo}", shell=True)
        p = subprocess.Popen(
            cmd + ["--prompt-file", str(fifo)],
            stdout=out_f,
            stderr=err_f,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    else:
        feeder = subprocess.Popen(["yes", "all work and no play"], stdout=subprocess.PIPE)
        p = subprocess.Popen(cmd, stdin=feeder.stdout, stdout=out_f, stderr=err_f, start_new_session=True)
    try:
        p.wait(timeout=120)  # a run that would read forever is ended here (then the bound below fails)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    elapsed = time.monotonic() - t0
    feeder.kill()
    feeder.wait()
    out_f.close()
    err_f.close()
    peak = int(peak_file.read_text()) if peak_file.exists() else -1
    err = (tmp_path / "err").read_bytes()
    assert p.returncode == 2, err.decode()
    assert elapsed < 60  # "within seconds": generous for a loaded machine (it ran until killed before)
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "longer than 1 MiB" in lines[0] and "512 tokens" in lines[0], lines
    assert 0 < peak < 1_000_000, f"peak RSS {peak} KiB"  # the interpreter + torch, not the input


def test_debug_prints_the_failing_ranks_traceback(tmp_path):
    """--debug promises full tracebacks: when a rank fails, the launcher prints that rank's
    traceback (collected from it) before the one-line error."""
    d = tiny_models.make_model("llama", tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 1  # a valid config, but the weights do not fit it: fails in the ranks
    (d / "config.json").write_text(json.dumps(cfg))
    r = _gen("--model", str(d), "--nproc", "2", "--debug")
    assert r.returncode == 1, r.stderr
    assert "Traceback (most recent call last)" in r.stderr and 'File "' in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("treeattn: error: rank ")


def test_a_fork_server_started_early_is_gone_when_its_command_ends(tmp_path):
    """A command starts the ranks' fork server as it begins (its imports overlap the launcher's);
    one that ends before any rank ran must not leave it importing for seconds, holding the
    command's stdout open (`treeattn generate --model bad | cat` would wait): by the time the
    command's process has exited, the server has been killed and reaped."""
    script = (
        "from treeattn_cli.parallel import forkserver as server\n"
        "from multiprocessing import forkserver\n"
        "server.warm_early()\n"
        "print(forkserver._forkserver._forkserver_pid, flush=True)\n"
    )
    out = tmp_path / "out.txt"
    with open(out, "w") as f:  # a file, not a pipe: waiting for the process is not waiting for its pipe's readers
        r = subprocess.run([sys.executable, "-c", script], stdout=f, stderr=subprocess.DEVNULL, timeout=120)
    assert r.returncode == 0
    assert not alive(int(out.read_text().split()[-1]))  # (a zombie or a reaped pid is not alive)
