"""CUDA-graph replay of fixed-shape decode steps gives what eager steps give (outputs, reads, tokens).

Skipped without a GPU. Run on one with ``TRITON_INTERPRET=0 pytest tests/test_step_graphs.py``.
Tolerance: replays run the same kernels on the same inputs as the eager steps, so outputs are
compared exactly (fp32 and bf16).
"""

from __future__ import annotations

import pytest
import torch

from workers.decode_batch import EngineConfig
from workers.engine import Worker
from workers.methods.memory import MemorySource
from workers.methods.registry import METHODS, get_method
from workers.methods.sparse import SparsePrefixAttention
from workers.methods.step_graphs import StepGraphs, run_graphed
from workers.model import load_model
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DOC = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike " * 40 + "The code is 4411."


def _steps(attn, qs: list[torch.Tensor], layers: int, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [attn.attend(layer, q[layer], scale) for q in qs for layer in range(layers)]


@pytest.mark.parametrize("method", ["quest", "quest+phi", "topk", "topk+phi", "topk+vi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replays_equal_eager_steps(method: str, dtype: torch.dtype) -> None:
    n, hkv, g, d, layers = 3000, 2, 4, 64, 3
    gen = torch.Generator().manual_seed(0)
    kv = [(torch.randn(hkv, n, d, generator=gen).to(dtype).cuda(), torch.randn(hkv, n, d, generator=gen).to(dtype)
           .cuda()) for _ in range(layers)]
    src = MemorySource.build(kv, METHODS[method].summarizers)
    qs = [(torch.randn(layers, 1, hkv * g, 1, d, generator=gen) * 2).to(dtype).cuda() for _ in range(6)]
    cfg = DecodeConfig(budget=0.05, gen_len=64)
    eager = get_method(method).open(src, cfg)
    graphed = get_method(method).open(src, cfg)
    assert isinstance(graphed, SparsePrefixAttention)
    graphed.use_cuda_graphs()
    a = _steps(eager, qs, layers, d ** -0.5)
    b = _steps(graphed, qs, layers, d ** -0.5)
    assert graphed.graphs is not None and not graphed.graphs.failed
    assert graphed.graphs.replays == layers * (len(qs) - StepGraphs.WARM_CALLS)  # every later step replayed
    for (o1, l1), (o2, l2) in zip(a, b, strict=True):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert graphed.read_report().tokens_per_step == eager.read_report().tokens_per_step
    assert len(set(graphed.read_report().tokens_per_step)) >= 1 and graphed.read_report().tokens_per_step[0] > 0


def test_a_step_that_cannot_be_captured_runs_eagerly() -> None:
    graphs = StepGraphs()
    x = torch.arange(4.0, device="cuda")

    def step(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = int(q.sum().item())  # a device -> host copy: not capturable
        return q * n, q, torch.tensor(n, device=q.device)

    caller = torch.cuda.current_stream()
    for _ in range(3):
        out = run_graphed(graphs, 0, "k", x, step)
        assert torch.equal(out[0], x * 6)
        assert torch.cuda.current_stream() == caller  # not left on the failed capture's stream
    assert graphs.failed and graphs.replays == 0


@pytest.mark.parametrize("offload", [True, False])
def test_worker_tokens_and_reads_equal_with_and_without_graphs(store, endless_model_dir, offload: bool) -> None:
    lm = load_model(str(endless_model_dir), device="cuda", dtype="bfloat16", page_size=16, progress=False)
    kw = {} if offload else {"offload": None}
    plain = Worker(store, lm, progress=False, engine=EngineConfig(cuda_graphs=False), **kw)
    graphed = Worker(store, lm, progress=False, engine=EngineConfig(cuda_graphs=True), **kw)
    pid = plain.prefill(DOC).prefix_id
    out = []
    for w in (plain, graphed):
        stats = GenerationStats()
        stream = w.generate(pid, " What is the code?", SamplingParams(max_new_tokens=24),
                            method="quest", decode=DecodeConfig(budget=0.1), stats=stats)
        attn = stream._gen.prefix
        "".join(stream)
        out.append((stats, attn))
    (s1, a1), (s2, a2) = out
    assert len(s1.token_ids) == 24 and s2.token_ids == s1.token_ids
    assert s2.prefix_tokens_per_step == s1.prefix_tokens_per_step
    assert a1.graphs is None
    if not offload:  # resident KV is always capturable; a fetched prefix only once its host tier is warm
        assert a2.graphs is not None and a2.graphs.replays > 0 and not a2.graphs.failed
