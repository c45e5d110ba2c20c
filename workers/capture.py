"""Capturing decode work into CUDA graphs from whichever thread steps the engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _init_blas(device: torch.device) -> None:
    """Create this thread's cuBLAS and cuBLASLt handles outside a capture.

    The engine steps on whichever request's thread holds the turn, so a capture can run on a thread that
    never ran a matmul; creating its handle inside the capture fails (``CUBLAS_STATUS_NOT_INITIALIZED``,
    seen under the worker server). Handles are per thread and kept, so this costs a few small matmuls.
    """
    torch.cuda.current_blas_handle()
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.ones((16, 16), device=device, dtype=dtype)
        torch.addmm(a[0], a, a)  # the cuBLASLt path (bias epilogue)
        torch.mm(a, a)


@contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, device: torch.device, pool: Any = None) -> Iterator[None]:
    """Record the block's work on ``device`` into ``graph`` (nothing runs: replay it)."""
    _init_blas(device)
    caller = torch.cuda.current_stream(device)
    try:
        # thread_local: the host tier's background warm-up (pinning, copies) goes on in other threads; under the
        # default global mode any such call invalidates this capture.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    except BaseException:
        # When the capture fails, torch.cuda.graph's exit raises before it switches back from its capture stream:
        # this thread's later (eager) work would then run on that stream, unordered with the other threads'.
        torch.cuda.set_stream(caller)
        raise
