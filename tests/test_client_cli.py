"""KVClient as the design card writes it, and the ``kvstash`` CLI with --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client import KVClient
from store.errors import InvalidInput, PrefixNotFound

REPO = Path(__file__).resolve().parents[1]
DOC = "Report. The contract was signed by Grace Hopper in Arlington on 4 May. " * 4


@pytest.fixture()
def kv(tmp_path: Path, tiny_model_dir: Path) -> KVClient:
    return KVClient(home=tmp_path / "home", model=str(tiny_model_dir), device="cpu", progress=False)


def test_design_card_flow(kv: KVClient) -> None:
    doc = kv.prefill(DOC)
    assert len(doc.prefix_id) == 32 and doc.n_tokens > 0 and not doc.cached
    pieces = list(kv.generate("Who signed it?", prefix=doc, max_new_tokens=8))
    first = kv.generate("Who signed it?", prefix=doc, max_new_tokens=8)
    assert "".join(pieces) == first.text == str(first)
    again = kv.prefill(DOC)
    assert again.cached and again.prefix_id == doc.prefix_id
    implicit = kv.generate("Who signed it?", max_new_tokens=8)  # no prefix=: the last one prefilled
    assert implicit.text == first.text and implicit.stats.token_ids == first.stats.token_ids
    assert doc.generate("Who signed it?", max_new_tokens=8).text == first.text
    assert repr(first).startswith("Generation(")


def test_client_errors_and_listing(kv: KVClient) -> None:
    with pytest.raises(InvalidInput, match="not prefilled"):
        kv.generate("Who?")
    doc = kv.prefill(DOC)
    assert [m.prefix_id for m in kv.ls()] == [doc.prefix_id]
    assert kv.info(doc.prefix_id).n_tokens == doc.n_tokens
    with pytest.raises(InvalidInput, match="budget"):
        kv.generate("Who?", budget=2.0)
    kv.rm(doc.prefix_id)
    assert kv.ls() == []
    with pytest.raises(PrefixNotFound):
        kv.generate("Who?", prefix=doc.prefix_id)
    with pytest.raises(InvalidInput, match="embedded"):
        KVClient("ftp://x")


def _cli(args: list[str], home: Path, model: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVSTASH_HOME": str(home), "KVSTASH_MODEL": str(model)}
    return subprocess.run([sys.executable, "-m", "client.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, input=stdin, timeout=300)


@pytest.mark.slow
def test_cli_json_round_trip(tmp_path: Path, tiny_model_dir: Path) -> None:
    home = tmp_path / "home"
    docfile = tmp_path / "report.txt"
    docfile.write_text(DOC)
    r = _cli(["prefill", str(docfile), "--json"], home, tiny_model_dir)
    assert r.returncode == 0, r.stderr
    pre = json.loads(r.stdout)
    assert set(pre) >= {"prefix_id", "n_tokens", "cached"} and pre["cached"] is False
    assert json.loads(_cli(["prefill", "-", "--json"], home, tiny_model_dir, stdin=DOC).stdout)["cached"] is True
    r = _cli(["generate", "--prefix", pre["prefix_id"], "Who signed it?", "--max-new-tokens", "6", "--json",
              "--seed", "1", "--temperature", "0"], home, tiny_model_dir)
    assert r.returncode == 0, r.stderr
    gen = json.loads(r.stdout)
    assert isinstance(gen["text"], str) and gen["stats"]["steps"] >= 1
    assert gen["stats"]["bytes_full"] > 0 and gen["stats"]["bytes_fetched"] > 0
    assert gen["stats"]["device_bytes"] >= gen["stats"]["device_bytes_own_kv"] > 0  # workers.device_bytes
    listing = json.loads(_cli(["ls", "--json"], home, tiny_model_dir).stdout)
    assert [x["prefix_id"] for x in listing] == [pre["prefix_id"]]
    info = json.loads(_cli(["info", pre["prefix_id"], "--json"], home, tiny_model_dir).stdout)
    assert info["n_tokens"] == pre["n_tokens"] and info["files"] and info["layout"]["page_size"] == 16
    assert json.loads(_cli(["rm", pre["prefix_id"], "--json"], home, tiny_model_dir).stdout)["removed"]
    assert json.loads(_cli(["ls", "--json"], home, tiny_model_dir).stdout) == []


@pytest.mark.slow
def test_cli_errors_are_clear(tmp_path: Path, tiny_model_dir: Path) -> None:
    home = tmp_path / "home"
    r = _cli(["generate", "--prefix", "f" * 32, "Who?", "--json"], home, tiny_model_dir)
    assert r.returncode == 3
    assert json.loads(r.stdout)["code"] == "NOT_FOUND" and "no prefix" in r.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = _cli(["prefill", str(empty)], home, tiny_model_dir)
    assert r.returncode == 2 and "empty" in r.stderr
    r = _cli(["prefill", str(tmp_path / "missing.txt")], home, tiny_model_dir)
    assert r.returncode == 2 and "no such file" in r.stderr
    r = _cli(["rm", "a" * 32], home, tiny_model_dir)
    assert r.returncode == 3


def test_cli_budget_json(capsys) -> None:
    from client.cli import main

    assert main(["budget", "--prefill-len", "131072", "--fraction", "0.02", "--head-dim", "128", "--phi-dim", "128",
                 "--sink", "4", "--tail", "16", "--gen-len", "64", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["n_budget"] == 2622  # ceil(0.02 * 131072)
    assert d["k_topk"] == d["n_budget"] - 4 - 16
    assert d["k_hyb"] == d["k_topk"] - d["n_off"] and d["n_off"] >= 1
    assert main(["budget", "--prefill-len", "10", "--fraction", "5", "--head-dim", "64", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["code"] == "INVALID_ARGUMENT"


def test_gen_len_amortizes_the_phi_fetch(kv: KVClient) -> None:
    doc = kv.prefill(DOC * 4)
    ks = {}
    for gen_len in (1, 64):
        g = kv.generate("Who signed it?", prefix=doc, method="topk+phi", budget=0.1, gen_len=gen_len,
                        max_new_tokens=2)
        _ = g.text
        ks[gen_len] = g.stats.extra["budget_k"]
    assert ks[64] > ks[1]  # the one-time φ fetch charged over 64 steps leaves more exact tokens per step
    with pytest.raises(InvalidInput, match="gen_len"):
        kv.generate("Who?", prefix=doc, gen_len=0)
