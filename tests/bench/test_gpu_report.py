"""``python -m treeattn_cli.bench.gpu_report``: the one command for every GPU measurement.

On CPU: without a GPU it writes a report saying so, every GPU step skipped, quickly, exit 0;
the time budget is shared out so the steps fit it (a fake clock and fake steps); a step that
overruns is stopped at its limit; and each step's command is one its script accepts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from treeattn_cli.bench import gpu_report as gr


def test_without_a_gpu_every_gpu_step_is_skipped(tmp_path):
    env_out = tmp_path / "rep"
    p = subprocess.run(
        [sys.executable, "-m", "treeattn_cli.bench.gpu_report", "--out", str(env_out)],
        capture_output=True,
        text=True,
        timeout=120,  # every step skipped: no waiting on any
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads((env_out / "report.json").read_text())
    assert rep["gpu_count"] == 0 and "no GPU" in rep["note"]
    steps = {s["name"]: s for s in rep["steps"]}
    assert steps["devices"]["status"] == "pass"
    gpu_steps = [s for n, s in steps.items() if n != "devices"]
    assert {s["name"] for s in gpu_steps} == {
        "gpu-kernels",
        "gpu-step",
        "check",
        "pytest-gpu",
        "kernel",
        "kernel-tune",
        "decode",
        "prefill",
        "batch",
        "batch-fp8",
        "batch-graphs",
        "model",
        "speculate",
        "serve",
        "check-ranks",
    }
    assert all(s["status"] == "skipped" and s["reason"] == "no GPU" for s in gpu_steps), gpu_steps
    md = (env_out / "report.md").read_text()
    assert "GPUs: **none**" in md and "no GPU found" in md
    assert "| kernel-tune | skipped |" in md


def _fake_steps():
    """Steps whose 'command' says how long they take: ``want`` seconds."""

    def mk(name, want, cap, floor, gpus=1):
        return gr.Step(
            name, name, ["want", want], cap_s=cap, floor_s=floor, min_gpus=gpus, parse=lambda text, d: {"out": text}
        )

    return [mk("a", 100, 50, 10), mk("b", 5, 30, 10), mk("c", 5, 30, 10, gpus=2), mk("d", 5, 30, 10)]


@pytest.mark.parametrize(
    "budget,expect",
    [
        # a: min(cap 50, budget - floors of b and d); b: what is left but d's floor; c needs 2 GPUs
        (80, {"a": ("timeout", 50), "b": ("pass", 20), "c": ("skipped", None), "d": ("pass", 25)}),
        (60, {"a": ("timeout", 40), "b": ("pass", 10), "c": ("skipped", None), "d": ("pass", 15)}),
        # a cannot get its floor after reserving the others': it takes what is left; they are skipped
        (25, {"a": ("timeout", 25), "b": ("skipped", None), "c": ("skipped", None), "d": ("skipped", None)}),
    ],
)
def test_the_budget_is_shared_out(tmp_path, monkeypatch, budget, expect):
    now = [0.0]

    def fake_run(argv, timeout_s, log, env):
        want = argv[1]
        took = min(want, timeout_s)
        now[0] += took
        return (None if want > timeout_s else 0), json.dumps({"took": took}), took

    monkeypatch.setattr(gr, "_run", fake_run)
    rep = gr.run_report(tmp_path, budget, steps=_fake_steps(), devices={"count": 1, "gpus": []}, clock=lambda: now[0])
    got = {s["name"]: (s["status"], s["timeout_s"]) for s in rep["steps"]}
    assert got == expect
    assert rep["elapsed_s"] <= budget
    by = {s["name"]: s for s in rep["steps"]}
    assert by["c"]["reason"] == "needs 2 GPUs, this machine has 1"
    if by["b"]["status"] == "pass":
        assert by["b"]["summary"] == {"out": json.dumps({"took": 5})}
    else:
        assert by["b"]["reason"].startswith("out of budget")
    assert json.loads((tmp_path / "report.json").read_text())["steps"][0]["name"] == "a"
    assert "| a | timeout |" in (tmp_path / "report.md").read_text()


def test_a_step_past_its_limit_is_stopped(tmp_path):
    """A real subprocess: stopped (with everything in its process group) at its limit, the
    report records why, and the next step still runs."""
    steps = [
        gr.Step("sleeper", "sleeps", [sys.executable, "-c", "import time; time.sleep(60)"], cap_s=2, floor_s=1),
        gr.Step(
            "after",
            "prints",
            [sys.executable, "-c", "print('[{\"x\": 1}]')"],
            cap_s=30,
            floor_s=1,
            parse=lambda text, d: {"records": gr._records(text)},
        ),
        gr.Step("broken", "fails", [sys.executable, "-c", "import sys; sys.exit('no luck')"], cap_s=30, floor_s=1),
    ]
    rep = gr.run_report(tmp_path, 60, steps=steps, devices={"count": 1, "gpus": []})
    by = {s["name"]: s for s in rep["steps"]}
    assert by["sleeper"]["seconds"] < 30  # stopped near its 2 s limit, not after its 60 s sleep
    assert by["sleeper"]["status"] == "timeout" and "limit of 2 s" in by["sleeper"]["reason"]
    assert by["after"]["status"] == "pass" and by["after"]["summary"] == {"records": [{"x": 1}]}
    assert by["broken"]["status"] == "fail" and "no luck" in by["broken"]["reason"]
    assert (tmp_path / "logs" / "after.out").read_text().strip() == '[{"x": 1}]'


def test_output_parsers(tmp_path):
    assert gr._json_values('warning: x\n[\n {"a": 1}\n]\n') == [[{"a": 1}]]
    assert gr._records('{"context": 1}\nnoise\n{"ttft_prompt": 2, "prefill_s": 0.5}') == [
        {"context": 1},
        {"ttft_prompt": 2, "prefill_s": 0.5},
    ]
    chk = gr.parse_check(
        json.dumps(
            [
                {"path": "generate/cuda-graph", "verdict": "FAIL", "note": "x"},
                {"path": "kernels/triton", "verdict": "pass"},
            ]
        ),
        tmp_path,
    )
    assert chk["failed"] == ["generate/cuda-graph"] and chk["verdicts"] == {"FAIL": 1, "pass": 1}
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "pytest-gpu.xml").write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_gpu" name="t1"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_gpu" name="t2"/></testsuite></testsuites>'
    )
    j = gr.parse_junit("", tmp_path)
    assert (j["passed"], j["failures"], j["skipped"], j["failed_tests"]) == (2, 1, 1, ["tests.test_gpu::t1"])
    tune = gr.parse_tune(
        "\n".join(
            json.dumps(r)
            for r in (
                {"seq_len": 8, "block_n": 64, "time_us": 5.0, "best": True},
                {"seq_len": 8, "block_n": 32, "time_us": 6.0, "default": True},
                {"seq_len": 8, "error": "OutOfResources"},
            )
        ),
        tmp_path,
    )
    assert tune["by_seq_len"][8]["best"]["block_n"] == 64 and tune["by_seq_len"][8]["default"]["time_us"] == 6.0
    assert tune["by_seq_len"][8]["errors"] == 1
    hs = gr.parse_batch_graphs(
        "\n".join(
            json.dumps(r)
            for r in (
                {"batch": 8, "graphs": False, "ms_per_step": 12.0, "graph_replays": [0]},
                {"batch": 8, "graphs": True, "ms_per_step": 4.0, "graph_replays": [31, 31]},
                {"batch": 1, "graphs": False, "ms_per_step": 9.0},
            )
        ),
        tmp_path,
    )
    assert hs["by_batch"] == {
        1: {"eager_ms": 9.0, "captured_ms": None, "replays": None, "speedup": None},
        8: {"eager_ms": 12.0, "captured_ms": 4.0, "replays": [31, 31], "speedup": 3.0},
    }
    assert gr._key_numbers({"name": "batch-graphs", "summary": hs}).endswith("B=8: eager 12 ms, captured 4 ms (3x)")


def test_every_step_command_is_accepted_by_its_script(monkeypatch, tmp_path):
    """The options each step passes exist: the scripts parse them (their work is stubbed)."""
    from typer.testing import CliRunner

    import treeattn_cli.bench.kernel as kb
    import treeattn_cli.bench.run as br
    import treeattn_cli.cli.check as cc
    from treeattn_cli.bench import gpu_decode, gpu_kernels, gpu_step
    from treeattn_cli.main import app

    calls = []
    monkeypatch.setattr(kb, "tune", lambda *a, **k: calls.append(("tune", a, k)) or [])
    monkeypatch.setattr(kb, "kernel_bench", lambda *a, **k: calls.append(("kernel", a, k)) or [])
    monkeypatch.setattr(cc, "check_command", lambda **k: calls.append(("check", k)) or [])
    monkeypatch.setattr(br, "bench_command", lambda o, on_progress=None: calls.append(("bench", o)) or [])

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(kb, "copy_bandwidth", stop)
    import treeattn_cli.bench.model as bmod
    import treeattn_cli.bench.random_model as rm
    import treeattn_cli.bench.serve as bserve
    import treeattn_cli.bench.speculate as bspec

    monkeypatch.setattr(rm, "device_and_dtype", lambda d, t: ("cuda", "bfloat16") if d == "cuda" else (d, t))
    monkeypatch.setattr(rm, "random_model", lambda shape: calls.append(("random", shape)) or tmp_path)
    monkeypatch.setattr(bmod, "model_bench", lambda *a, **k: calls.append(("model", a, k)) or [])
    monkeypatch.setattr(bspec, "speculate_bench", lambda *a, **k: calls.append(("speculate", a, k)) or [])
    monkeypatch.setattr(bserve, "run", lambda *a, **k: calls.append(("serve", a, k)) or [])
    import treeattn_cli.bench.host_step as hs

    monkeypatch.setattr(hs, "make_model", lambda shape: calls.append(("host_model", shape)) or tmp_path)
    monkeypatch.setattr(hs, "measure", lambda *a, **k: calls.append(("host_step", a, k)) or {})
    scripts = {
        "treeattn_cli.bench.model": bmod.main,
        "treeattn_cli.bench.speculate": bspec.main,
        "treeattn_cli.bench.serve": bserve.main,
        "treeattn_cli.bench.host_step": hs.main,
    }
    for st in gr.default_steps(4, tmp_path):
        argv = [str(x) for x in st.argv]
        if argv[1:3] == ["-m", "treeattn_cli.main"]:
            res = CliRunner().invoke(app, argv[3:])
            assert res.exit_code == 0, (st.name, res.output)
        elif argv[2] == "treeattn_cli.bench.kernel":
            kb.main(argv[3:])
        elif argv[2] in scripts:
            scripts[argv[2]](argv[3:])
        elif argv[2] in ("treeattn_cli.bench.gpu_kernels", "treeattn_cli.bench.gpu_step"):
            mod = gpu_kernels if argv[2].endswith("kernels") else gpu_step
            assert mod.main(argv[3:]) == 1  # its options parsed; then: no CUDA device here
        elif argv[2] == "treeattn_cli.bench.gpu_decode":
            with pytest.raises(Stop):  # its options parsed; then it measures the GPU's bandwidth
                gpu_decode.main(argv[3:])
        else:
            assert argv[2] == "pytest" and "-m" in argv[3:] and "gpu" in argv and "-x" not in argv, argv
    kinds = [c[0] for c in calls]
    assert kinds.count("check") == 2 and kinds.count("bench") == 3 and "tune" in kinds and "kernel" in kinds
    checks = [c[1] for c in calls if c[0] == "check"]
    assert [c["nproc"] for c in checks] == [1, 4]
    benches = [c[1] for c in calls if c[0] == "bench"]
    assert [b.prefill for b in benches] == [True, False, False] and benches[1].shared and benches[1].batch == "1,8,64"
    assert benches[2].shared and benches[2].batch == "1,8,32" and benches[2].kv_dtype == "fp8"  # issue 38
    model = next(c for c in calls if c[0] == "model")
    assert model[1][4:7] == ("cuda", "bfloat16", ["auto", "fp8"])  # on the GPU in bf16, both caches
    spec = next(c for c in calls if c[0] == "speculate")
    assert spec[1][4:6] == ("cuda", "bfloat16")
    assert [c[1] for c in calls if c[0] == "random"] == [gr.RANDOM_SHAPE] * 3 and any(c[0] == "serve" for c in calls), (
        kinds
    )
    steps = [c for c in calls if c[0] == "host_step"]  # issue 38: eager and captured at B = 1, 8, 32 on the GPU
    assert [(c[1][1], c[2]["graphs"]) for c in steps] == [(b, g) for b in (1, 8, 32) for g in (False, True)]
    assert all(c[2]["device"] == "cuda" and c[2]["pool"] for c in steps)  # issue 35: the pool's path, tables
    assert [c[1] for c in calls if c[0] == "host_model"] == ["llama-1b"]


def test_the_calls_cover_every_step_once_and_each_fits_the_budget(tmp_path):
    """Four calls of under 10 minutes cover the report: every step in exactly one call, each
    call's limits (a machine with 1 GPU and with 8) within the default budget."""
    for n in (1, 8):
        steps = {s.name: s for s in gr.default_steps(n, tmp_path)}
        groups = [c.split(",") for c in gr.CALLS]
        assert sorted(x for g in groups for x in g) == sorted(steps)
        for g in groups:
            caps = sum(steps[x].cap_s for x in g if n >= steps[x].min_gpus)
            assert caps <= gr.DEFAULT_BUDGET_S, (n, g, caps)


