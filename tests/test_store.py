"""The embedded store: page layout round trips, arbitrary page reads, checksums, crash safety."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from store import disk_record, limits
from store.artifacts import digest
from store.config import StoreConfig
from store.disk_record import MANIFEST_FILE, UNSYNCED_FILE, artifact_file_name
from store.errors import CorruptData, InvalidInput, PrefixNotFound, StoreUnavailable
from store.kvstore import KVStore
from store.layout import KVLayout
from store.manifest import ArtifactInfo
from store.page_io import plan_runs
from store.pages import layer_file_name, unpack_pages
from store.prefix_key import PrefixKey, tenant_salt, token_hash

REPO = Path(__file__).resolve().parents[1]



def _written(directory: Path) -> list[str]:
    """Names of the files a writer put in ``directory`` (its unsynced marker aside)."""
    return sorted(p.name for p in directory.iterdir() if p.name != UNSYNCED_FILE)

def _layout(page_size: int = 16) -> KVLayout:
    return KVLayout(n_layers=3, n_kv_heads=2, head_dim=16, dtype="float32", page_size=page_size)


def _key(n: int, seed: int = 0, page_size: int = 16) -> PrefixKey:
    return PrefixKey(model_fingerprint="fp", tenant_salt=tenant_salt("default"),
                     token_hash=token_hash(list(range(seed, seed + n))), layout=_layout(page_size))


def _kv(n: int, layers: int = 3, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, n, 16, generator=g), torch.randn(2, n, 16, generator=g)) for _ in range(layers)]


def _write(store: KVStore, n: int, seed: int = 0, tenant: str = "default") -> tuple[str, list]:
    key, kv = _key(n, seed, store.config.page_size), _kv(n, seed=seed)
    with store.write_prefix(key, model_name="m", n_tokens=n, tenant=tenant) as w:
        for layer, (k, v) in enumerate(kv):
            w.write_layer(layer, k, v)
        w.put_artifact("extra", b"hello")
        w.commit()
    return key.prefix_id, kv


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_layer_round_trip(store: KVStore, n: int) -> None:
    pid, kv = _write(store, n)
    for layer, (k, v) in enumerate(kv):
        k2, v2 = store.read_layer(pid, layer, verify=True)
        assert torch.equal(k2, k) and torch.equal(v2, v)


def test_read_arbitrary_pages_into_buffer(store: KVStore) -> None:
    n = 16 * 7 + 3
    pid, kv = _write(store, n)
    lay = store.manifest(pid).layout
    pages = [0, 2, 3, 4, 7]
    out = torch.full((len(pages), lay.page_bytes), 255, dtype=torch.uint8)
    store.read_pages(pid, 1, 1, pages, out, verify=True)
    k, v = unpack_pages(lay, out)
    k_ref = torch.nn.functional.pad(kv[1][0][1], (0, 0, 0, 8 * 16 - n))  # zero padded last page
    for i, p in enumerate(pages):
        assert torch.equal(k[i], k_ref[p * 16:(p + 1) * 16])
    with pytest.raises(InvalidInput):
        store.read_pages(pid, 1, 1, [8], torch.empty(1, lay.page_bytes, dtype=torch.uint8))


def test_coalesce_runs() -> None:
    plan = plan_runs([0, 1, 2, 5, 7, 8])
    assert [(int(plan.linear[s]), int(c)) for s, c in zip(plan.starts, plan.counts)] == [(0, 3), (5, 1), (7, 2)]
    assert plan_runs([]).n_runs == 0


def test_artifacts_and_manifest(store: KVStore) -> None:
    pid, _ = _write(store, 40)
    m = store.manifest(pid)
    assert m.n_tokens == 40 and len(m.files) == 3
    assert store.artifact(pid, "extra") == b"hello"
    assert [x.prefix_id for x in store.list_prefixes()] == [pid]


def _flip(path: Path, at: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "extended", "missing"])
def test_artifact_is_read_from_its_file_and_checked(store: KVStore, damage: str) -> None:
    pid, _ = _write(store, 40)
    path = store.prefix_dir(pid) / artifact_file_name(0)  # "extra" sorts before "page_crc"
    assert path.read_bytes() == b"hello"
    if damage == "flipped":
        _flip(path, 1)
    elif damage == "truncated":
        path.write_bytes(b"hell")
    elif damage == "extended":
        path.write_bytes(b"hello!")
    else:
        path.unlink()
    with pytest.raises(CorruptData, match="extra"):
        store.artifact(pid, "extra")
    with pytest.raises(CorruptData, match="extra"):
        store.verify(pid)
    assert "extra" in (store.quick_check(pid) or "")
    assert store.page_crcs(pid).shape == (3, 2, 3)  # the other artifact reads fine
    with pytest.raises(PrefixNotFound, match="no artifact"):
        store.artifact(pid, "nope")


def test_artifact_reads_are_bounded_by_the_manifest(store: KVStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file grown far past its manifest's size is not read whole: at most size + 1 bytes."""
    pid, _ = _write(store, 40)
    path = store.prefix_dir(pid) / artifact_file_name(0)
    with open(path, "ab") as f:
        f.write(b"x" * (1 << 20))
    asked: list[int] = []
    real_open, real_preadv, real_pread = open, os.preadv, os.pread

    class Spy:
        def __init__(self, f) -> None:  # noqa: ANN001
            self.f = f

        def __enter__(self) -> Spy:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def read(self, n: int = -1) -> bytes:
            asked.append(n)
            return self.f.read(n)

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        asked.append(offset + sum(len(b) for b in buffers))  # the farthest byte asked for
        return real_preadv(fd, buffers, offset)

    def pread(fd: int, n: int, offset: int) -> bytes:
        asked.append(offset + n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(disk_record, "open", lambda *a, **k: Spy(real_open(*a, **k)), raising=False)
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)
    for call in (lambda: store.artifact(pid, "extra"), lambda: store.verify(pid)):
        with pytest.raises(CorruptData, match="extra"):
            call()
    assert asked and all(0 <= n <= len(b"hello") + 1 for n in asked), asked


