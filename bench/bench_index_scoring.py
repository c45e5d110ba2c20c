"""Time and peak temporary memory of scoring a mid region on the int4 key index: from the codes vs dequantized.

Llama-3.1-8B's attention shape (8 KV heads x G=4, D=128), one query token, a random 4-bit index
(64-token blocks). ``codes`` is ``key_index.index_logits`` (what ``topk`` runs); ``dequant`` is the
path it replaced (``dequantize_keys`` to float32, then one einsum). Each (path, length) runs in a
fresh process so its peak memory is its own: on CPU the rise of the peak RSS over the loaded index,
on CUDA ``max_memory_allocated`` over the allocated index.

    python3 bench/bench_index_scoring.py --ctx 32768 131072
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import timed  # noqa: E402
from workers.methods.key_index import dequantize_keys, index_logits  # noqa: E402

HKV, G, D, BLOCK = 8, 4, 128, 64


def _index(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (HKV, n, D // 2), dtype=torch.uint8, generator=g)
    blocks = -(-n // BLOCK)
    lo = torch.randn(HKV, blocks, D, generator=g).half()
    step = (torch.rand(HKV, blocks, D, generator=g) * 0.2).half()
    return codes.to(device), lo.to(device), step.to(device)


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one(path: str, n: int, reps: int, device: torch.device) -> dict[str, float]:
    """Median seconds per call and peak temporary bytes of one path at ``n`` mid tokens."""
    codes, lo, step = _index(n, device)
    q = torch.randn(1, HKV, G, D, device=device, dtype=torch.bfloat16)

    def call() -> torch.Tensor:
        if path == "codes":
            return index_logits(q, codes, lo, step, 4, BLOCK)
        return torch.einsum("thgd,hnd->thgn", q.float(), dequantize_keys(codes, lo, step, 4, BLOCK))

    base = _peak(device)
    seconds = timed(call, reps, device, warmup=1)
    return {"s": seconds, "peak_tmp_bytes": _peak(device) - base}


def main() -> None:
    """Run each (length, path) in its own process; print a table with the ratios."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ctx", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--one", nargs=2, metavar=("PATH", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.reps, device)))
        return
    print(f"device {device}, threads {torch.get_num_threads()}, Hkv={HKV} G={G} D={D} int4, block {BLOCK}")
    print("mid tokens | dequant ms | codes ms | speed-up | dequant peak MiB | codes peak MiB")
    for n in args.ctx:
        r = {}
        for path in ("dequant", "codes"):
            out = subprocess.run([sys.executable, __file__, "--one", path, str(n), "--reps", str(args.reps),
                                  "--device", args.device], check=True, capture_output=True, text=True).stdout
            r[path] = json.loads(out.strip().splitlines()[-1])
        d, c = r["dequant"], r["codes"]
        print(f"{n} | {d['s'] * 1e3:.1f} | {c['s'] * 1e3:.1f} | {d['s'] / c['s']:.2f}x | "
              f"{d['peak_tmp_bytes'] / 2**20:.0f} | {c['peak_tmp_bytes'] / 2**20:.0f}")


if __name__ == "__main__":
    main()
