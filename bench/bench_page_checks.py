"""The integrity work of one page file, before and after page files were checked by their page CRCs alone (CPU).

Write side, per layer: before, the writer ran one ``page_crc`` Python call per page (``_page_crcs``' loop) and a
blake2b of the whole layer (``bytes_digest``); now one page CRC kernel call per KV head
(``store.page_crc_native.page_crcs``) and no digest. Verification side, per page file (in the page cache: CPU
cost, not the disk's): before, a blake2b of the file (``file_digest``); now ``store.page_files_check.crc_problem``
(chunked reads, the next chunk read while this one's pages are checked against the CRC table).

Layer shape: ``--tokens`` (32768) tokens, 8 KV heads, D=128, bf16, 16-token pages (a 128 MiB page file). The
results are checked equal first. Prints ratios side by side from one run (median of ``--reps``).

Usage: ``OMP_NUM_THREADS=1 python bench/bench_page_checks.py [--tokens 32768] [--reps 5]``
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store.config import StoreConfig  # noqa: E402
from store.crc32 import CRC32_IMPL  # noqa: E402
from store.kvstore import KVStore  # noqa: E402
from store.layout import KVLayout  # noqa: E402
from store.page_crc_native import folds_with_clmul, native_available, page_crcs  # noqa: E402
from store.page_files_check import crc_problem  # noqa: E402
from store.pages import file_digest, page_crc  # noqa: E402
from store.prefix_key import PrefixKey, tenant_salt, token_hash  # noqa: E402

HEADS, DIM, PAGE = 8, 128, 16


def old_write_checks(prefix_id: str, arr: np.ndarray) -> tuple[np.ndarray, str]:
    """What the writer did per layer before: the Python CRC loop per head, and the layer's blake2b."""
    return old_crcs(prefix_id, arr), old_digest(arr)


def old_crcs(prefix_id: str, arr: np.ndarray) -> np.ndarray:
    """The writer's ``_page_crcs`` loop before (one ``page_crc`` call per page), every head."""
    out = np.zeros(arr.shape[:2], dtype=np.uint32)
    for h in range(arr.shape[0]):
        for p in range(arr.shape[1]):
            out[h, p] = page_crc(prefix_id, 0, h, p, memoryview(arr[h, p]))
    return out


def old_digest(arr: np.ndarray) -> str:
    """The writer's ``bytes_digest`` of a layer before."""
    return hashlib.blake2b(arr.data.cast("B"), digest_size=32).hexdigest()


def new_crcs(prefix_id: str, arr: np.ndarray) -> np.ndarray:
    """The writer's page CRCs now: one kernel call per KV head."""
    n = arr.shape[1]
    return np.stack([page_crcs(prefix_id, 0, n, h * n, arr[h], arr.shape[2]) for h in range(arr.shape[0])])


def seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall seconds of ``fn`` over ``reps`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    layout = KVLayout(n_layers=1, n_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16", page_size=PAGE)
    key = PrefixKey(model_fingerprint="bench", tenant_salt=tenant_salt("b"), token_hash=token_hash([args.tokens]),
                    layout=layout)
    pid = key.prefix_id
    n_pages = layout.n_pages(args.tokens)
    arr = np.random.default_rng(0).integers(0, 256, (HEADS, n_pages, layout.page_bytes), dtype=np.uint8)
    print(f"layer: {args.tokens} tokens, {HEADS} KV heads, D={DIM}, bf16, {n_pages * HEADS} pages of "
          f"{layout.page_bytes} B, {arr.nbytes / 2**20:.0f} MiB; kernel built: {native_available()} (PCLMUL "
          f"{folds_with_clmul()}); Python CRC: {CRC32_IMPL}; median of {args.reps}")
    assert np.array_equal(old_crcs(pid, arr), new_crcs(pid, arr))

    with tempfile.TemporaryDirectory() as tmp:
        store = KVStore(StoreConfig(home=Path(tmp), fsync=False, page_size=PAGE))
        with store.write_prefix(key, model_name="bench", n_tokens=args.tokens) as w:
            w.write_layer_pages(0, arr)
            m = w.commit()
        path = store.prefix_dir(pid) / m.files[0].name
        table = store.page_crcs(pid)[0]
        assert crc_problem(path, m, 0, table) is None and file_digest(path) == old_digest(arr)
        rows = [
            ("write: Python CRC loop (before)", lambda: old_crcs(pid, arr)),
            ("write: blake2b of the layer (before)", lambda: old_digest(arr)),
            ("write: both (before)", lambda: old_write_checks(pid, arr)),
            ("write: page CRC kernel (now)", lambda: new_crcs(pid, arr)),
            ("verify: blake2b of the file (before)", lambda: file_digest(path)),
            ("verify: page CRCs against the table (now)", lambda: crc_problem(path, m, 0, table)),
        ]
        res = {name: seconds(fn, args.reps) for name, fn in rows}
        store.close()
    gb = arr.nbytes / 1e9
    base = res["write: page CRC kernel (now)"]
    print(f"\n| {'job (one page file, 1 thread)':44s} | ms | GB/s | time / page CRC kernel's |")
    print("|---|---|---|---|")
    for name, s in res.items():
        print(f"| {name:44s} | {s * 1e3:.1f} | {gb / s:.2f} | {s / base:.2f} |")
    w_old, w_new = res["write: both (before)"], res["write: page CRC kernel (now)"]
    v_old, v_new = res["verify: blake2b of the file (before)"], res["verify: page CRCs against the table (now)"]
    print(f"\nwrite side: before / now = {w_old / w_new:.1f}x   verification: before / now = {v_old / v_new:.1f}x")


if __name__ == "__main__":
    main()