def test_put_artifact_writes_its_file_and_keeps_no_bytes(store: KVStore) -> None:
    key, kv = _key(20), _kv(20)
    with store.write_prefix(key, model_name="m", n_tokens=20) as w:
        w.put_artifact("../../b", b"first version")
        w.put_artifact("a", b"A" * 1000)
        w.put_artifact("../../b", b"second")  # replaces the first (its staged file goes)
        staged = _written(w.tmp_dir)
        assert len(staged) == 2 and b"A" * 1000 in [(w.tmp_dir / n).read_bytes() for n in staged]
        for held in w._artifacts.values():  # only where each is staged, and its size and digest
            assert [type(x) for x in held] == [str, ArtifactInfo]
        assert not any(isinstance(v, bytes | bytearray | memoryview) and len(v) >= 6 for v in vars(w).values())
        for layer, (k, v) in enumerate(kv):
            w.write_layer(layer, k, v)
        w.commit()
    pid = key.prefix_id
    m = store.manifest(pid)
    assert [a.name for a in m.artifacts] == ["../../b", "a", "page_crc"]
    assert store.artifact(pid, "../../b") == b"second" and store.artifact(pid, "a") == b"A" * 1000
    assert store.flush() and store.unsynced() == 0  # the background fsync removed the marker
    names = sorted(p.name for p in store.prefix_dir(pid).iterdir())  # names never become file names
    assert names == sorted([MANIFEST_FILE, *(artifact_file_name(i) for i in range(3)),
                            *(layer_file_name(i) for i in range(3))])
    store.verify(pid)


def _page_bytes(n_tokens: int) -> int:
    return _layout().n_layers * _layout().layer_file_bytes(n_tokens)


