"""The combination test's command line: the long run, one case, the configurations a run draws.

    python tools/combos.py --seed S                  # re-run one case (a failure prints this line)
    python tools/combos.py --seeds 500 [--first N]   # the long run (CI runs its first seeds: tests/test_combinations.py)
    python tools/combos.py --show --seeds 40         # what the first 40 draw
    python tools/combos.py --by-feature --seeds 40   # which seeds reach each feature, the slowest ones

The configurations, the rank function and the check are ``tests/combos.py``'s (the test imports
them too).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from combos import draw, features, fixtures, report, run  # noqa: E402


def main(argv=None) -> int:
    import os
    import tempfile

    ap = argparse.ArgumentParser(
        description="The combination test: random configurations, each answer against the same request alone."
    )
    ap.add_argument("--seed", type=int, action="append", help="run this configuration (repeatable)")
    ap.add_argument("--seeds", type=int, default=40, help="how many configurations (default 40)")
    ap.add_argument("--first", type=int, default=0, help="the first seed of --seeds")
    ap.add_argument("--root", default=None, help="where models, documents and saved caches go (default: a temp dir)")
    ap.add_argument("--show", action="store_true", help="print the configurations and exit")
    ap.add_argument(
        "--by-feature",
        action="store_true",
        help="also list the seeds that covered each feature, and the slowest configurations",
    )
    a = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the ranks load a model per configuration
    from treeattn_cli.parallel import forkserver

    forkserver.MANY_LAUNCHES["on"] = True  # ranks start once per rank set and configuration
    seeds = a.seed or list(range(a.first, a.first + a.seeds))
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="treeattn-combos-"))
    if a.show:
        fx = fixtures(root / "fixtures")
        for s in seeds:
            print(draw(s, fx).line())
        return 0
    t0 = time.perf_counter()
    configs, results, problems, notes = run(
        seeds,
        root,
        progress=lambda m, n, s: print(
            f"rank set {m[0]}x{m[1]}: {n} configurations in {s:.1f} s", file=sys.stderr, flush=True
        ),
    )
    seen: dict = {}
    by: dict = {}
    for s, c in configs.items():
        for f in features(c, results.get(s, {"error": ""})):
            seen[f] = seen.get(f, 0) + 1
            by.setdefault(f, []).append(s)
    print(f"{len(configs)} configurations in {time.perf_counter() - t0:.0f} s: {len(problems)} failed")
    print("covered: " + ", ".join(f"{k} {v}" for k, v in sorted(seen.items())))
    if a.by_feature:
        for f, ss in sorted(by.items()):
            print(f"seeds of {f}: {' '.join(map(str, ss))}")
        slow = sorted(((r.get("seconds", 0.0), s) for s, r in results.items()), reverse=True)
        print("slowest: " + ", ".join(f"{s} {t:.0f} s" for t, s in slow[:12]))
    for line in notes:
        print(f"note: {line}")
    if problems:
        print(report(configs, problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
