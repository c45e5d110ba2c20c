"""Loading a causal LM (hub id or local path) with what kvstash needs to know about it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from store.layout import KVLayout
from workers.attention import KVSTASH_ATTENTION, register_attention
from workers.fingerprint import model_fingerprint
from workers.lookahead_adapter import LookaheadAdapter, load_adapter
from workers.methods.head_scores import HeadScores, load_head_scores
from workers.methods.phi_maps import FeatureMap, load_feature_map
from workers.model_ops import use_fused_ops
from workers.model_source import hub_offline
from workers.prompt import PromptFormat
from workers.ratplus import register_rat

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A model, its tokenizer, and the facts the store and decoder depend on."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str
    layout: KVLayout
    max_context: int
    prompt: PromptFormat
    phi_map: FeatureMap | None = None
    """The distilled φ feature map shipped with the model (``phi_map.*``), if any; else FAVOR+."""
    lookahead: LookaheadAdapter | None = None
    """LookaheadKV's trained tokens and adapters shipped with the model (``lookahead.*``), if any."""
    head_scores: HeadScores | None = None
    """HybridKV's calibration head ranking shipped with the model (``hybridkv_heads.json``), if any."""

    @property
    def device(self) -> torch.device:
        """Device of the model's parameters."""
        return next(self.model.parameters()).device

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a generation."""
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        return frozenset(int(i) for i in ids if i is not None)


def _head_dim(config) -> int:  # noqa: ANN001 - a transformers config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def load_model(name_or_path: str, *, device: str = "cpu", dtype: str = "auto", page_size: int = 16,
               progress: bool = True, fused_ops: bool = True) -> LoadedModel:
    """Load a causal LM and its tokenizer through ``from_pretrained`` and describe its KV layout; ``fused_ops``
    runs a CUDA model's RoPE and RMSNorm as one launch each outside autograd (``workers.model_ops``)."""
    register_attention()
    register_rat()  # RAT+ checkpoints (model_type "kvstash_rat") load from our own code, never remote code
    if not progress:
        hf_logging.disable_progress_bar()
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    offline = hub_offline(name_or_path)  # a hub id with no hub in reach: the local cache, without retries
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=offline)
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype,
                                                                  local_files_only=offline)
    model.to(device).eval()  # type: ignore[arg-type]
    # The hook does plain causal SDPA when no prefix is attached, so one setting serves prefill and decode.
    model.set_attn_implementation(KVSTASH_ATTENTION)
    if fused_ops and model.device.type == "cuda":  # elsewhere the routers would only add a call per op
        use_fused_ops(model)
    cfg = model.config
    layout = KVLayout(
        n_layers=cfg.num_hidden_layers,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=_head_dim(cfg),
        dtype=DTYPE_NAMES[model.dtype],
        page_size=page_size,
    )
    phi_map = load_feature_map(name_or_path)
    fingerprint = model_fingerprint(model, name_or_path)
    lookahead = load_adapter(Path(name_or_path), model, fingerprint) if Path(name_or_path).is_dir() else None
    if phi_map is not None:  # φ caches built with the map belong to (weights, map)
        heads = (layout.n_layers, cfg.num_attention_heads, layout.n_kv_heads, layout.head_dim)
        if phi_map.shape != heads:
            raise ValueError(f"{name_or_path}: phi_map is for (layers, heads, kv heads, head dim) {phi_map.shape}, "
                             f"the model has {heads}")
        phi_map.to(device)
        fingerprint = hashlib.sha256(f"{fingerprint}:phi:{phi_map.digest}".encode()).hexdigest()[:32]
    if lookahead is not None:  # the adapter ships with the model: a different adapter is a different model
        fingerprint = hashlib.sha256(f"{fingerprint}:lookahead:{lookahead.digest}".encode()).hexdigest()[:32]
    head_scores = load_head_scores(name_or_path)
    if head_scores is not None:  # compressed caches built with the ranking belong to (weights, ranking)
        if head_scores.shape != (layout.n_layers, layout.n_kv_heads):
            raise ValueError(f"{name_or_path}: hybridkv_heads.json is for (layers, kv heads) {head_scores.shape}, "
                             f"the model has {(layout.n_layers, layout.n_kv_heads)}")
        fingerprint = hashlib.sha256(f"{fingerprint}:hybridkv:{head_scores.digest}".encode()).hexdigest()[:32]
    return LoadedModel(
        name=name_or_path,
        model=model,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        phi_map=phi_map,
        lookahead=lookahead,
        head_scores=head_scores,
        layout=layout,
        max_context=int(getattr(cfg, "max_position_embeddings", 1 << 20)),
        prompt=PromptFormat.load(name_or_path),
    )
