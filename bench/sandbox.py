"""What the python tool's sandbox costs: start-up latency of one sandboxed run against a bare
`python -I -S -B -c pass` subprocess of the same interpreter, measured in the same run, interleaved.

A sandboxed run is `run_python("pass")` end to end: memfds, the bwrap process, its namespaces and
mounts, the seccomp filter, the interpreter's start, the guard's rlimits, reading the output. The bare
run is `subprocess.run` of the same interpreter with the same flags. Prints the median and p95 of each,
their ratio (sandbox / bare; the goal is within 3x) and sandboxed calls per second, one after another.

    .venv/bin/python bench/sandbox.py [--n 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="runs of each kind (interleaved)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.n < 2:
        parser.error("--n must be at least 2")

    from skillswarm.skills.sandbox import run_python, runtime_view
    from skillswarm.skills.sandbox.bwrap import bwrap_version

    bare_cmd = [runtime_view().interpreter, "-I", "-S", "-B", "-c", "pass"]
    for _ in range(3):  # warm the page cache and the runtime view
        run_python("pass")
        subprocess.run(bare_cmd, check=True)
    sandbox_ms, bare_ms = [], []
    wall = 0.0
    for _ in range(args.n):
        t0 = time.perf_counter()
        result = run_python("pass")
        t1 = time.perf_counter()
        subprocess.run(bare_cmd, stdin=subprocess.DEVNULL, check=True)
        t2 = time.perf_counter()
        if not result.ok:
            raise SystemExit(f"a sandboxed `pass` failed: {result}")
        sandbox_ms.append((t1 - t0) * 1000)
        bare_ms.append((t2 - t1) * 1000)
        wall += t1 - t0
    out = {
        "n": args.n, "bwrap": bwrap_version(),
        "sandbox_ms_p50": round(statistics.median(sandbox_ms), 2), "sandbox_ms_p95": round(_pct(sandbox_ms, 0.95), 2),
        "bare_ms_p50": round(statistics.median(bare_ms), 2), "bare_ms_p95": round(_pct(bare_ms, 0.95), 2),
        "ratio": round(statistics.median(sandbox_ms) / statistics.median(bare_ms), 2),
        "calls_per_s": round(args.n / wall, 1),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"sandboxed run ({out['bwrap']}): p50 {out['sandbox_ms_p50']} ms, p95 {out['sandbox_ms_p95']} ms, "
          f"{out['calls_per_s']} calls/s")
    print(f"bare python -c pass:          p50 {out['bare_ms_p50']} ms, p95 {out['bare_ms_p95']} ms")
    print(f"ratio (sandbox / bare, p50): {out['ratio']}x (goal: within 3x)")


if __name__ == "__main__":
    main()
