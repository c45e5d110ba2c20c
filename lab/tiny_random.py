"""A tiny random-weight Llama with a byte-level tokenizer, saved like any user's model.

Used by tests (and by the demo until a trained model ships): it goes through the same
``from_pretrained`` path a real model takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")


@dataclass(frozen=True, kw_only=True)
class TinyLlamaSpec:
    """Sizes of the tiny random model."""

    hidden_size: int = 64
    intermediate_size: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    max_positions: int = 4096
    rope_theta: float = 1e6
    init_range: float = 0.3
    """Large enough that attention depends on context (a flat random model repeats one token)."""
    seed: int = 0
    never_eos: bool = False
    """Zero the EOS row of the tied embedding: greedy decoding then runs until max_new_tokens or the
    context ends (for tests and benches that need long generations)."""


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens + bos/eos/pad) that adds BOS to each encoding."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for s in SPECIAL_TOKENS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_tiny_llama(path: Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Create, save (``save_pretrained``) and return the directory of a tiny random Llama."""
    spec = spec or TinyLlamaSpec()
    tok = byte_level_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        max_position_embeddings=spec.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        initializer_range=spec.init_range,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).eval()
    if spec.never_eos:
        with torch.no_grad():  # EOS's logit is then 0, below the largest of 258 random logits
            model.get_input_embeddings().weight[tok.eos_token_id].zero_()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_tiny_rat(path: Path, spec: TinyLlamaSpec | None = None, *, gate_std: float = 0.5) -> Path:
    """A tiny random RAT+ model (``workers.ratplus``): the tiny Llama's weights and random memory gates (weights
    ``N(0, gate_std)``, biases ``N(0, 1)``: gates anywhere in (0, 1)), saved like any user's model."""
    from workers.ratplus import RatConfig, RatForCausalLM

    spec = spec or TinyLlamaSpec()
    plain = build_tiny_llama(path / "_plain", spec)
    fields = {k: v for k, v in LlamaConfig.from_pretrained(plain).to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version")}
    model = RatForCausalLM.from_pretrained(plain, config=RatConfig(**fields)).eval()
    g = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.self_attn.memory_gate
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * gate_std)
            gate.bias.copy_(torch.randn(gate.bias.shape, generator=g))
    model.save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path