def test_the_two_measurement_runs_fit_six_minutes_each(tmp_path, capsys):
    """Issue 51: ``--run 1`` (the kernels, the whole step) and ``--run 2`` (the batched step
    eager against captured, the device tests without the tuning sweep), each within 6 minutes
    on a machine with 1 GPU or 8, and no test the two runs skip is in pytest-gpu's list."""
    for n in (1, 8):
        steps = {s.name: s for s in gr.default_steps(n, tmp_path)}
        for names in gr.RUNS.values():
            caps = sum(steps[x].cap_s for x in names.split(",") if n >= steps[x].min_gpus)
            assert caps <= gr.RUN_BUDGET_S - 10, (n, names, caps)  # the devices step's seconds too
    argv = next(s.argv for s in gr.default_steps(1, tmp_path) if s.name == "pytest-gpu")
    assert "tests/test_gpu.py::test_tune_sweep_reports_resources" in argv
    with pytest.raises(SystemExit):
        gr.main(["--out", str(tmp_path), "--run", "1", "--steps", "check"])
    assert "not both" in capsys.readouterr().err


def test_the_measurement_records_become_key_numbers(tmp_path):
    def lines(*recs):
        return "\n".join(json.dumps(r) for r in recs)

    k = gr.parse_gpu_kernels(
        lines(
            {"kind": "device", "name": "H200", "copy_gbps": 4000.0},
            {"kind": "bf16", "N": 32768, "us": 50.0, "frac_copy": 0.9},
            {"kind": "fp8", "N": 32768, "us": 30.0, "frac_copy": 0.8, "splits": 33},
            {"kind": "fp8-splits", "N": 32768, "us": 28.0, "splits": 49},
            {"kind": "fp8-splits", "N": 32768, "us": 27.0, "splits": 66},
            {"kind": "paged-bf16", "N": 32768, "us": 52.0, "stages": "shipped"},
        ),
        tmp_path,
    )
    row = k["by_keys"][32768]
    assert (row["fp8_vs_bf16"], row["paged_vs_dense"]) == (0.6, 1.04)
    assert [r["splits"] for r in row["records"]["fp8-splits"]] == [49, 66]
    st = gr.parse_gpu_step(
        lines(
            {"kind": "step", "N": 32768, "kv": "bf16", "replay_ms": 8.0, "overlapped_ms": 8.2, "floor_ms": 6.4},
            {"kind": "census", "N": 32768, "kv": "bf16", "per_step": {"gemm": {"kernels": 225.0, "device_ms": 5.0}}},
            {"kind": "step", "N": 131072, "kv": "bf16", "error": "skipped: needs 40 GiB"},
        ),
        tmp_path,
    )
    assert st["steps"][0]["of_floor"] == 0.8 and len(st["errors"]) == 1
    md = gr._key_numbers({"name": "gpu-step", "summary": st})
    assert "bf16 32768: 8 ms (0.8 of floor)" in md and "225 kernels/step" in md
    md = gr._key_numbers({"name": "gpu-kernels", "summary": k})
    assert md == "32768: bf16 50 us, fp8 0.6x, paged 1.04x dense"


