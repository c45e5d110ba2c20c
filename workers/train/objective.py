"""The model and its training loss (logits only where a token is trained)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from workers.train.config import ModelConfig
from workers.train.encode import ANSWER, LM


def build_model(cfg: ModelConfig, tokenizer, seed: int) -> LlamaForCausalLM:
    """A freshly initialized Llama for `tokenizer`'s special ids, using SDPA attention."""
    torch.manual_seed(seed)
    config = cfg.to_llama(tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


@dataclass(frozen=True)
class LossParts:
    """The loss to optimize and detached tensors worth logging (read them only when logging)."""

    loss: torch.Tensor
    answer_loss: torch.Tensor
    answer_acc: torch.Tensor
    lm_loss: torch.Tensor


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean() if x.numel() else x.new_zeros(())


def compute_loss(model: LlamaForCausalLM, batch: dict[str, torch.Tensor], lm_weight: float) -> LossParts:
    """Mean cross-entropy on answer tokens plus `lm_weight` times that on language-model tokens."""
    hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state
    kinds = batch["kinds"]
    trained = kinds != 0
    logits = model.lm_head(hidden[trained]).float()
    targets = batch["targets"][trained]
    ce = F.cross_entropy(logits, targets, reduction="none")
    is_answer = kinds[trained] == ANSWER
    answer = _mean(ce[is_answer])
    lm = _mean(ce[kinds[trained] == LM])
    acc = (logits[is_answer].argmax(-1) == targets[is_answer]).float()
    return LossParts(
        loss=answer + lm_weight * lm,
        answer_loss=answer.detach(),
        answer_acc=_mean(acc),
        lm_loss=lm.detach(),
    )
