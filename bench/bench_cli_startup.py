"""Start-up time of ``kvstash`` commands that load no model, against a bare ``python -c pass``.

Each command runs ``--runs`` times as a fresh process (as a user types it); printed: best and median wall
time, and the median over the bare interpreter's. The target (issue 18): ``kvstash --help`` and
``kvstash ls`` under 0.5 s on the 2-core development machine.

    python3 bench/bench_cli_startup.py --json out.json
    python3 bench/bench_cli_startup.py --quick            # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 0.5


def _times(cmd: list[str], runs: int, env: dict[str, str]) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=300, check=False)
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10, help="runs per command (default 10)")
    p.add_argument("--quick", action="store_true", help="3 runs each")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    runs = 3 if args.quick else args.runs
    with tempfile.TemporaryDirectory(prefix="kvstash-bench-") as home:
        env = {**os.environ, "KVSTASH_HOME": home}
        cli = [sys.executable, "-m", "client.cli"]
        commands = {"python -c pass": [sys.executable, "-c", "pass"], "kvstash --help": [*cli, "--help"],
                    "kvstash ls": [*cli, "ls"], "kvstash info (no such prefix)": [*cli, "info", "0" * 32],
                    "kvstash generate (bad argument)": [*cli, "generate", "--prefix", "0" * 32, "Q", "--top-p", "x"]}
        rows = {name: _times(cmd, runs, env) for name, cmd in commands.items()}
    bare = statistics.median(rows["python -c pass"])
    print(f"{runs} runs each, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print("| command | best s | median s | median over python -c pass s | under 0.5 s |")
    print("|---|---|---|---|---|")
    result = []
    for name, ts in rows.items():
        med = statistics.median(ts)
        print(f"| {name} | {min(ts):.3f} | {med:.3f} | {med - bare:.3f} | {'yes' if med < TARGET_S else 'NO'} |")
        result.append({"command": name, "best_s": min(ts), "median_s": med, "over_bare_s": med - bare})
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "rows": result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
