"""Command line: ``treeattn generate | topo | bench``. Parses, validates, calls one function.

Errors a user can fix print one line on stderr and exit 2 (usage) or 1 (the run failed);
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

import typer

from . import __version__
from .cli.options import (
    ANSWER_FLAGS,
    CACHE_FLAGS,
    CITE_FLAGS,
    MODEL_FLAGS,
    REPORT_FLAGS,
    RUN_FLAGS,
    SERVE_FLAGS,
    SPECULATE_FLAGS,
)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Exact long-context decoding across GPUs with Tree Attention.",
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool):
    if value:
        typer.echo(f"treeattn {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
):
    """Exact long-context decoding across GPUs with Tree Attention."""


def _library_env() -> None:
    """Set before the ranks' fork server starts: its ranks inherit this environment."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _quiet_libraries() -> None:
    _library_env()
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:
        pass


def with_flags(*blocks):
    """The decorated command also takes the flags of ``blocks`` (``cli/options.py``: defined once,
    shared by every command that runs a model); they arrive as keyword arguments."""
    import functools
    import inspect

    def deco(fn):
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        extra = [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=f.type,
                default=typer.Option(f.default, *f.decls, help=f.help),
            )
            for block in blocks
            for f in block
        ]

        @functools.wraps(fn)
        def command(**kw):
            return fn(**kw)

        command.__signature__ = sig.replace(parameters=own + extra)
        command.__annotations__ = {**getattr(fn, "__annotations__", {}), **{p.name: p.annotation for p in extra}}
        return command

    return deco


def _run(name: str, opts, *, terminated_message: bool) -> None:
    """Run a command that launches ranks (``cli/<name>.py``'s ``<name>_command``): SIGTERM like
    Ctrl-C, one-line errors, the exit code. The ranks' fork server starts first, before this
    process imports torch with the command's module (``parallel/forkserver.py``)."""
    import importlib

    from .parallel import forkserver

    _library_env()
    if not forkserver.under_torchrun():
        forkserver.warm_early()
    command = getattr(importlib.import_module(f".cli.{name}", __package__), f"{name}_command")
    from .parallel.launch import Terminated

    _quiet_libraries()
    try:
        with _sigterm_like_ctrl_c():
            code = command(opts)
    except typer.Exit:
        raise
    except Terminated:  # before any rank started: nothing to keep
        if terminated_message:
            typer.echo("treeattn: terminated", err=True)
        code = 143
    except KeyboardInterrupt:  # before any rank started (loading, converting): nothing to keep
        typer.echo("treeattn: interrupted", err=True)
        code = 130
    except Exception as e:
        if opts.debug:
            raise
        code = _report(e)
    raise typer.Exit(code)


@app.command()
@with_flags(MODEL_FLAGS, ANSWER_FLAGS, CITE_FLAGS, SPECULATE_FLAGS, RUN_FLAGS, CACHE_FLAGS, REPORT_FLAGS)
def generate(
    prompt: Optional[str] = typer.Option(None, help="The prompt text."),
    prompt_file: Optional[str] = typer.Option(None, help="Read the prompt from a file ('-': standard input)."),
    chat: Optional[bool] = typer.Option(
        None, "--chat/--no-chat", help="Apply the tokenizer's chat template (default: on for the demo)."
    ),
    output: Optional[str] = typer.Option(None, help="Also write the generated text to this file (atomically)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON record at the end instead of streaming."),
    **flags,
):
    """Load a model, shard a long prompt's KV cache across ranks, stream tokens."""
    from .cli.options import GenerateOptions

    opts = _check_first(
        GenerateOptions(prompt=prompt, prompt_file=prompt_file, chat=chat, output=output, json=json_out, **flags)
    )
    _run("generate", opts, terminated_message=True)


@contextlib.contextmanager
def _sigterm_like_ctrl_c():
    """Inside: SIGTERM (what Slurm, Kubernetes, systemd and `timeout` send) stops a run the way
    Ctrl-C does: ranks stopped at once, text kept, exit status 143."""
    import signal
    import threading

    from .parallel.launch import Terminated

    def raise_terminated(signum, frame):
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _check_first(opts, check=None):
    """``opts`` once its flags pass the checks that need neither torch nor the model (before
    those imports: a mistyped flag costs a fraction of a second; ``check``: the command's own,
    default ``options.check_flags``); else exit 2 with one line."""
    from .cli.options import check_flags

    try:
        (check or check_flags)(opts)
    except ValueError as e:
        if opts.debug:
            raise
        raise typer.Exit(_report(e))
    return opts