def test_pytest_counts_of_a_run_stopped_early(tmp_path):
    """No JUnit XML (pytest was stopped at its limit): the ``-v`` lines printed so far."""
    text = (
        "tests/test_gpu.py::test_a[1] PASSED                 [  1%]\n"
        "tests/test_gpu.py::test_b FAILED                    [  2%]\n"
        "tests/test_gpu.py::test_c SKIPPED (needs 2 GPUs)    [  3%]\n"
    )
    j = gr.parse_junit(text, tmp_path)
    assert (j["tests"], j["passed"], j["failures"], j["skipped"], j["complete"]) == (3, 1, 1, 1, False)
    assert j["failed_tests"] == ["tests/test_gpu.py::test_b"]


def test_preflight_without_a_gpu_passes_and_says_there_is_nothing_to_measure():
    p = subprocess.run(
        [sys.executable, "-m", "treeattn_cli.bench.gpu_report", "--preflight"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    for name in ("torch", "triton", "treeattn_kernels", "transformers", "pytest", "fastapi"):
        assert any(x.split()[:2] == [name, "ok"] for x in lines), (name, p.stdout)
    assert "GPUs: none seen" in p.stdout and "nothing to measure" in lines[-1], p.stdout


def test_a_step_whose_imports_are_missing_is_skipped_and_preflight_names_them(tmp_path, monkeypatch):
    """A missing (or too old) module: the report skips the steps that need it, naming it, and
    runs the others; preflight exits 1 with the missing names."""
    steps = [
        gr.Step(
            "wants-missing",
            "needs a module nobody has",
            [sys.executable, "-c", "print(1)"],
            cap_s=30,
            floor_s=1,
            needs=("torch", "treeattn_no_such_module"),
        ),
        gr.Step(
            "fine", "prints", [sys.executable, "-c", "print('[{\"x\": 1}]')"], cap_s=30, floor_s=1, needs=("torch",)
        ),
    ]
    real = gr.probe_imports  # the real probe (a child process) once, for the floor below; here a quick stand-in
    monkeypatch.setattr(
        gr,
        "probe_imports",
        lambda names, env: {n: {"ok": n != "treeattn_no_such_module", "version": "1"} for n in names},
    )
    rep = gr.run_report(tmp_path, 60, steps=steps, devices={"count": 1, "gpus": []})
    by = {s["name"]: s for s in rep["steps"]}
    assert (
        by["wants-missing"]["status"] == "skipped" and by["wants-missing"]["reason"] == "needs treeattn_no_such_module"
    )
    assert by["fine"]["status"] == "pass"
    monkeypatch.setattr(gr, "default_steps", lambda n, out: steps)
    code, text = gr.preflight(tmp_path / "pf")
    assert code == 1 and "wants-missing needs treeattn_no_such_module" in " ".join(text.split()), text
    assert text.splitlines()[-1].startswith("preflight: missing treeattn_no_such_module"), text
    monkeypatch.setitem(gr.FLOORS, "torch", "999.0")  # an installed module older than the floor
    got = real(["torch"], dict(os.environ))["torch"]
    assert not got["ok"] and "older than 999.0" in got["error"], got


def test_the_checkouts_kernels_are_made_importable_when_not_installed(tmp_path, monkeypatch):
    """A copy of the tree on a machine where pip cannot install it: the report links the
    checkout's kernels/ as treeattn_kernels on the steps' PYTHONPATH, and that is what imports."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "treeattn_kernels" else real(name, *a)
    )
    env = dict(os.environ)
    note = gr.kernels_shim(env, tmp_path)
    assert note and "treeattn_kernels is not installed" in note
    monkeypatch.setattr(importlib.util, "find_spec", real)
    got = gr.probe_imports(["treeattn_kernels"], env)["treeattn_kernels"]
    assert got["ok"] and got["file"].startswith(str(tmp_path / "shim" / "treeattn_kernels")), got


def test_calls_with_steps_merge_into_one_report(tmp_path):
    """Two shorter calls (--steps) into one --out make one report: each call's steps replace
    their earlier records, the others stay; another machine's report is replaced, not mixed."""

    def step(name, value):
        return gr.Step(
            name,
            name,
            [sys.executable, "-c", f"print('[{{\"v\": {value}}}]')"],
            cap_s=30,
            floor_s=1,
            parse=lambda text, d: {"records": gr._records(text)},
        )

    dev = {"count": 1, "gpus": []}
    gr.run_report(tmp_path, 60, steps=[step("a", 1), step("b", 2)], devices=dev, only={"a"})
    rep = gr.run_report(tmp_path, 60, steps=[step("a", 1), step("b", 3)], devices=dev, only={"b"})
    assert [(s["name"], s["summary"]["records"][0]["v"]) for s in rep["steps"] if s["name"] != "devices"] == [
        ("a", 1),
        ("b", 3),
    ] and rep["calls"] == 2
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == rep["steps"]
    other = gr.run_report(tmp_path, 60, steps=[step("b", 4)], devices={"count": 2, "gpus": []})
    assert [s["name"] for s in other["steps"]] == ["b"] and "calls" not in other
