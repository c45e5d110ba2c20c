"""Offloaded fetch on a real GPU: the one-launch gather reading pinned host memory, and the fetcher's
pools read by the sparse attention kernel, against the store's own reads. Skipped without CUDA.

Self-contained (runs with ``--noconftest``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from store.config import StoreConfig
from store.kvstore import KVStore
from store.layout import KVLayout
from store.page_io import KvikioPageReader, PosixPageReader, kvikio_available, plan_runs
from store.prefix_key import PrefixKey, tenant_salt, token_hash
from workers.kernels.gather_pages import gather_pages
from workers.offload import HostTier, OffloadConfig, PageFetcher
from workers.offload.memory import HostBuffer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = torch.device("cuda")


def _prefix(home: Path, n: int, dtype: str = "bfloat16"):
    lay = KVLayout(n_layers=2, n_kv_heads=4, head_dim=128, dtype=dtype, page_size=16)
    store = KVStore(StoreConfig(home=home, fsync=False))
    key = PrefixKey(model_fingerprint="cuda", tenant_salt=tenant_salt("t"), token_hash=token_hash([n]), layout=lay)
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(4, n, 128, generator=g), torch.randn(4, n, 128, generator=g)) for _ in range(2)]
    with store.write_prefix(key, model_name="m", n_tokens=n) as w:
        for layer, (k, v) in enumerate(kv):
            w.write_layer(layer, k, v)
        m = w.commit()
    return store, m


def test_pinned_buffer_is_page_locked_and_aligned() -> None:
    b = HostBuffer(3 * 4096 + 5, pin=True)
    assert b.tensor.is_pinned() and b.tensor.data_ptr() % 4096 == 0 and b.tensor.numel() == 3 * 4096 + 5
    b.close()


@pytest.mark.parametrize("src_on_gpu", [False, True])
def test_triton_gather_matches_torch(src_on_gpu: bool) -> None:
    lay = KVLayout(n_layers=1, n_kv_heads=1, head_dim=128, dtype="bfloat16", page_size=16)
    host = HostBuffer(64 * lay.page_bytes, pin=True)
    src = host.tensor.view(64, lay.page_bytes)
    src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))
    if src_on_gpu:
        src = src.to(DEV)
    rows = torch.tensor([5, 0, 63, 17, 18], device=DEV)
    dst = torch.tensor([3, 9, 0, 1, 7], device=DEV)
    pools = [torch.full((10 * 16, 128), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(4)]
    gather_pages(src, rows, pools[0], pools[1], dst, block_bytes=lay.block_bytes, use_triton=True)
    gather_pages(src, rows, pools[2], pools[3], dst, block_bytes=lay.block_bytes, use_triton=False)
    touched = (torch.arange(160, device=DEV) // 16).unsqueeze(-1) == dst.view(1, -1)
    sel = touched.any(-1)
    for a, b in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(a[sel].view(torch.int16), b[sel].view(torch.int16))
        assert a[~sel].isnan().all()


@pytest.mark.parametrize("host_budget_pages", [0, 40, 10_000])
def test_fetcher_on_gpu_matches_store_and_kernel(tmp_path: Path, host_budget_pages: int) -> None:
    from workers.kernels.sparse_attention import sparse_decode_attention

    n = 16 * 50 + 7
    store, m = _prefix(tmp_path / "home", n)
    lay = m.layout
    tier = HostTier(page_bytes=lay.page_bytes, budget_bytes=host_budget_pages * lay.page_bytes)
    cfg = OffloadConfig(gpu_cache_bytes=2 * 24 * lay.page_payload_bytes, reader="posix")
    ref = [store.read_layer(m.prefix_id, layer) for layer in range(2)]
    g = torch.Generator().manual_seed(1)
    with PageFetcher(store, m, DEV, cfg, tier if host_budget_pages else None) as f:
        for _step in range(6):
            for layer in range(2):
                pages = torch.stack([torch.randperm(51, generator=g)[:6] for _ in range(4)]).to(DEV)
                r = f.fetch(layer, pages)
                tokens = (pages.unsqueeze(-1) * 16 + torch.arange(16, device=DEV)).view(4, -1).clamp(max=n - 1)
                rows = r.token_rows(tokens)
                assert (rows >= 0).all()
                k_ref, v_ref = (t.to(DEV, torch.bfloat16) for t in ref[layer])
                gi = rows.unsqueeze(-1).expand(-1, -1, 128)
                assert torch.equal(r.k.gather(1, gi), k_ref.gather(1, tokens.unsqueeze(-1).expand(-1, -1, 128)))
                assert torch.equal(r.v.gather(1, gi), v_ref.gather(1, tokens.unsqueeze(-1).expand(-1, -1, 128)))
                q = torch.randn(1, 16, 128, generator=g).to(DEV, torch.bfloat16)
                a = sparse_decode_attention(q, r.k[None], r.v[None], scale=0.088, idx=rows[None])[0]
                b = sparse_decode_attention(q, k_ref[None], v_ref[None], scale=0.088, idx=tokens[None])[0]
                assert torch.equal(a, b)
        assert f.gather_mode == "triton"
        st = f.stats
        assert st.total.pages == st.total.gpu_hits + st.total.host_pages + st.total.ssd_pages
    tier.close()
    store.close()


@pytest.mark.skipif(not kvikio_available(), reason="kvikio not installed")
def test_kvikio_reader_matches_posix(tmp_path: Path) -> None:
    store, m = _prefix(tmp_path / "home", 16 * 40)
    lay = m.layout
    path = store.prefix_dir(m.prefix_id) / m.files[1].name
    plan = plan_runs(np.array([0, 1, 2, 7, 40, 41, 79]))
    a = np.zeros((plan.n_pages, lay.page_bytes), dtype=np.uint8)
    b = np.ones_like(a)
    assert PosixPageReader().read(path, m.files[1].size, plan, lay.page_bytes, a) == 4
    reader = KvikioPageReader(depth=32)
    assert reader.read(path, m.files[1].size, plan, lay.page_bytes, b) == 4
    assert np.array_equal(a, b)
    import kvikio

    assert reader.threads >= 32 and kvikio.defaults.get("num_threads") >= 32  # the pool runs 32 reads at once
    store.close()
