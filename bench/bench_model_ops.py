"""The model's per-layer ops through transformers and through the fused launchers, side by side.

A random-weight Llama with Llama-3.1-8B's attention shape (``--layers`` layers, bf16 on CUDA) runs one
step of ``--batch`` tokens (what the engine's captured decode step runs for ``--batch`` generations:
projections, RMSNorms, RoPE, MLPs; attention here is plain causal over the step's own tokens, without a
stored prefix), captured in a CUDA graph and replayed, first with transformers' RoPE and RMSNorm, then routed
through ``workers.model_ops`` (one launch each). Printed: ms per replay of each and their ratio, and whether
the two give the same greedy tokens.

    python3 bench/bench_model_ops.py --layers 8 --batch 8 --json out.json
    python3 bench/bench_model_ops.py --quick         # CPU smoke run (both rows are transformers' arithmetic)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import QUICK_SPEC, llama8b_attention_spec  # noqa: E402
from lab.tiny_random import build_tiny_llama  # noqa: E402
from workers.model import load_model  # noqa: E402
from workers.model_ops import use_fused_ops  # noqa: E402


def step_ms(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, reps: int) -> tuple[float, torch.Tensor]:
    """Median ms of one step (a CUDA graph replay on CUDA, an eager forward elsewhere) and its logits."""
    def fwd() -> torch.Tensor:
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    with torch.no_grad():
        out = fwd()
        if ids.is_cuda:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fwd()  # warm the kernels and the allocator off the capture
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                out = fwd()
            run = graph.replay
        else:
            run = fwd  # type: ignore[assignment]
        times = []
        for _ in range(reps):
            if ids.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            if ids.is_cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out.float().clone()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="tokens per step (one per generation)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="tiny shape on the CPU (smoke run)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    spec = QUICK_SPEC if args.quick else llama8b_attention_spec(args.layers, 4096)
    reps = 5 if args.quick else args.reps
    with tempfile.TemporaryDirectory() as work:
        lm = load_model(str(build_tiny_llama(Path(work) / "model", spec)), device="cuda" if cuda else "cpu",
                        dtype="bfloat16" if cuda else "float32", progress=False, fused_ops=False)
        dev = lm.model.device
        ids = torch.randint(10, 200, (1, args.batch), device=dev)
        pos = torch.arange(1000, 1000 + args.batch, device=dev)[None]
        plain_ms, plain = step_ms(lm.model, ids, pos, reps)
        norms = use_fused_ops(lm.model)
        fused_ms, fused = step_ms(lm.model, ids, pos, reps)
    same = bool(torch.equal(plain.argmax(-1), fused.argmax(-1)))
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; {spec.n_layers} layers, hidden "
          f"{spec.hidden_size}, {spec.n_heads}/{spec.n_kv_heads} heads; {args.batch} tokens per step; "
          f"{norms} RMSNorms routed\n")
    print("| model ops | ms per step | vs transformers' |")
    print("|---|---|---|")
    print(f"| transformers' RoPE and RMSNorm | {plain_ms:.3f} | 1.00 |")
    print(f"| fused (one launch each) | {fused_ms:.3f} | {fused_ms / plain_ms:.2f} |")
    print(f"\nsame greedy tokens: {same}; max |logit difference| {(plain - fused).abs().max().item():.3g}")
    if args.json:
        args.json.write_text(json.dumps({"layers": spec.n_layers, "batch": args.batch, "plain_ms": plain_ms,
                                         "fused_ms": fused_ms, "same_tokens": same}, indent=1))


if __name__ == "__main__":
    main()
