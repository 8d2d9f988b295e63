"""``treeattn generate``: prepare in the launching process (``prepare.py``), then run the ranks.

:func:`prepare` adds ``generate``'s prompt (and a saved cache to continue) to what every command
prepares; :func:`generate_command` launches the ranks (or joins torchrun's) and feeds rank 0's
events to the presentation (``report.GenerateView``). Each rank runs the persistent engine
(``engine/engine.py``) on ``generate``'s requests: append the prompt, decode.
"""

from __future__ import annotations

import json
import os
import sys

from .options import GenerateOptions
from .prepare import prepare_run


def prepare(o: GenerateOptions):
    """Everything checkable before a rank starts: (job, tokenizer, devices plan)."""
    from . import prompt as P

    if o.prompt is not None and o.prompt_file is not None:
        raise P.PromptError("give either --prompt or --prompt-file, not both")
    run = prepare_run(o)
    text = P.read_text(o.prompt, o.prompt_file, context=run.context)  # bounded by the context
    system, chat = o.system, o.chat
    demo = text is None
    if demo:
        if o.model is not None or o.load_kv:
            raise P.PromptError(
                "no prompt: give --prompt, --prompt-file or pipe text to standard input"
                + (" (--load-kv continues the cached document with it)" if o.load_kv else "")
            )
        text, demo_system = P.demo_prompt()
        system = system if system is not None else demo_system
        chat = True if chat is None else chat
        o.cite = True  # the demo shows where its answer comes from
    o.max_new_tokens = o.max_new_tokens or (96 if demo else 256)
    manifest, cached = None, 0
    if o.load_kv:
        manifest = run.load_kv(o.load_kv)
        cached = manifest["tokens"]["count"]
        ids = P.question_ids(run.tokenizer, text, manifest["composition"])
    else:
        ids = P.build_ids(run.tokenizer, text, chat=bool(chat), system=system)
    run.check_fits(
        cached + len(ids), o.max_new_tokens, "the cached document and the prompt" if o.load_kv else "the prompt"
    )
    composition = manifest["composition"] if manifest else {"kind": "raw"}
    spans = None
    if o.cite:  # the document's sentences placed on the prompt's tokens (never with --load-kv: checked)
        from .citations import for_prompt

        spans = for_prompt(run.tokenizer, text, ids, chat=bool(chat), system=system)
    job = run.job(
        o,
        ids,
        load_kv=o.load_kv,
        load_manifest=manifest,
        save_kv=o.save_kv,
        save_meta=run.save_meta(o.save_kv, composition) if o.save_kv else {},
        cache_dir=o.cache_dir,
        cache_meta=run.cache_meta(o.cache_dir) if o.cache_dir else {},
        cite=spans.spec() if spans else None,
    )
    if demo:
        print(
            f"treeattn demo: the embedded SmolLM2-135M-Instruct on {run.nproc} {run.kind.upper()} rank(s) "
            f"reads treeattn_cli/data/demo_document.txt ({len(ids)} tokens with the chat template) and "
            f"answers, with its sources (--cite):\n  {P.DEMO_QUESTION}",
            file=sys.stderr,
        )
    return job, run.tokenizer, (run.kind, run.backend, run.nproc, run.devices), spans


def generate_command(o: GenerateOptions) -> int:
    """Run ``treeattn generate``; returns the exit code (0, 1 on a failed run, 130 on Ctrl-C)."""
    from ..parallel import forkserver, launch
    from ..engine.engine import rank_generate
    from ..paths import write_atomic
    from ..report import GenerateView, stats_line, stdout_closed

    job, tok, (kind, be, n, devices), spans = prepare(o)
    torchrun = forkserver.under_torchrun()
    lead = not torchrun or int(os.environ["RANK"]) == 0
    view = GenerateView(tok, stream=not o.json and lead, progress=lead and sys.stderr.isatty())
    code, reason, error, closed = 0, None, None, False
    try:
        if torchrun:
            local = int(os.environ.get("LOCAL_RANK", 0))
            launch.run_torchrun(
                rank_generate,
                job,
                backend=be,
                timeout_s=o.timeout,
                device=f"cuda:{local}" if kind == "cuda" else "cpu",
                on_event=view.on_event,
            )
        else:
            launch.run_local(
                rank_generate, n, job, backend=be, devices=devices, timeout_s=o.timeout, on_event=view.on_event
            )
    except launch.Terminated:
        code, reason = 143, "terminated"
    except KeyboardInterrupt:
        code, reason = 130, "interrupted"
    except launch.LaunchError as e:
        code, reason, error = 1, "error", e
    except BrokenPipeError:  # `| head`: stop quietly; --output still gets the text so far
        code, reason, closed = stdout_closed(), "interrupted", True
    if not lead:
        return code
    record = view.finish(stop_reason=reason)
    cited = record.pop("cite", None)
    if spans is not None and cited is not None:
        from .citations import citations

        record.update(citations(spans, cited, tok, record["token_ids"]))
    if o.json:
        print(json.dumps(record), flush=True)
    if o.output:
        write_atomic(o.output, record["text"])
    if not o.quiet and not closed:  # a closed pipe is the reader saying "enough": no message
        print(stats_line(record), file=sys.stderr)
    if spans is not None and cited is not None and not o.json and not closed:
        from .sources import show

        show(record, spans, where="the prompt")
    if error is not None:
        if o.debug:  # the failing rank's own traceback, collected from it
            tb = next((v[1] for k, v in error.outcomes.values() if k == "error" and v[1]), None)
            if tb:
                print(tb.rstrip(), file=sys.stderr)
        print(f"treeattn: error: {error}", file=sys.stderr)
    return code
