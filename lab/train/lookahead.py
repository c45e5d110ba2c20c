"""Train LookaheadKV's lookahead embeddings and lookahead-only LoRA for a shipped model (its weights stay frozen).

python -m lab.train.lookahead --model models/kvstash-tiny --minutes 20 --lengths 2048 3072 4096
python -m lab.train.lookahead --model models/kvstash-tiny --device cuda --lengths 4096 8192   # a GPU: longer samples

Per step, one sample of the synthetic suite's training split: the document is prefilled; the model
answers the query greedily with exact attention; the ground truth is the attention of that answer's
tokens over the document (softmax over the document, summed over the answer, per layer and query
head); the lookahead tokens run after the query, adapters on, and their attention is pulled to the
ground truth by the paper's loss (mean over layers and heads of KL(Norm(s_GT) || Norm(s_LKV))).
Writes ``lookahead.safetensors`` + ``lookahead.json`` beside the weights (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lab.synth import SynthContext, generate
from workers.attention import STEP_KWARG
from workers.fingerprint import model_fingerprint
from workers.lookahead_adapter import LookaheadAdapter, LookaheadConfig, save_adapter
from workers.methods.lookahead import LookaheadPass, lookahead_mass
from workers.model import LoadedModel, load_model
from workers.prefill import prefill_kv

TRAIN_TASKS = ("niah_single", "niah_single_word", "niah_multikey", "niah_multikey_uuid", "niah_multivalue",
               "niah_multiquery", "vt", "cwe", "fwe", "compare")
"""Question-answer tasks of the suite (``repeat`` answers with the whole document: no query-time cache)."""
EPS = 1e-8
"""Floor of normalized scores inside the log (a document position no head looks at)."""


@dataclass(frozen=True, kw_only=True)
class LookaheadTrainConfig:
    """One training run."""

    lengths: tuple[int, ...] = (2048, 3072, 4096)
    tasks: tuple[str, ...] = TRAIN_TASKS
    lr: float = 2e-3
    warmup: int = 10
    max_steps: int = 400
    """Sets the cosine schedule (a run may stop earlier at its time limit)."""
    max_answer: int = 24
    """Answer tokens generated for the ground truth."""
    clip: float = 1.0
    updates_per_sample: int = 2
    """Optimizer steps on each sample (its prefill and greedy answer cost far more than a step)."""
    seed: int = 0


@dataclass(frozen=True)
class Target:
    """One sample's inputs and ground-truth scores."""

    prefix: list[tuple[torch.Tensor, torch.Tensor]]
    query_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    position: int
    gt: dict[int, torch.Tensor]


def _forward(lm: LoadedModel, prefix: list, ids: list[int], position: int, score_from: int) -> tuple[LookaheadPass,
                                                                                                     torch.Tensor]:
    """Ordinary tokens ``ids`` at ``position`` over the prefix (exact attention): the pass and the last logits."""
    empty = prefix[0][0][:, :0]
    step = LookaheadPass(lambda layer: (empty, empty), lambda layer: prefix[layer], score_from=score_from, keep_kv=True)
    positions = torch.arange(position, position + len(ids), device=lm.device)[None]
    out = lm.model(input_ids=torch.tensor([ids], device=lm.device), position_ids=positions, use_cache=False,
                   logits_to_keep=1, **{STEP_KWARG: step})
    return step, out.logits[0, -1]


@torch.no_grad()
def target(lm: LoadedModel, document: str, query: str, max_answer: int) -> Target | None:
    """Prefill, answer greedily, and score the answer's attention over the document (None: an empty answer)."""
    doc = list(lm.tokenizer(document).input_ids)
    q = list(lm.tokenizer(query, add_special_tokens=False).input_ids)
    # prefill runs in inference mode; clones are ordinary tensors autograd may save
    prefix = [(k.clone(), v.clone()) for _, k, v in prefill_kv(lm, doc, chunk_size=1024, progress=False)]
    answer: list[int] = []
    stop = set(lm.eos_ids) | set(lm.tokenizer("\n", add_special_tokens=False).input_ids)
    for _ in range(max_answer):
        _, logits = _forward(lm, prefix, q + answer, len(doc), len(q))
        token = int(logits.argmax())
        if token in stop:
            break
        answer.append(token)
    if not answer:
        return None
    step, _ = _forward(lm, prefix, q + answer, len(doc), len(q))  # rows of the answer's tokens
    query_kv = {layer: (k[:, :len(q)], v[:, :len(q)]) for layer, (k, v) in step.kv.items()}
    return Target(prefix=prefix, query_kv=query_kv, position=len(doc) + len(q), gt=step.mass)