def _report(e: BaseException) -> int:
    """One line for the user; 2 for bad input, 1 for a failed run; a closed standard output
    (``| head``) ends the command quietly with SIGPIPE's status."""
    if isinstance(e, BrokenPipeError):
        from .report import stdout_closed

        return stdout_closed()
    launch = sys.modules.get(f"{__package__}.parallel.launch")  # not imported yet: no run was launched
    usage = isinstance(e, ValueError) and not (launch and isinstance(e, launch.LaunchError))
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    typer.echo(f"treeattn: error: {msg}", err=True)
    return 2 if usage else 1


@app.command()
def topo(
    from_file: Optional[str] = typer.Option(
        None, help="Parse a saved `nvidia-smi topo -m` or `rocm-smi --showtopo` output instead of probing."
    ),
    profile: Optional[str] = typer.Option(
        None,
        help="Link figures for the cost model: a built-in name (dgx-h100, mi300x, rtx4090-pcie, cpu-gloo) or a YAML path.",
    ),
    measure: bool = typer.Option(
        False, help="Measure per-pair latency/bandwidth and group all_reduce latency on this machine's ranks."
    ),
    save: Optional[str] = typer.Option(
        None, help="With --measure: write the measured profile here (for generate --layout / bench)."
    ),
    nproc: Optional[int] = typer.Option(None, help="Ranks to plan (and measure) for (default: all GPUs; 2 CPU ranks)."),
    tp: int = typer.Option(
        1, help="Tensor-parallel ranks per sequence shard: plan the merge over the cp groups of --nproc / T ranks."
    ),
    batch: int = typer.Option(1, help="Batch size of the merges the layout is priced for."),
    heads: int = typer.Option(32, help="Query heads (default: Llama-3.1-8B)."),
    head_dim: int = typer.Option(128, help="Head dimension."),
    layers: int = typer.Option(32, help="Layers per decode step."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    debug: bool = typer.Option(False, help="Show full tracebacks."),
):
    """Probe the interconnect (NVLink, PCIe, Infinity Fabric) and choose the reduction layout."""
    from .report import print_topology
    from .cli.topo import TopoOptions, topo_command

    try:
        for flag, v in (
            ("--nproc", nproc if nproc is not None else 1),
            ("--batch", batch),
            ("--heads", heads),
            ("--head-dim", head_dim),
            ("--layers", layers),
        ):
            if v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        rec = topo_command(
            TopoOptions(
                from_file=from_file,
                profile=profile,
                measure=measure,
                save=save,
                nproc=nproc,
                batch=batch,
                heads=heads,
                head_dim=head_dim,
                layers=layers,
                tp=tp,
            )
        )
    except Exception as e:
        if debug:
            raise
        raise typer.Exit(_report(e))
    print_topology(rec, as_json=json_out)


@app.command()
def bench(
    methods: str = typer.Option("tree,ring,single", help="Comma list of tree, ring, single."),
    scheme: str = typer.Option("auto", help="Tree merge scheme(s): auto (the layout's), all, or a comma list."),
    seq_len: str = typer.Option("16384", help="Comma list of total KV lengths (16K, 1M allowed)."),
    batch: str = typer.Option("1", help="Batch size, or a comma list (the decode sweep and --simulate run each)."),
    shared: bool = typer.Option(
        False, help="The batch's sequences share one document (chat --batch): B query rows against one cache."
    ),
    heads: int = typer.Option(32, help="Query heads (default: Llama-3.1-8B)."),
    kv_heads: int = typer.Option(8, help="KV heads."),
    head_dim: int = typer.Option(128, help="Head dimension."),
    dtype: str = typer.Option("auto", help="auto (bfloat16 on GPUs, float32 on CPU) | float32 | bfloat16 | float16."),
    nproc: Optional[str] = typer.Option(
        None, help="Ranks, or a comma list of rank counts (default: visible GPUs, 2 on a CPU-only machine)."
    ),
    backend: str = typer.Option("auto", help="auto | nccl | gloo."),
    device: str = typer.Option("auto", help="auto | cuda | cpu."),
    layers: int = typer.Option(1, help="Layers per timed decode step."),
    iters: int = typer.Option(10, help="Timed iterations per case."),
    warmup: int = typer.Option(3, help="Untimed iterations per case."),
    layout: Optional[str] = typer.Option(None, help="Profile for the layout choice (name or YAML path)."),
    simulate: Optional[str] = typer.Option(
        None, help="Project with the α–β model for a profile (e.g. dgx-h100) instead of running."
    ),
    gpus: str = typer.Option("8,64,128,1024", help="With --simulate: cluster sizes."),
    kernel: bool = typer.Option(False, help="Time the local partial-attention kernel against SDPA and flex_attention."),
    model: Optional[str] = typer.Option(
        None, help="Model-level mode: decode ms/token of generate per method on this model."
    ),
    tp: str = typer.Option(
        "1",
        help="Tensor-parallel ranks per sequence shard (model mode: one value; --simulate: a comma list to compare).",
    ),
    model_shape: Optional[str] = typer.Option(
        None,
        help="With --simulate: project a whole model's decode step on a (cp x tp) mesh: llama-3.1-8b | llama-3.1-70b | llama-3.1-405b.",
    ),
    prefill: bool = typer.Option(
        False,
        help="Causal prefill attention per sharding (balanced, contiguous, single) instead of decode; with --simulate, a whole model's prefill.",
    ),
    mfu: float = typer.Option(
        0.5, help="With --simulate --prefill: the fraction of the profile's peak FLOP/s that compute runs at."
    ),
    acceptance: Optional[float] = typer.Option(
        None,
        help="With --simulate --model-shape: also price speculative decoding, each draft kept with this probability (e.g. 0.7, as `generate --json` reports).",
    ),
    draft_k: int = typer.Option(8, help="With --acceptance: drafts per verify step."),
    new_tokens: int = typer.Option(16, help="Model-level mode: tokens decoded per run."),
    kv_dtype: str = typer.Option(
        "auto",
        help="KV cache storage: auto | bfloat16 | float16 | float32 | fp8 (the decode "
        "sweep, model mode and --simulate read the cache as stored).",
    ),
    max_context: bool = typer.Option(
        False,
        help="With --simulate: the longest context that fits --gpus GPUs for "
        "--model-shape (default 8B and 70B) with bf16 and fp8 KV (or --kv-dtype).",
    ),
    census: bool = typer.Option(
        False,
        help="Count the decode step's device operations per layer and per step for --model-shape "
        "(default llama-3.1-8b), as it runs here: one CPU rank, random weights, the model cut to 2 and 3 layers.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the records as a JSON list."),
    csv: Optional[str] = typer.Option(None, help="Also write the records as CSV."),
    plot: Optional[str] = typer.Option(None, help="Also write a PNG: step time vs sequence length per method."),
    debug: bool = typer.Option(False, help="Show full tracebacks."),
):
    """Compare tree vs ring vs one device on the same attention work."""
    from . import report
    from .bench.run import BenchOptions, bench_command

    _quiet_libraries()
    try:
        if prefill and simulate and tp == "1":
            tp = "8"  # the whole-model prefill projection: tensor parallel inside each 8-GPU node
        with report.sweep_progress(enabled=sys.stderr.isatty() and not (simulate or kernel or model)) as progress:
            recs = bench_command(
                BenchOptions(
                    methods=methods,
                    scheme=scheme,
                    seq_len=seq_len,
                    batch=batch,
                    shared=shared,
                    heads=heads,
                    kv_heads=kv_heads,
                    head_dim=head_dim,
                    dtype=dtype,
                    nproc=nproc,
                    backend=backend,
                    device=device,
                    layers=layers,
                    iters=iters,
                    warmup=warmup,
                    simulate=simulate,
                    gpus=gpus,
                    kernel=kernel,
                    model=model,
                    new_tokens=new_tokens,
                    layout=layout,
                    tp=tp,
                    model_shape=model_shape,
                    prefill=prefill,
                    mfu=mfu,
                    acceptance=acceptance,
                    draft_k=draft_k,
                    kv_dtype=kv_dtype,
                    max_context=max_context,
                    census=census,
                ),
                on_progress=progress,
            )
        if census:
            report.print_census(recs, as_json=json_out)
        elif max_context:
            report.print_max_context(recs, as_json=json_out)
        elif prefill:
            report.print_prefill(recs, as_json=json_out)
        elif simulate and (tp != "1" or model_shape):
            report.print_mesh_projection(recs, as_json=json_out)
        elif kernel:
            report.print_kernel_records(recs, as_json=json_out)
        elif model:
            report.print_model_records(recs, as_json=json_out)
        else:
            report.print_bench(recs, as_json=json_out)
        if csv:
            report.write_csv(recs, csv)
        if plot:
            report.write_plot(recs, plot)
    except Exception as e:
        if debug:
            raise
        raise typer.Exit(_report(e))


@app.command()
@with_flags(MODEL_FLAGS, ANSWER_FLAGS, CITE_FLAGS, SPECULATE_FLAGS, RUN_FLAGS, CACHE_FLAGS, REPORT_FLAGS)
def chat(
    prompt_file: Optional[str] = typer.Option(
        None, help="The document ('-': standard input), prefilled once; questions follow."
    ),
    questions: Optional[str] = typer.Option(
        None, help="Answer each line of this file in order, then exit ('-': standard input)."
    ),
    conversation: bool = typer.Option(
        False, help="Keep the turns (default: each question against the document alone)."
    ),
    chat_template: Optional[bool] = typer.Option(
        None,
        "--chat/--no-chat",
        help="Wrap document and question in the chat template (default: if the tokenizer has one).",
    ),
    json_out: bool = typer.Option(
        False, "--json", help="One JSON record per answer (generate's fields and the question)."
    ),
    output: Optional[str] = typer.Option(
        None,
        help="Also write the answers to this file, each followed by a newline, in the order shown (rewritten atomically after each answer).",
    ),
    batch: int = typer.Option(
        8,
        help="Questions from --questions or a pipe that decode together over the shared document (typed ones and --conversation: one at a time); each answer is bit for bit the one it gets alone.",
    ),
    **flags,
):
    """Prefill a long document once, then answer many questions about it.

    Every answer is bit for bit the one its question gets alone (in any --batch, with any
    --speculate, for a given model, --dtype, --kv-dtype and number of ranks); greedy in float32
    its tokens are transformers' greedy generate's. --digest shows the bits."""
    from .cli.options import ChatOptions

    opts = _check_first(
        ChatOptions(
            prompt_file=prompt_file,
            questions=questions,
            conversation=conversation,
            chat=chat_template,
            json=json_out,
            output=output,
            batch=batch,
            **flags,
        )
    )
    _run("chat", opts, terminated_message=False)


@app.command()
@with_flags(SERVE_FLAGS, MODEL_FLAGS, SPECULATE_FLAGS, RUN_FLAGS, REPORT_FLAGS)
def serve(**flags):
    """Serve the model over OpenAI's API (chat and completions, streamed), with a document cache."""
    from .cli.options import ServeOptions, check_serve_flags

    opts = _check_first(ServeOptions(**flags), check_serve_flags)
    _run("serve", opts, terminated_message=False)


@app.command()
def check(
    nproc: Optional[int] = typer.Option(
        None, help="Ranks for the multi-rank checks (default: visible GPUs, 2 on a CPU-only machine)."
    ),
    device: str = typer.Option("auto", help="auto | cuda | cpu."),
    backend: str = typer.Option("auto", help="auto | nccl | gloo."),
    kernels_only: bool = typer.Option(False, help="Only the kernel checks (what generate runs once per machine)."),
    kv_dtype: Optional[str] = typer.Option(
        None,
        help="Instead: measure how storing the KV cache as this dtype "
        "(fp8, bfloat16, float16) moves the model's predictions on --prompt-file "
        "against its own dtype (top-1 agreement, mean KL, greedy agreement).",
    ),
    prompt_file: Optional[str] = typer.Option(None, help="With --kv-dtype: the document to measure on."),
    model: Optional[str] = typer.Option(None, help="With --kv-dtype: the model (default: the embedded demo model)."),
    dtype: str = typer.Option("auto", help="With --kv-dtype: the model's dtype (auto | float32 | bfloat16 | float16)."),
    max_new_tokens: int = typer.Option(32, help="With --kv-dtype: greedy tokens compared after the document."),
    max_tokens: Optional[int] = typer.Option(
        None, help="With --kv-dtype: measure the document's first N tokens (one device holds both caches)."
    ),
    trust_remote_code: bool = typer.Option(False, help="Allow a model's own Python code from its repository."),
    allow_pickle: bool = typer.Option(False, help="Allow pickled .bin weights (they can run code)."),
    json_out: bool = typer.Option(False, "--json", help="Print the records as JSON."),
    quiet: bool = typer.Option(False, help="No progress lines."),
    debug: bool = typer.Option(False, help="Show full tracebacks."),
):
    """Check every path this machine takes (kernels, merges, ring, generate) against its reference;
    with --kv-dtype, how a lossy KV cache moves the model's predictions on your document."""
    from . import report
    from .cli.check import check_command

    _quiet_libraries()
    if kv_dtype is not None:
        raise typer.Exit(
            _fidelity(
                kv_dtype,
                prompt_file,
                model,
                dtype,
                device,
                max_new_tokens,
                max_tokens,
                trust_remote_code,
                allow_pickle,
                json_out,
                quiet,
                debug,
            )
        )
    try:
        if nproc is not None and nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        say = None if quiet else (lambda what: typer.echo(f"treeattn check: {what}", err=True))
        recs = check_command(nproc=nproc, device=device, backend=backend, kernels_only=kernels_only, on_progress=say)
    except Exception as e:
        if debug:
            raise
        raise typer.Exit(_report(e))
    if not quiet or json_out:
        report.print_check(recs, as_json=json_out)
    raise typer.Exit(1 if any(r["verdict"] == "FAIL" for r in recs) else 0)


def _fidelity(
    kv_dtype,
    prompt_file,
    model,
    dtype,
    device,
    max_new_tokens,
    max_tokens,
    trust_remote_code,
    allow_pickle,
    json_out,
    quiet,
    debug,
) -> int:
    """``check --kv-dtype``: 0 when the lossy cache stays within the thresholds, 1 when it drifts."""
    from . import report
    from .cli.check import fidelity_command

    try:
        say = None if quiet else (lambda what: typer.echo(f"treeattn check: {what}", err=True))
        rec = fidelity_command(
            kv_dtype=kv_dtype,
            prompt_file=prompt_file,
            model=model,
            dtype=dtype,
            device=device,
            new_tokens=max_new_tokens,
            max_tokens=max_tokens,
            trust_remote_code=trust_remote_code,
            allow_pickle=allow_pickle,
            on_progress=say,
        )
    except Exception as e:
        if debug:
            raise
        return _report(e)
    report.print_fidelity(rec, as_json=json_out)
    return 0 if rec["ok"] else 1


def _stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints every thread's Python stack on stderr and the run goes on (the
    launcher and each rank: what a run that seems stuck is doing)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def main() -> None:
    """The console script: the Typer app; a usage error Click finds (an unknown command or
    flag, a missing value) is one line in the style of every other error, exit 2; a closed
    standard output anywhere (``treeattn topo --json | head -c 10``) ends it quietly, as other
    command-line tools end."""
    _stacks_on_sigusr1()
    try:
        rv = app(standalone_mode=False)
    except typer.Abort:  # Ctrl-C outside a run (a run answers it itself)
        sys.exit(130)
    except typer.TyperException as e:  # Click's usage errors (Typer carries its own Click)
        if not hasattr(e, "format_message"):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `treeattn`: the help, as Click shows it
            typer.echo(e.format_message(), err=True)
            sys.exit(2)
        code, ctx = getattr(e, "exit_code", 1), getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if code == 2 and ctx is not None else ""
        typer.echo(f"treeattn: error: {e.format_message()}{hint}", err=True)
        sys.exit(code)
    except BrokenPipeError:
        from .report import stdout_closed

        sys.exit(stdout_closed())
    _leave(rv if isinstance(rv, int) else 0)


def _leave(code: int) -> None:
    """End a finished command with ``code``: the interpreter's own exit work first (``atexit``:
    multiprocessing's finalizers, logging), the standard streams flushed, then ``os._exit``,
    which skips what native libraries tear down at exit (their thread pools, static
    destructors). By then the ranks have stopped and everything is printed; nothing of ours runs
    there. Why: ``chat`` was seen twice on CI, after its last answer and Ctrl-D, not to exit in
    60 s, and ``kill -USR1`` printed no Python stack for it, where a process still in the
    interpreter prints one (``_stacks_on_sigusr1``; checked on a live chat): most likely it hung
    past the interpreter, in that teardown (tests/cli/test_chat.py's Ctrl-D test now also prints what
    the kernel says each thread waits in, should it happen again)."""
    import atexit

    atexit._run_exitfuncs()  # (what the interpreter's own exit runs first)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # the reader left at the very end: as any closed pipe
            from .report import stdout_closed

            code = code or stdout_closed()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
