"""Time to first token on one rank against transformers' prefill plus one token (issue 50).

Each pair runs two fresh processes, alternated: ``treeattn generate`` on one CPU rank (the demo:
the embedded model, the shipped document with the chat template, fp32, one new token; its
record's ``ttft_s``, from the start of the request to its first token, the model already
loaded) and transformers' greedy ``generate`` of one token on the same token ids in the same
dtype (timed around the call, the model already loaded). Same FLOPs either way: one prefill of
the prompt and one sampled token. Prints each pair and the median ratio.

    python -m treeattn_cli.bench.ttft [--pairs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_HF = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(int(sys.argv[3]))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32).eval()
ids = torch.tensor([json.load(open(sys.argv[2]))])
with torch.inference_mode():
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                         pad_token_id=0)
    s = time.perf_counter() - t0
print(json.dumps({"seconds": s, "token": int(out[0, -1])}))
"""


def demo_ids():
    """The demo's prompt ids and model folder, as ``treeattn generate`` composes them."""
    from ..cli import prompt as P
    from ..cli.prepare import prepare_run
    from ..cli.options import GenerateOptions

    o = GenerateOptions(nproc=1, dtype="float32")
    run = prepare_run(o)
    text, system = P.demo_prompt()
    return P.build_ids(run.tokenizer, text, chat=True, system=system), str(run.model_dir)


def ours() -> tuple[float, int]:
    cmd = [
        sys.executable,
        "-m",
        "treeattn_cli.main",
        "generate",
        "--nproc",
        "1",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "1",
        "--json",
        "--quiet",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rec = [json.loads(line) for line in out.splitlines() if line.startswith("{")][-1]
    return rec["ttft_s"], rec["token_ids"][0] if rec.get("token_ids") else -1


def theirs(model_dir: str, ids_file: str, threads: int) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, "-c", _HF, model_dir, ids_file, str(threads)], capture_output=True, text=True, check=True
    ).stdout
    rec = json.loads(out.splitlines()[-1])
    return rec["seconds"], rec["token"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import torch

    ids, model_dir = demo_ids()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "ids.json"
        f.write_text(json.dumps(ids))
        pairs = []
        for i in range(a.pairs):
            if i % 2:  # alternate which runs first
                (t, tt), (o, ot) = theirs(model_dir, str(f), threads), ours()
            else:
                (o, ot), (t, tt) = ours(), theirs(model_dir, str(f), threads)
            pairs.append({"ours_s": o, "transformers_s": t, "ratio": o / t, "same_token": ot == tt})
            if not a.json:
                print(
                    f"pair {i + 1}: ours {o:.2f} s, transformers {t:.2f} s, {o / t:.2f}x"
                    f"{'' if ot == tt else ' (first tokens differ!)'}",
                    flush=True,
                )
    res = {
        "prompt_tokens": len(ids),
        "threads": threads,
        "pairs": pairs,
        "median_ratio": statistics.median(p["ratio"] for p in pairs),
        "ours_median_s": statistics.median(p["ours_s"] for p in pairs),
        "transformers_median_s": statistics.median(p["transformers_s"] for p in pairs),
    }
    if a.json:
        print(json.dumps(res))
    else:
        print(
            f"{len(ids)} prompt tokens, {threads} threads: ours {res['ours_median_s']:.2f} s, transformers "
            f"{res['transformers_median_s']:.2f} s, median pair {res['median_ratio']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
