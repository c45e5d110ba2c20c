"""Next steps launched before the host has this step's tokens (``workers.step_ahead``): same tokens and reads."""

from __future__ import annotations

import threading

import pytest
import torch

from store.errors import Cancelled
from store.kvstore import KVStore
from workers.decode_batch import EngineConfig
from workers.engine import Worker, drain_together
from workers.model import LoadedModel
from workers.requests import DecodeConfig, GenerationStats, SamplingParams
from workers.sampling import Sampler
from workers.step_ahead import DeviceTokens

DOCS = [
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike " * 9 + "The code is 4411.",
    "november oscar papa quebec romeo sierra tango uniform victor whiskey " * 12 + "The code is 9071.",
]
QUERIES = [" What is the code?", " Tell me the code, please. The code is"]


def _worker(store: KVStore, lm: LoadedModel, ahead: bool) -> Worker:
    """A worker whose static steps run eagerly on the CPU (the captured step's code path, uncaptured)."""
    return Worker(store, lm, progress=False, offload=None, engine=EngineConfig(whole_step="eager", step_ahead=ahead))


def _run(worker: Worker, pids: list[str], params: list[SamplingParams], method: str = "quest",
         close_after: int | None = None) -> list[GenerationStats]:
    """The generations at once; with ``close_after``, the first is closed after that many pieces."""
    stats = [GenerationStats() for _ in pids]
    streams = [worker.generate(pid, q, p, method=method, decode=DecodeConfig(budget=0.3), stats=s)
               for pid, q, p, s in zip(pids, QUERIES, params, stats, strict=True)]
    if close_after is not None:
        for _ in range(close_after):
            for s in streams:
                next(s)
        streams[0].close()  # type: ignore[attr-defined]
        streams = streams[1:]
    drain_together(streams)
    return stats


def _same(want: list[GenerationStats], got: list[GenerationStats]) -> None:
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.bytes_fetched == w.bytes_fetched and g.prefix_tokens_per_step == w.prefix_tokens_per_step
        assert g.steps == w.steps


@pytest.mark.parametrize("method", ["quest", "full", "topk+phi"])
def test_steps_launched_ahead_give_the_same_tokens_and_reads(store: KVStore, endless_lm: LoadedModel,
                                                             method: str) -> None:
    off, on = _worker(store, endless_lm, False), _worker(store, endless_lm, True)
    pids = [off.prefill(d).prefix_id for d in DOCS]
    params = [SamplingParams(max_new_tokens=9), SamplingParams(max_new_tokens=14)]  # one ends first
    want = _run(off, pids, params, method)
    got = _run(on, pids, params, method)
    _same(want, got)
    assert off.engine.ahead_steps == 0
    # Both together from their first static step until the first ends at 9 tokens (no step is launched past a
    # known length), then the second alone: most steps went ahead, and none had to be dropped.
    assert on.engine.ahead_steps >= 8 and on.engine.ahead_dropped == 0


def test_a_stop_string_drops_the_step_launched_past_it(store: KVStore, endless_lm: LoadedModel) -> None:
    off, on = _worker(store, endless_lm, False), _worker(store, endless_lm, True)
    pids = [off.prefill(d).prefix_id for d in DOCS]
    free = _run(off, pids, [SamplingParams(max_new_tokens=12)] * 2)
    text = endless_lm.tokenizer.decode(free[0].token_ids[:7])
    stop = text[-3:] if text[-3:].strip() else text[-5:]
    params = [SamplingParams(max_new_tokens=12, stop=(stop,)), SamplingParams(max_new_tokens=12)]
    want = _run(off, pids, params)
    got = _run(on, pids, params)
    assert want[0].finish_reason == "stop" and len(want[0].token_ids) < 12  # it really stopped early
    _same(want, got)
    assert on.engine.ahead_dropped >= 1  # the step launched past the stop was not used


def test_closing_a_generation_with_a_step_in_flight_leaves_the_others_exact(store: KVStore,
                                                                           endless_lm: LoadedModel) -> None:
    off, on = _worker(store, endless_lm, False), _worker(store, endless_lm, True)
    pids = [off.prefill(d).prefix_id for d in DOCS]
    params = [SamplingParams(max_new_tokens=20)] * 2
    want = _run(off, pids, params, close_after=6)
    got = _run(on, pids, params, close_after=6)
    assert got[1].token_ids == want[1].token_ids and len(got[1].token_ids) == 20
    assert got[1].bytes_fetched == want[1].bytes_fetched
    assert on.engine.ahead_dropped >= 1 and on.engine.running() == 0


def test_seeded_sampling_steps_ahead_with_the_same_tokens(store: KVStore, endless_lm: LoadedModel) -> None:
    off, on = _worker(store, endless_lm, False), _worker(store, endless_lm, True)
    pids = [off.prefill(d).prefix_id for d in DOCS]
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.8, seed=3),
              SamplingParams(max_new_tokens=12, temperature=1.3, seed=11)]
    want = _run(off, pids, params)
    got = _run(on, pids, params)
    _same(want, got)
    assert on.engine.ahead_steps >= 8  # picked on the device, each generator advanced once per token