def kl_loss(gt: dict[int, torch.Tensor], pred: dict[int, torch.Tensor]) -> torch.Tensor:
    """Mean over layers and query heads of KL(Norm(gt) || Norm(pred)), scores ``[Hq, N]`` per layer."""
    losses = []
    for layer, g in gt.items():
        p = pred[layer]
        g = g / g.sum(-1, keepdim=True)
        p = p / p.sum(-1, keepdim=True)
        losses.append((g * ((g + EPS).log() - (p + EPS).log())).sum(-1).mean())
    return torch.stack(losses).mean()


def step_loss(lm: LoadedModel, adapter: LookaheadAdapter, t: Target) -> torch.Tensor:
    """The lookahead tokens' loss on one sample (differentiable in the adapter)."""
    mass = lookahead_mass(lm.model, adapter, lambda layer: t.query_kv[layer], lambda layer: t.prefix[layer],
                          t.position)
    return kl_loss(t.gt, mass)


def lr_at(step: int, cfg: LookaheadTrainConfig) -> float:
    """Linear warm-up, then cosine decay to 0 over ``max_steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup))
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * frac))


def train(lm: LoadedModel, adapter: LookaheadAdapter, cfg: LookaheadTrainConfig, *, seconds: float,
          log: list[dict[str, float]], on_step: object = None) -> int:
    """Train until ``max_steps`` or ``seconds``; appends ``{step, loss, length}`` to ``log``; returns steps taken."""
    ctx = SynthContext(tokenizer=lm.tokenizer, split="train")
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=0.0)
    lm.model.requires_grad_(False)
    start, step = time.perf_counter(), 0
    while step < cfg.max_steps and time.perf_counter() - start < seconds:
        task, length = rng.choice(cfg.tasks), rng.choice(cfg.lengths)
        sample = generate(task, length, rng.randrange(1 << 30), ctx)
        t = target(lm, sample.document, sample.query, cfg.max_answer)
        if t is None:
            continue
        for _ in range(cfg.updates_per_sample):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss = step_loss(lm, adapter, t)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(adapter.parameters(), cfg.clip)
            opt.step()
            log.append({"step": step, "loss": float(loss.detach()), "length": float(length),
                        "s": time.perf_counter() - start})
            step += 1
            if callable(on_step):
                on_step(step)
    return step


def _summary(log: list[dict[str, float]], k: int = 20) -> dict[str, float]:
    first, last = log[:k], log[-k:]
    return {"loss_first": sum(r["loss"] for r in first) / max(1, len(first)),
            "loss_last": sum(r["loss"] for r in last) / max(1, len(last)), "window": float(k)}


def main(argv: list[str] | None = None) -> None:
    """Command line: train and write the adapter beside the model's weights (or into ``--out``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("models/kvstash-tiny"))
    p.add_argument("--out", type=Path, help="folder for lookahead.* (default: the model folder)")
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock limit")
    p.add_argument("--steps", type=int, default=LookaheadTrainConfig.max_steps, help="steps (LR schedule length)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LookaheadTrainConfig.lengths))
    p.add_argument("--n-lookahead", type=int, default=LookaheadConfig.n_lookahead)
    p.add_argument("--rank", type=int, default=LookaheadConfig.rank)
    p.add_argument("--lr", type=float, default=LookaheadTrainConfig.lr)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (on the CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model and adapter train (default: cuda when there is a GPU)")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--updates-per-sample", type=int, default=LookaheadTrainConfig.updates_per_sample)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    lm = load_model(str(a.model), device=a.device, dtype="float32", progress=False)
    if lm.lookahead is not None:  # retraining: start fresh, without the shipped adapter's hooks
        lm.lookahead.detach_hooks()
    base = model_fingerprint(lm.model, str(a.model))
    la_cfg = LookaheadConfig(n_lookahead=a.n_lookahead, rank=a.rank)
    adapter = LookaheadAdapter(lm.model, la_cfg)
    cfg = LookaheadTrainConfig(lengths=tuple(a.lengths), lr=a.lr, max_steps=a.steps,
                               updates_per_sample=a.updates_per_sample)
    out = a.out or a.model
    out.mkdir(parents=True, exist_ok=True)
    log: list[dict[str, float]] = []

    def save(steps: int) -> None:
        info = {"steps": steps, "train": {**cfg.__dict__, "tasks": list(cfg.tasks), "lengths": list(cfg.lengths),
                                          "split": "train", "threads": a.threads, "device": str(lm.device)},
                **_summary(log), "log": [{k: round(v, 4) for k, v in r.items()} for r in log]}
        save_adapter(adapter, out, base_fingerprint=base, info=info)

    def on_step(step: int) -> None:
        r = log[-1]
        print(json.dumps({k: round(v, 4) for k, v in r.items()}), flush=True)
        if step % a.save_every == 0:
            save(step)

    steps = train(lm, adapter, cfg, seconds=60 * a.minutes, log=log, on_step=on_step)
    save(steps)
    print(json.dumps({"steps": steps, **_summary(log)}))


if __name__ == "__main__":
    main()
