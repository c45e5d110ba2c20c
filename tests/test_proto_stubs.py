"""The committed gRPC stubs are exactly what protoc generates from proto/ today."""

from __future__ import annotations

from pathlib import Path

from services.gen_stubs import GEN_DIR, STUBS, generate


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    generate(tmp_path)
    stale = [n for n in STUBS if (tmp_path / n).read_text() != (GEN_DIR / n).read_text()]
    assert not stale, f"stubs out of date: run `python -m services.gen_stubs` ({stale})"


def test_stubs_describe_both_services() -> None:
    from services.gen import kvstash_pb2 as pb

    assert pb.DESCRIPTOR.package == "kvstash.v1"
    assert {"KVStore", "Worker"} <= set(pb.DESCRIPTOR.services_by_name)
