"""Shared fixtures: a tiny random Llama saved to disk, a store in a temp dir, a worker."""

from __future__ import annotations

import os
from pathlib import Path

# Without a GPU, Triton kernels run in the interpreter; set before anything imports triton.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from lab.tiny_random import TinyLlamaSpec, build_tiny_llama
from store.config import StoreConfig
from store.kvstore import KVStore
from workers.engine import Worker
from workers.model import LoadedModel, load_model

TEST_PAGE_SIZE = 16


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, GQA 2) with a byte-level tokenizer, saved with save_pretrained."""
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-a", TinyLlamaSpec(seed=0))


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as ``tiny_model_dir`` with different weights."""
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-b", TinyLlamaSpec(seed=1))


@pytest.fixture(scope="session")
def endless_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model that never ends an answer with EOS, with a 32k context: long generations."""
    spec = TinyLlamaSpec(seed=0, never_eos=True, max_positions=1 << 15)
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-endless", spec)


@pytest.fixture(scope="session")
def endless_lm(endless_model_dir: Path) -> LoadedModel:
    """``endless_model_dir``, loaded."""
    return load_model(str(endless_model_dir), page_size=TEST_PAGE_SIZE, progress=False)


@pytest.fixture(scope="session")
def lm(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model, loaded through the product's loader."""
    return load_model(str(tiny_model_dir), page_size=TEST_PAGE_SIZE, progress=False)


@pytest.fixture()
def store(tmp_path: Path) -> KVStore:
    """An empty embedded store in a temp dir."""
    s = KVStore(StoreConfig(home=tmp_path / "home", page_size=TEST_PAGE_SIZE))
    yield s
    s.close()


@pytest.fixture()
def worker(store: KVStore, lm: LoadedModel) -> Worker:
    """A worker over ``store`` running the tiny model, with a small prefill chunk to exercise chunking."""
    return Worker(store, lm, chunk_size=40, progress=False)


@pytest.fixture()
def endless_worker(store: KVStore, endless_lm: LoadedModel) -> Worker:
    """A worker over ``store`` whose generations run to max_new_tokens."""
    return Worker(store, endless_lm, progress=False)
