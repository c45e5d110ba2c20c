"""Without a C++ compiler the Double-P CPU kernels do not load (logged), so their callers keep their numpy/torch
paths: ``doublep_select``, ``gather_entries``, ``token_rows`` (and ``page_rows``), ``page_entries``' and the unit
top-k's CPU forms each answer None from a build that cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from native.build import CpuKernelBuild
from workers.kernels.doublep_select import ops as doublep_ops
from workers.kernels.gather_entries import ops as gather_ops
from workers.kernels.page_entries import cpu as page_entries_cpu
from workers.kernels.token_rows import ops as token_rows_ops
from workers.kernels.unit_topk import cpu as unit_topk_cpu


@pytest.mark.parametrize("ops", [doublep_ops, gather_ops, token_rows_ops, page_entries_cpu, unit_topk_cpu])
def test_no_compiler_no_kernel(ops, tmp_path: Path) -> None:
    missing = CpuKernelBuild(compiler="kvstash-no-such-cxx", cache_dir=tmp_path)
    assert ops._load(missing) is None
    disabled = CpuKernelBuild(cache_dir=tmp_path, enabled=False)
    assert ops._load(disabled) is None
    assert not list(tmp_path.iterdir())  # nothing built
