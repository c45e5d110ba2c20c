"""Typed, frozen configuration of the model and of a training run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from transformers import LlamaConfig


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the Llama model (GQA with 4 query heads per KV head, large RoPE base)."""

    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 768
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 1e6
    max_positions: int = 32768
    """Longest sequence the config declares (RoPE itself has no hard limit)."""
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    memory_max_length: float | None = None
    """None: a plain Llama. Else RAT+ (``workers.ratplus``): a decaying memory over keys and values in every
    layer, with this longest effective length."""
    memory_gate_bias: float = -3.0
    """RAT+ only: the memory gates' initial logit (near-plain start; see ``RatConfig``)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    def to_llama(self, pad_id: int, bos_id: int, eos_id: int) -> LlamaConfig:
        """The transformers config (tied embeddings, no biases): a ``RatConfig`` when the model has memory."""
        cls: type[LlamaConfig] = LlamaConfig
        extra: dict[str, Any] = {}
        if self.memory_max_length is not None:
            from workers.ratplus import RatConfig

            cls, extra = RatConfig, {"memory_max_length": self.memory_max_length,
                                     "memory_gate_bias": self.memory_gate_bias}
        return cls(
            **extra,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_positions,
            rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.initializer_range,
            tie_word_embeddings=True,
            pad_token_id=pad_id,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
        )


TINY_MODEL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16)
"""A model small enough for CPU tests."""


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One curriculum stage: until this fraction of the run, lengths drawn from `lengths`."""

    until: float
    lengths: tuple[int, ...]


DEFAULT_CURRICULUM = (
    Stage(until=0.12, lengths=(512, 1024)),
    Stage(until=0.30, lengths=(1024, 2048, 4096)),
    Stage(until=0.55, lengths=(2048, 4096, 8192)),
    Stage(until=1.00, lengths=(4096, 8192, 16384, 16384)),
)


@dataclass(frozen=True, kw_only=True)
class AggregationMix:
    """Which aggregation samples (compare / cwe / fwe) training draws; every draw is one fitted sample."""

    compare_share: float = 0.0
    """Probability that an aggregation draw is the query-dependent word comparison (`compare`)."""
    cwe_share: float = 0.5
    """Of the other draws: probability of cwe (else fwe)."""
    cwe_common: tuple[int, ...] = (3, 5, 10)
    """cwe: number of common words to name, drawn uniformly (repeat a value to weight it)."""
    fwe_top: tuple[int, ...] = (1, 2, 3)
    """fwe: number of most frequent words to name, drawn uniformly."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.cwe_share <= 1.0 and 0.0 <= self.compare_share <= 1.0):
            raise ValueError("cwe_share and compare_share must be in [0, 1]")
        if not self.cwe_common or not self.fwe_top or min(self.cwe_common + self.fwe_top) < 1:
            raise ValueError("cwe_common and fwe_top need at least one count, each >= 1")


@dataclass(frozen=True, kw_only=True)
class MixConfig:
    """Relative weights of the training components (normalized when drawn)."""

    dense_recall: float = 0.40
    ruler: float = 0.40
    """RULER tasks: 60% NIAH, 30% variable tracking, 10% aggregation (drawn from `agg`)."""
    repeat: float = 0.10
    plain_text: float = 0.10
    aggregation: float = 0.0
    """Aggregation-only rows (drawn from `agg`), besides the RULER component's share."""
    agg: AggregationMix = field(default_factory=AggregationMix)
    max_repeat_tokens: int = 4096
    """Cap on a copy document (its answer doubles the sequence)."""
    answer_reserve: int = 48
    """Tokens first kept free after a RULER prompt for its answer (retried smaller if it is longer)."""

    def __post_init__(self) -> None:
        weights = (self.dense_recall, self.ruler, self.repeat, self.plain_text, self.aggregation)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError("mix weights must be >= 0 and not all zero")

    @classmethod
    def from_dict(cls, data: dict) -> MixConfig:
        """Inverse of `asdict` (older configs without `aggregation` / `agg` get the defaults)."""
        data = dict(data)
        if "agg" in data:
            agg: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data["agg"].items()}
            data["agg"] = AggregationMix(**agg)
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run; every number that shapes training lives here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mix: MixConfig = field(default_factory=MixConfig)
    curriculum: tuple[Stage, ...] = DEFAULT_CURRICULUM
    steps: int = 4000
    """Step count at the end of this run (the LR schedule and curriculum end here)."""
    start_step: int = 0
    """Step this stage starts from (a fine-tune from exported weights starts at their step);
    warm-up, cosine decay and the length curriculum run over `start_step`..`steps`."""
    tokens_per_batch: int = 131072
    """Sequences per batch = tokens_per_batch // that batch's length."""
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    lm_weight: float = 0.3
    """Weight of the language-modelling loss next to the answer loss."""
    agg_weight: float | None = None
    """None: aggregation answers are ordinary answer tokens. A number: they get their own mean
    cross-entropy, added with this weight (see `objective.compute_loss`)."""
    memory_lr_scale: float = 10.0
    """Learning-rate multiplier of the RAT+ memory gates (new parameters; the paper: 10× the others)."""
    memory_hold_steps: int = 0
    """RAT+ only: the stage's first steps during which the memory gates stay at their init (learning rate 0),
    so the rest of the model adapts to the memory before the gates may close it."""
    memory_ramp_steps: int = 0
    """RAT+ only: the stage's first steps during which the gates' cap grows linearly from 0 (k̃ = k: the plain
    model) to its full value 1 − 1/``memory_max_length`` (``memory_cap_scale``), while the gates train from the
    first step; 0: full cap throughout. Training-only: an export always has the full cap."""
    memory_gate_floor: float = 0.0
    """RAT+ only (ours, not the paper's): a floor on each layer's mean gate at the full cap, kept by the penalty
    ``memory_floor_weight · mean over layers of relu(floor − mean gate)²`` added to the loss, so the memory stays
    open on average while the gates may still close at the tokens a head must copy (without it continued training
    closes them to 1-2 tokens, docs/benchmarks/ratplus.md). The effective length 1 / (1 − g) of a floor g: 0.9 ->
    10 tokens, 0.95 -> 20. 0: off."""
    memory_floor_weight: float = 1.0
    """Weight of the ``memory_gate_floor`` penalty."""
    seed: int = 0
    checkpoint_every: int = 200
    log_every: int = 20
    workers: int = 8
    """DataLoader worker processes generating batches."""

    def __post_init__(self) -> None:
        if not self.curriculum or self.curriculum[-1].until < 1.0:
            raise ValueError("the last curriculum stage must reach until=1.0")
        if not 0 <= self.start_step < self.steps:
            raise ValueError(f"need 0 <= start_step < steps, got {self.start_step} and {self.steps}")
        if self.memory_ramp_steps < 0:
            raise ValueError(f"memory_ramp_steps must be >= 0, got {self.memory_ramp_steps}")
        if not 0.0 <= self.memory_gate_floor < 1.0 or self.memory_floor_weight < 0:
            raise ValueError(f"need 0 <= memory_gate_floor < 1 and memory_floor_weight >= 0, got "
                             f"{self.memory_gate_floor} and {self.memory_floor_weight}")

    def progress(self, step: int) -> float:
        """Fraction of this stage done before `step` (0 at `start_step`, 1 at `steps`)."""
        return min(1.0, max(0.0, (step - self.start_step) / (self.steps - self.start_step)))

    def memory_cap_scale(self, step: int) -> float:
        """Multiplier of the RAT+ gates' cap at `step` (the cap ramp): 0 at `start_step`, 1 from
        `start_step + memory_ramp_steps` on (always 1 without a ramp). Depends on the step only (resume)."""
        if self.memory_ramp_steps <= 0:
            return 1.0
        return min(1.0, max(0.0, (step - self.start_step) / self.memory_ramp_steps))

    def to_dict(self) -> dict:
        """A JSON-able dict of this config."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """Inverse of `to_dict`; unknown keys are errors."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown TrainConfig keys: {sorted(unknown)}")
        data = dict(data)
        if "model" in data:
            data["model"] = ModelConfig(**data["model"])
        if "mix" in data:
            data["mix"] = MixConfig.from_dict(data["mix"])
        if "curriculum" in data:
            data["curriculum"] = tuple(Stage(until=s["until"], lengths=tuple(s["lengths"])) for s in data["curriculum"])
        if "betas" in data:
            data["betas"] = tuple(data["betas"])
        return cls(**data)


