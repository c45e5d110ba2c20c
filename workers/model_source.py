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


HUB_PROBE_TIMEOUT_S = 3.0
"""How long loading waits to learn whether the model hub can be reached at all."""


def hub_offline(name_or_path: str, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether ``name_or_path`` is a hub id to load from the local cache only, because the hub cannot be
    reached (or ``HF_HUB_OFFLINE`` is set); ``InvalidInput`` at once when it cannot be reached and the
    model is not cached (instead of the hub client's minute of retries)."""
    if Path(name_or_path).expanduser().exists():
        return False
    from huggingface_hub import constants, try_to_load_from_cache

    cached = isinstance(try_to_load_from_cache(name_or_path, "config.json"), str)
    if constants.HF_HUB_OFFLINE:
        return True
    if _reachable(constants.ENDPOINT, timeout_s):
        return False
    if not cached:
        raise InvalidInput(f"cannot load model {name_or_path!r}: the model hub ({constants.ENDPOINT}) cannot be "
                           "reached and the model is not in the local cache; name a local model directory, "
                           "or download it where there is network")
    return True


def _reachable(url: str, timeout_s: float) -> bool:
    """Whether a TCP connection to ``url``'s host opens within ``timeout_s``."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False
