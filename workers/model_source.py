"""Which model, device and dtype a worker runs when none is named (torch is imported only to probe for a GPU)."""

from __future__ import annotations

import os
from pathlib import Path

from store.errors import InvalidInput

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODELS_DIR = REPO_ROOT / "models"
SHIPPED_MODEL_NAME = "kvstash-tiny"
"""The project's own trained model (models/<name>), the default."""
MODEL_ENV = "KVSTASH_MODEL"


def default_model() -> str:
    """``$KVSTASH_MODEL``, else the shipped trained model; an error saying how to name one when neither exists."""
    if env := os.environ.get(MODEL_ENV):
        return env
    shipped = SHIPPED_MODELS_DIR / SHIPPED_MODEL_NAME
    if (shipped / "config.json").is_file():
        return str(shipped)
    raise InvalidInput(f"no model named and none shipped in {shipped}: set {MODEL_ENV} or pass --model "
                       "(a hub id or a local path)")


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    """The checkpoint's dtype on GPU, float32 on CPU (bf16 matmuls are slow on CPUs)."""
    return "float32" if device == "cpu" else "auto"


def local_model_problem(name_or_path: str) -> str | None:
    """Why ``name_or_path``, when it names a local directory, cannot be a model; None when it can, or is a hub id."""
    path = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith(("/", ".", "~")) or path.exists() or name_or_path.count("/") > 1
    if not looks_local:
        return None
    if not path.exists():
        return f"model path {name_or_path!r} does not exist (name a local model directory or a hub id like org/name)"
    if not path.is_dir():
        return f"model path {name_or_path!r} is not a directory"
    if not (path / "config.json").is_file():
        return f"{name_or_path!r} is not a Hugging Face model directory: it has no config.json"
    return None


def trained_context(name_or_path: str) -> int | None:
    """The longest context the model was trained on, when its ``kvstash.json`` says (``trained_context``)."""
    import json

    path = Path(name_or_path).expanduser() / "kvstash.json"
    try:
        value = json.loads(path.read_text()).get("trained_context")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None