AGGREGATION_CURRICULUM = (
    Stage(until=0.35, lengths=(512, 1024, 2048)),
    Stage(until=0.70, lengths=(1024, 2048, 4096)),
    Stage(until=1.00, lengths=(2048, 4096, 8192, 16384)),
)

AGGREGATION_MIX = MixConfig(
    dense_recall=0.25,
    ruler=0.25,
    repeat=0.05,
    plain_text=0.05,
    aggregation=0.40,
    agg=AggregationMix(cwe_common=(1, 2, 3, 5, 10, 10), fwe_top=(1, 2, 3, 3)),
)
"""Fine-tune mix: 42.5% aggregation rows (easy counts first in the draw), the old components kept."""

COMPARE_MIX = replace(AGGREGATION_MIX, agg=replace(AGGREGATION_MIX.agg, compare_share=0.5))
"""Stage-3 mix: the stage-2 mix with half of the aggregation rows the query-dependent `compare`."""

AGGREGATION_FINETUNE = TrainConfig(
    mix=AGGREGATION_MIX,
    curriculum=AGGREGATION_CURRICULUM,
    agg_weight=1.0,
    lr=5e-4,
    warmup_steps=50,
    steps=2400,
)

COMPARE_FINETUNE = replace(AGGREGATION_FINETUNE, mix=COMPARE_MIX, steps=2000)

CONTINUED = replace(COMPARE_FINETUNE, lr=1.5e-4, warmup_steps=40, steps=2000)
"""Continued training of the shipped model (issue 17: RAT+ and its plain baseline): stage 3's data mix and
curriculum; lr a tenth of stage 1's peak with 2% warm-up (the paper's OLMo2 recipe, scaled), the memory
gates at ``memory_lr_scale`` × that."""

PRESETS: dict[str, TrainConfig] = {
    "base": TrainConfig(),
    "aggregation": AGGREGATION_FINETUNE,
    "compare": COMPARE_FINETUNE,
    "continued": CONTINUED,
}
"""Named recipes: `base` trains from scratch; `aggregation` fine-tunes exported weights (`--init`)
for `steps` more steps on an aggregation-heavy mix at short lengths first; `compare` is the same
recipe with half of the aggregation rows the query-dependent word comparison; `continued` is the
RAT+ / plain continued training (`lab.train.continued`)."""
