"""KVLayout sizes, PrefixKey and Manifest round trips."""

from __future__ import annotations

import pytest

from store.layout import PAGE_ALIGN, KVLayout
from store.manifest import ArtifactInfo, FileInfo, Manifest
from store.prefix_key import PrefixKey, tenant_salt, token_hash


def test_layout_sizes_llama8b_shape() -> None:
    lay = KVLayout(n_layers=32, n_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    assert lay.block_bytes == 16 * 128 * 2
    assert lay.page_payload_bytes == 8192 == lay.page_bytes
    assert lay.n_pages(33) == 3
    assert lay.layer_file_bytes(33) == 8 * 3 * 8192
    assert lay.page_offset(head=1, page=2, n_tokens=33) == (1 * 3 + 2) * 8192


def test_layout_pads_pages_to_alignment() -> None:
    lay = KVLayout(n_layers=1, n_kv_heads=1, head_dim=16, dtype="float32", page_size=16)
    assert lay.page_payload_bytes == 2048
    assert lay.page_bytes == PAGE_ALIGN


@pytest.mark.parametrize("bad", [{"dtype": "int8"}, {"page_size": 0}, {"head_dim": -1}])
def test_layout_rejects_bad_values(bad: dict) -> None:
    args = {"n_layers": 1, "n_kv_heads": 1, "head_dim": 16, "dtype": "float32", "page_size": 16} | bad
    with pytest.raises(ValueError):
        KVLayout(**args)


def _key(**kw) -> PrefixKey:
    base = dict(model_fingerprint="m1", tenant_salt=tenant_salt("t"), token_hash=token_hash([1, 2, 3]),
                layout=KVLayout(n_layers=2, n_kv_heads=2, head_dim=16, dtype="float32"), summarizers=(("quest", 1),))
    return PrefixKey(**(base | kw))


def test_prefix_key_round_trip_and_sensitivity() -> None:
    k = _key()
    assert PrefixKey.from_dict(k.to_dict()) == k
    assert PrefixKey.from_dict(k.to_dict()).prefix_id == k.prefix_id
    others = [_key(model_fingerprint="m2"), _key(tenant_salt=tenant_salt("u")), _key(token_hash=token_hash([1, 2])),
              _key(layout=KVLayout(n_layers=2, n_kv_heads=2, head_dim=16, dtype="float32", page_size=32)),
              _key(summarizers=(("quest", 2),))]
    assert len({k.prefix_id, *(o.prefix_id for o in others)}) == 1 + len(others)


def test_token_hash_is_not_fooled_by_concatenation() -> None:
    assert token_hash([1, 23]) != token_hash([12, 3])
    assert token_hash([]) != token_hash([0])


def test_tenant_salt_depends_on_secret() -> None:
    assert tenant_salt("a") != tenant_salt("b")
    assert tenant_salt("a", "s1") != tenant_salt("a", "s2")


def test_manifest_round_trip() -> None:
    m = Manifest(prefix_id="p", key=_key(), model_name="x", n_tokens=7,
                 files=(FileInfo(name="layer_000.kv", size=4096, blake2b="ab"),),
                 artifacts=(ArtifactInfo(name="page_crc", size=8, blake2b="cd"),), created_at=1.5, tenant="t")
    back = Manifest.from_json(m.to_json())
    assert back == m
    assert back.kv_bytes == 4096 and back.artifact_bytes == 8
    assert back.artifact("page_crc") is not None and back.artifact("nope") is None