def test_artifacts_are_bounded_by_the_page_files(store: KVStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the floor, the artifacts of a prefix (its page checksums included) take at most its page files' size."""
    monkeypatch.setattr(limits, "MIN_ARTIFACT_BUDGET", 1024)
    n = 20
    budget = _page_bytes(n)  # 3 layers * 2 heads * 2 pages * 4 KiB
    crc_bytes = 3 * 2 * 2 * 4
    assert budget > 1024 and limits.max_artifact_bytes(budget) == budget
    with store.write_prefix(_key(n), model_name="m", n_tokens=n) as w:
        with pytest.raises(InvalidInput, match=f"at most {budget} bytes"):
            w.put_artifact("big", b"x" * (budget - crc_bytes + 1))
        w.put_artifact("a", b"x" * 1000)
        with pytest.raises(InvalidInput, match="at most"):
            w.put_artifact("b", b"x" * (budget - crc_bytes - 999))  # together with "a": one byte too many
        w.put_artifact("a", b"x" * (budget - crc_bytes))  # a replacement counts once: exactly fits
        assert _written(w.tmp_dir) == [w._artifacts["a"][0]]  # the refused ones left nothing
        for layer, (k, v) in enumerate(_kv(n)):
            w.write_layer(layer, k, v)
        w.commit()
    m = store.manifest(_key(n).prefix_id)
    assert m.artifact_bytes == budget and store.usage() == m.kv_bytes + budget  # accounted as before


def test_artifact_budget_has_a_floor_and_a_count(store: KVStore) -> None:
    n = 20
    assert limits.max_artifact_bytes(_page_bytes(n)) == limits.MIN_ARTIFACT_BUDGET == 64 << 20
    with store.write_prefix(_key(n), model_name="m", n_tokens=n) as w:
        w.put_artifact("summary", b"s" * (_page_bytes(n) * 4))  # far past its page files, under the floor
        for i in range(1, limits.MAX_ARTIFACTS):
            w.put_artifact(f"a{i}", b"")
        with pytest.raises(InvalidInput, match=f"at most {limits.MAX_ARTIFACTS} artifacts"):
            w.put_artifact("one too many", b"")
        w.put_artifact("a1", b"again")  # replacing one is no new one
        for layer, (k, v) in enumerate(_kv(n)):
            w.write_layer(layer, k, v)
        w.commit()
    assert store.artifact(_key(n).prefix_id, "a1") == b"again"


def _commit_with(store: KVStore, n: int, put: object) -> str:
    """Commit ``_key(n)`` with its layers and the artifacts ``put(writer)`` writes; its prefix id."""
    with store.write_prefix(_key(n), model_name="m", n_tokens=n) as w:
        put(w)  # type: ignore[operator]
        for layer, (k, v) in enumerate(_kv(n)):
            w.write_layer(layer, k, v)
        w.commit()
    return _key(n).prefix_id


def test_streamed_artifact_is_the_same_on_disk_as_a_put_one(tmp_path: Path) -> None:
    """``open_artifact`` written in chunks (a replaced one among them) commits the same files, sizes and digests as
    ``put_artifact`` of the whole bytes; each chunk is on disk before the next arrives."""
    data, n = os.urandom(300_001), 20
    put_home, streamed_home = (KVStore(StoreConfig(home=tmp_path / h)) for h in ("put", "streamed"))

    def put(w) -> None:  # noqa: ANN001 - a PrefixWriter
        w.put_artifact("big", data)
        w.put_artifact("small", b"hello")

    def streamed(w) -> None:  # noqa: ANN001 - a PrefixWriter
        w.put_artifact("big", b"an older version")
        with w.open_artifact("big") as a:
            for off in range(0, len(data), 65_536):
                a.write(memoryview(data)[off:off + 65_536])
                staged = w.tmp_dir / a.staged
                assert staged.stat().st_size == a.written == min(off + 65_536, len(data))
            assert "big" in w._artifacts  # the older version stays recorded until this one closes
        a2 = w.open_artifact("small")
        a2.write(b"hel")
        a2.write(b"lo")
        a2.close()

    pid = _commit_with(put_home, n, put)
    assert _commit_with(streamed_home, n, streamed) == pid
    want, got = put_home.manifest(pid), streamed_home.manifest(pid)
    assert got.artifacts == want.artifacts and got.files == want.files
    assert streamed_home.flush() and put_home.flush()
    assert sorted(p.name for p in streamed_home.prefix_dir(pid).iterdir()) == \
        sorted(p.name for p in put_home.prefix_dir(pid).iterdir())
    for i in range(len(want.artifacts)):
        assert (streamed_home.prefix_dir(pid) / artifact_file_name(i)).read_bytes() == \
            (put_home.prefix_dir(pid) / artifact_file_name(i)).read_bytes()
    assert streamed_home.artifact(pid, "big") == data and got.artifact("big").blake2b == digest(data)
    streamed_home.verify(pid)
    put_home.close()
    streamed_home.close()


def test_streamed_artifact_past_the_budget_is_refused_as_it_arrives(store: KVStore,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The write that would go past the budget raises, its partial file goes at once, and nothing is recorded."""
    monkeypatch.setattr(limits, "MIN_ARTIFACT_BUDGET", 1024)
    n = 20
    budget, crc_bytes = _page_bytes(n), 3 * 2 * 2 * 4
    with store.write_prefix(_key(n), model_name="m", n_tokens=n) as w:
        w.put_artifact("kept", b"k" * 1000)
        a = w.open_artifact("big")
        room = budget - crc_bytes - 1000
        a.write(b"x" * (room - 10))
        assert (w.tmp_dir / a.staged).stat().st_size == room - 10
        with pytest.raises(InvalidInput, match=f"at most {budget} bytes"):
            a.write(b"x" * 11)
        assert _written(w.tmp_dir) == [w._artifacts["kept"][0]]
        with pytest.raises(InvalidInput, match="closed"):
            a.write(b"x")
        # Open streams count against each other too.
        b, c = w.open_artifact("b"), w.open_artifact("c")
        b.write(b"b" * (room - 5))
        with pytest.raises(InvalidInput, match="at most"):
            c.write(b"c" * 6)
        b.close()
        for layer, (k, v) in enumerate(_kv(n)):
            w.write_layer(layer, k, v)
        w.commit()
    m = store.manifest(_key(n).prefix_id)
    assert [a.name for a in m.artifacts] == ["b", "kept", "page_crc"] and m.artifact_bytes == budget - 5


def test_an_unclosed_artifact_stream_records_nothing(store: KVStore) -> None:
    """A stream left by an exception is discarded (its file gone); commit refuses one still open; abort removes all."""
    n = 20
    with store.write_prefix(_key(n), model_name="m", n_tokens=n) as w:
        with pytest.raises(RuntimeError), w.open_artifact("failed") as a:
            a.write(b"partial")
            raise RuntimeError("the producer failed")
        assert _written(w.tmp_dir) == [] and "failed" not in w._artifacts
        w.open_artifact("open").write(b"x")
        with pytest.raises(InvalidInput, match="already being written"):
            w.open_artifact("open")
        for layer, (k, v) in enumerate(_kv(n)):
            w.write_layer(layer, k, v)
        with pytest.raises(InvalidInput, match="still being written"):
            w.commit()
        tmp = w.tmp_dir
    assert not tmp.exists() and store.list_prefixes() == [] and list(store.prefixes_dir.iterdir()) == []
    with store.write_prefix(_key(n), model_name="m", n_tokens=n) as w:  # open streams count towards MAX_ARTIFACTS
        streams = [w.open_artifact(f"a{i}") for i in range(limits.MAX_ARTIFACTS)]
        with pytest.raises(InvalidInput, match=f"at most {limits.MAX_ARTIFACTS} artifacts"):
            w.open_artifact("one too many")
        streams[0].discard()
        w.open_artifact("one too many").close()


def test_corrupted_page_file_is_detected(store: KVStore) -> None:
    pid, _ = _write(store, 50)
    path = store.prefix_dir(pid) / "layer_001.kv"
    data = bytearray(path.read_bytes())
    data[4096 + 10] ^= 0xFF  # head 0, page 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptData, match="layer 1 head 0 page 1"):
        store.read_layer(pid, 1, verify=True)
    with pytest.raises(CorruptData, match="checksum"):
        store.verify(pid)
    store.read_layer(pid, 0, verify=True)  # other layers are fine


def test_truncated_page_file_is_a_short_read(store: KVStore) -> None:
    pid, _ = _write(store, 50)
    path = store.prefix_dir(pid) / "layer_002.kv"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CorruptData, match="short read"):
        store.read_layer(pid, 2)


def test_page_swapped_between_prefixes_fails_identity_check(store: KVStore) -> None:
    a, _ = _write(store, 32, seed=0)
    b, _ = _write(store, 32, seed=1)
    fa, fb = store.prefix_dir(a) / "layer_000.kv", store.prefix_dir(b) / "layer_000.kv"
    fa.write_bytes(fb.read_bytes())  # right sizes, wrong prefix
    with pytest.raises(CorruptData):
        store.read_layer(a, 0, verify=True)


def test_rm_removes_every_file(store: KVStore) -> None:
    pid, _ = _write(store, 30)
    store.remove(pid)
    assert not store.prefix_dir(pid).exists()
    assert not (store.locks_dir / f"{pid}.lock").exists()
    assert store.list_prefixes() == []
    assert store._meta.manifest(pid) is None and store._meta.prefix_usage(pid) is None  # the backend dropped it too
    with pytest.raises(PrefixNotFound):
        store.manifest(pid)
    with pytest.raises(PrefixNotFound):
        store.remove(pid)


def test_failed_write_leaves_nothing(store: KVStore) -> None:
    key = _key(20)
    with pytest.raises(RuntimeError), store.write_prefix(key, model_name="m", n_tokens=20) as w:
        w.write_layer(0, *_kv(20)[0])
        raise RuntimeError("boom")
    assert list(store.prefixes_dir.iterdir()) == []
    assert not store.exists(key.prefix_id)


def test_commit_requires_every_layer(store: KVStore) -> None:
    with pytest.raises(InvalidInput, match="not written"), \
            store.write_prefix(_key(20), model_name="m", n_tokens=20) as w:
        w.write_layer(0, *_kv(20)[0])
        w.commit()


@pytest.mark.parametrize("crash_at", ["after_layer", "before_rename", "before_metadata"])
def test_crash_mid_write(tmp_path: Path, crash_at: str) -> None:
    """Before its directory is renamed into place a prefix is debris (collected at the next start); after,
    it is committed on disk, and the next start registers it even though the metadata commit never ran."""
    home = tmp_path / "home"
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_store import _key, _kv
        import store.writer
        from store.config import StoreConfig
        from store.kvstore import KVStore
        s = KVStore(StoreConfig(home={str(home)!r}))
        if {crash_at!r} == "before_rename":
            store.writer.os.rename = lambda *a, **k: os._exit(9)
        if {crash_at!r} == "before_metadata":
            s._meta.commit = lambda *a, **k: os._exit(9)
        with s.write_prefix(_key(20), model_name="m", n_tokens=20) as w:
            for layer, (k, v) in enumerate(_kv(20)):
                w.write_layer(layer, k, v)
                if {crash_at!r} == "after_layer":
                    os._exit(9)
            w.put_artifact("extra", b"hello")
            w.commit()
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    assert any((home / "prefixes").iterdir()), "the simulated crash should leave debris behind"
    store = KVStore(StoreConfig(home=home))  # opening collects the debris, registers what was committed
    pid = _key(20).prefix_id
    if crash_at == "before_metadata":
        assert [m.prefix_id for m in store.list_prefixes()] == [pid]
        assert [p.name for p in store.prefixes_dir.iterdir()] == [pid]
        assert torch.equal(store.read_layer(pid, 2, verify=True)[1], _kv(20)[2][1])
        assert store.artifact(pid, "extra") == b"hello"
        store.verify(pid)
        return
    assert store.list_prefixes() == []
    assert list(store.prefixes_dir.iterdir()) == []
    pid, kv = _write(store, 20)  # the next write of the same prefix succeeds
    assert torch.equal(store.read_layer(pid, 2, verify=True)[1], kv[2][1])


def test_unusable_data_directory(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(StoreUnavailable, match="not usable"):
        KVStore(StoreConfig(home=a_file / "home"))
    if os.path.isdir("/proc/self"):
        with pytest.raises(StoreUnavailable):
            KVStore(StoreConfig(home=Path("/proc/self/kvstash")))


@pytest.mark.parametrize("threads", [1, 4])
def test_pipelined_writer_stores_what_the_synchronous_one_does(tmp_path: Path, threads: int) -> None:
    """Page files, their digests and the per-page CRCs do not depend on the writer's threads."""
    stores = [KVStore(StoreConfig(home=tmp_path / f"h{i}", page_size=16, write_threads=t))
              for i, t in enumerate((0, threads))]
    pids = [_write(s, 16 * 9 + 5)[0] for s in stores]
    a, b = (s.manifest(p) for s, p in zip(stores, pids, strict=True))
    assert a.files == b.files and [x.blake2b for x in a.artifacts] == [x.blake2b for x in b.artifacts]
    for s, p in zip(stores, pids, strict=True):
        s.verify(p)  # raises CorruptData if a file digest does not match its bytes
        s.close()


def test_background_write_failure_fails_the_commit(store: KVStore, monkeypatch: pytest.MonkeyPatch) -> None:
    import store.writer as writer_mod

    real = writer_mod.write_bytes_durably

    def flaky(path: Path, data, fsync: bool = True) -> None:
        if path.name == layer_file_name(1):
            raise OSError(28, "No space left on device")
        real(path, data, fsync)

    monkeypatch.setattr(writer_mod, "write_bytes_durably", flaky)
    key = _key(40)
    with pytest.raises(OSError, match="No space"), store.write_prefix(key, model_name="m", n_tokens=40) as w:
        for layer, (k, v) in enumerate(_kv(40)):
            w.write_layer(layer, k, v)
        w.commit()
    assert not store.exists(key.prefix_id)
    assert [p.name for p in store.prefixes_dir.iterdir()] == []  # the temp dir went with the abort


HOSTILE_IDS = {
    "empty": "",
    "short": "a" * 31,
    "long": "a" * 33,
    "huge": "a" * 100_000,
    "traversal": "../../etc",
    "traversal_32": "../" + "a" * 29,
    "uppercase": "A" * 32,
    "nul": "a" * 31 + "\0",
    "newline": "a" * 32 + "\n",
    "unicode_digits": "\u0660" * 32,
    "fullwidth": "\uff41" * 32,
}
"""Prefix ids no ``PrefixKey`` produces: each must stop at the store's boundary with InvalidInput."""

STORE_CALLS = {
    "find": lambda s, p: s.find(p),
    "manifest": lambda s, p: s.manifest(p),
    "visible": lambda s, p: s.visible(p, "default"),
    "exists": lambda s, p: s.exists(p),
    "remove": lambda s, p: s.remove(p),
    "artifact": lambda s, p: s.artifact(p, "extra"),
    "page_crcs": lambda s, p: s.page_crcs(p),
    "read_pages": lambda s, p: s.read_pages(p, 0, 0, [], torch.empty(0, 1, dtype=torch.uint8)),
    "read_layer": lambda s, p: s.read_layer(p, 0),
    "verify": lambda s, p: s.verify(p),
    "acquire_lease": lambda s, p: s.acquire_lease(p, "w", 10),
    "release_lease": lambda s, p: s.release_lease(f"{p}.0123456789abcdef"),
    "leases": lambda s, p: s.leases(p),
    "pin": lambda s, p: s.pin(p),
    "unpin": lambda s, p: s.unpin(p),
    "usage_of": lambda s, p: s.usage_of(p),
    "prefix_dir": lambda s, p: s.prefix_dir(p),
}


def _enter(cm_factory):  # noqa: ANN001, ANN202 - a context manager method under test
    return lambda s, p: cm_factory(s, p).__enter__()


STORE_CALLS |= {"lease": _enter(lambda s, p: s.lease(p)), "prefill_lock": _enter(lambda s, p: s.prefill_lock(p)),
                "prefix_lock": _enter(lambda s, p: s.prefix_lock(p))}


@pytest.mark.parametrize("call", sorted(STORE_CALLS))
@pytest.mark.parametrize("bad", sorted(HOSTILE_IDS))
def test_hostile_prefix_ids_are_invalid_input(store: KVStore, call: str, bad: str) -> None:
    _write(store, 20)  # a real prefix beside, so a lookup is not trivially empty
    with pytest.raises(InvalidInput, match="prefix id must be 32 lowercase hex characters|malformed lease_id") as e:
        STORE_CALLS[call](store, HOSTILE_IDS[bad])
    assert len(str(e.value)) < 100  # never echoes the input
    assert sorted(p.name for p in store.locks_dir.iterdir()) == []  # no lock file named after it


def test_another_tenants_prefix_looks_missing(store: KVStore) -> None:
    pid, _ = _write(store, 20, tenant="alice")
    assert store.visible(pid, "alice").prefix_id == pid
    with pytest.raises(PrefixNotFound) as other:
        store.visible(pid, "bob")
    with pytest.raises(PrefixNotFound) as missing:
        store.visible("0" * 32, "bob")
    assert str(other.value).replace(pid, "<id>") == str(missing.value).replace("0" * 32, "<id>")
    # With the caller's salt secret, the key's tenant salt must be the one that secret gives.
    with pytest.raises(PrefixNotFound):
        store.visible(pid, "alice", secret="")  # _key salts as tenant "default"
    mine, _ = _write(store, 20, seed=1)
    assert store.visible(mine, "default", secret="").prefix_id == mine
    with pytest.raises(PrefixNotFound):
        store.visible(mine, "default", secret="another")
    assert [m.prefix_id for m in store.list_prefixes("alice")] == [pid] and store.list_prefixes("bob") == []
    # Listing follows the same rule as ``visible``, the secret included.
    assert [m.prefix_id for m in store.list_prefixes("default", secret="")] == [mine]
    assert store.list_prefixes("default", secret="another") == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_layers_are_staged_through_pinned_buffers_intact(tmp_path: Path) -> None:
    """Device layers are packed on the device and staged in pinned buffers leased from the store's pool; more
    layers than a writer holds at once, so each buffer is reused while earlier layers may still be being
    written."""
    from store.writer import MAX_PENDING_LAYERS

    layers, n = 2 * (MAX_PENDING_LAYERS + 1) + 1, 100
    layout = KVLayout(n_layers=layers, n_kv_heads=2, head_dim=16, dtype="float32", page_size=16)
    key = PrefixKey(model_fingerprint="fp", tenant_salt=tenant_salt("default"), token_hash=token_hash([1, 2, 3]),
                    layout=layout)
    store = KVStore(StoreConfig(home=tmp_path / "s", page_size=16))
    kv = [(torch.randn(2, n, 16, device="cuda"), torch.randn(2, n, 16, device="cuda")) for _ in range(layers)]
    with store.write_prefix(key, model_name="m", n_tokens=n) as w:
        for layer, (k, v) in enumerate(kv):
            w.write_layer(layer, k, v)
        w.commit()
    for layer, (k, v) in enumerate(kv):
        k2, v2 = store.read_layer(key.prefix_id, layer, verify=True)
        assert torch.equal(k2, k.cpu()) and torch.equal(v2, v.cpu())
    store.close()
