"""The model and its training loss (logits only where a token is trained)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from lab.train.config import ModelConfig
from lab.train.encode import AGGREGATE, ANSWER, LM
from workers.ratplus.modeling import MemoryGate


def build_model(cfg: ModelConfig, tokenizer, seed: int) -> LlamaForCausalLM:
    """A freshly initialized Llama (RAT+ when `cfg` has memory) for `tokenizer`'s special ids, using SDPA."""
    torch.manual_seed(seed)
    config = cfg.to_llama(tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    config._attn_implementation = "sdpa"
    if cfg.memory_max_length is not None:
        from workers.ratplus import RatConfig, RatForCausalLM

        assert isinstance(config, RatConfig)
        return RatForCausalLM(config)
    return LlamaForCausalLM(config)


@dataclass(frozen=True)
class LossParts:
    """The loss to optimize and detached tensors worth logging (read them only when logging)."""

    loss: torch.Tensor
    answer_loss: torch.Tensor
    answer_acc: torch.Tensor
    lm_loss: torch.Tensor
    agg_loss: torch.Tensor
    """Mean cross-entropy on aggregation answers alone (0 when the batch has none)."""
    agg_acc: torch.Tensor


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean() if x.numel() else x.new_zeros(())


def compute_loss(
    model: LlamaForCausalLM, batch: dict[str, torch.Tensor], lm_weight: float, agg_weight: float | None = None
) -> LossParts:
    """Mean cross-entropy on answer tokens plus `lm_weight` times that on language-model tokens.

    With `agg_weight` None, aggregation answers are ordinary answer tokens; otherwise they are
    averaged on their own and added with that weight (so a few short cwe/fwe answers are not
    drowned by long reconstruction or dense-recall answers in the token mean).
    """
    hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state
    kinds = batch["kinds"]
    trained = kinds != 0
    logits = model.lm_head(hidden[trained]).float()
    targets = batch["targets"][trained]
    ce = F.cross_entropy(logits, targets, reduction="none")
    kind = kinds[trained]
    is_agg = kind == AGGREGATE
    is_answer = (kind == ANSWER) | is_agg if agg_weight is None else kind == ANSWER
    answer = _mean(ce[is_answer])
    agg = _mean(ce[is_agg])
    lm = _mean(ce[kind == LM])
    loss = answer + lm_weight * lm + (0.0 if agg_weight is None else agg_weight * agg)
    hit = (logits.argmax(-1) == targets).float()
    return LossParts(
        loss=loss,
        answer_loss=answer.detach(),
        answer_acc=_mean(hit[is_answer]),
        lm_loss=lm.detach(),
        agg_loss=agg.detach(),
        agg_acc=_mean(hit[is_agg]),
    )


def memory_floor_penalty(gates: Sequence[MemoryGate], floor: float) -> torch.Tensor:
    """Mean over the layers' gates of ``relu(floor − last forward's mean gate)²`` (``TrainConfig.memory_gate_floor``);
    the gates must record their means (``workers.ratplus.memory_gates(model, record_mean=True)``)."""
    means = [g.last_mean for g in gates]
    if not means or any(m is None for m in means):
        raise ValueError("memory_floor_penalty needs gates that recorded a forward (record_mean)")
    return torch.stack([F.relu(floor - m) ** 2 for m in means if m is not None]).mean()