def test_device_tokens_are_the_rows_first_maxima() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 2.0]])
    greedy = [Sampler(SamplingParams(), torch.device("cpu"))] * 2
    assert DeviceTokens(logits, greedy).tolist() == [1, 0]


def _nucleus_by_index(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """The nucleus written with a boolean index (what ``Sampler`` did before it stayed on the device), then the
    same exponential race."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
    keep[0] = True
    probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    race = torch.empty_like(probs).exponential_(1.0, generator=gen)
    return int(torch.where(probs > 0, probs / race, -1.0).argmax())


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.3, 1e-30])
def test_device_picks_are_the_host_samplers_tokens(top_p: float) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    samplers = [Sampler(SamplingParams(temperature=0.8, top_p=top_p, seed=s), torch.device("cpu")) for s in (1, 2)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    for _ in range(20):  # each generator advanced once per pick, on both sides
        got = DeviceTokens(logits, [*samplers, Sampler(SamplingParams(), torch.device("cpu"))]).tolist()
        want = [_nucleus_by_index(logits[i], 0.8, top_p, g) for i, g in enumerate(gens)]
        assert got == [*want, int(logits[2].argmax())]


def test_the_device_sampler_draws_from_the_nucleus_distribution() -> None:
    """Frequencies of 20,000 draws match the nucleus probabilities (each within 5 standard errors), and a token
    outside the nucleus is never drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature, top_p, n = 0.7, 0.9, 20_000
    probs = torch.softmax(logits / temperature, dim=-1).double()
    keep = torch.cumsum(probs, 0) - probs < top_p  # logits are sorted: the nucleus is a prefix
    want = torch.where(keep, probs, 0.0)
    want = want / want.sum()
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=0), torch.device("cpu"))
    counts = torch.bincount(torch.stack([sampler.pick(logits) for _ in range(n)]), minlength=len(logits)).double()
    got = counts / n
    se = (want * (1 - want) / n).sqrt()
    assert bool(((got - want).abs() <= 5 * se + 1e-12).all()), (got, want)
    assert counts[~keep].sum() == 0 and keep.sum() < len(logits)  # the nucleus really dropped tokens


def test_threads_pulling_closing_and_cancelling_get_the_tokens_of_each_generation_alone(
        store: KVStore, endless_lm: LoadedModel) -> None:
    """Six generations on six threads (two stop early by stop strings, one is cancelled from another thread, one
    closed by its consumer) while steps go ahead: every token a consumer got is the token that generation gets
    alone without stepping ahead, and the engine ends empty."""
    off, on = _worker(store, endless_lm, False), _worker(store, endless_lm, True)
    pids = [off.prefill(d).prefix_id for d in DOCS]
    probe = _run(off, pids, [SamplingParams(max_new_tokens=10)] * 2)
    stop = endless_lm.tokenizer.decode(probe[1].token_ids[:6])[-4:]
    jobs = [(0, SamplingParams(max_new_tokens=18)), (1, SamplingParams(max_new_tokens=14, stop=(stop,))),
            (0, SamplingParams(max_new_tokens=16, temperature=0.8, seed=5)), (1, SamplingParams(max_new_tokens=30)),
            (0, SamplingParams(max_new_tokens=30)), (1, SamplingParams(max_new_tokens=12, stop=(stop,)))]
    cancelled, closed = 3, 4

    def alone(i: int) -> list[int]:
        st = GenerationStats()
        pid, params = jobs[i]
        "".join(off.generate(pids[pid], QUERIES[pid], params, method="quest", decode=DecodeConfig(budget=0.3),
                             stats=st))
        return st.token_ids

    want = [alone(i) for i in range(len(jobs))]
    stats = [GenerationStats() for _ in jobs]
    streams = [on.generate(pids[pid], QUERIES[pid], params, method="quest", decode=DecodeConfig(budget=0.3), stats=s)
               for (pid, params), s in zip(jobs, stats, strict=True)]
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            for n, _ in enumerate(streams[i]):
                if i == closed and n == 5:
                    streams[i].close()  # type: ignore[attr-defined]
                    return
                if i == cancelled and n == 4:
                    threading.Thread(target=streams[i].cancel).start()  # type: ignore[attr-defined]
        except Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    for i, (w, g) in enumerate(zip(want, stats, strict=True)):
        assert g.token_ids == w[: len(g.token_ids)], i  # what it got is what it gets alone
        if i not in (cancelled, closed):
            assert g.token_ids == w and g.finish_reason in ("length", "stop"), i
    assert stats[1].finish_reason == "stop" and on.engine.ahead_steps > 0 and on.engine.running() == 0
