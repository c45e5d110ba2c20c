"""The request vocabulary: bounds hold against hostile values, and both wires round-trip every field."""

from __future__ import annotations

import math

import pytest

from services.convert import generate_request_from_pb, generate_request_to_pb, stats_from_pb, stats_to_pb
from services.gen import kvstash_pb2 as pb
from store.errors import InvalidInput
from workers.requests import (
    LIMITS,
    DecodeConfig,
    GenerateRequest,
    GenerationStats,
    PrefillRequest,
    RequestLimits,
    SamplingParams,
)

NAN, INF = math.nan, math.inf
HUGE = "x" * (LIMITS.query_max_chars + 1)


def _short_error(fn, **kw) -> str:
    with pytest.raises(InvalidInput) as e:
        fn(**kw)
    assert len(str(e.value)) < 160, "error messages never echo long input"
    return str(e.value)


@pytest.mark.parametrize("kw", [
    {"max_new_tokens": 0}, {"max_new_tokens": -1}, {"max_new_tokens": LIMITS.max_new_tokens_cap + 1},
    {"max_new_tokens": 2**63}, {"max_new_tokens": 10**5000}, {"max_new_tokens": 1.5}, {"max_new_tokens": True},
    {"max_new_tokens": "64"},
    {"temperature": NAN}, {"temperature": INF}, {"temperature": -INF}, {"temperature": -1e-9},
    {"temperature": LIMITS.temperature_max * 2}, {"temperature": 10**400}, {"temperature": "0.5"},
    {"top_p": NAN}, {"top_p": 0.0}, {"top_p": -0.1}, {"top_p": 1.0000001}, {"top_p": INF},
    {"seed": -1}, {"seed": 2**63}, {"seed": 2**64}, {"seed": 1.0},
    {"stop": ("",)}, {"stop": "\n"}, {"stop": ("x",) * (LIMITS.stop_max_count + 1)},
    {"stop": ("y" * (LIMITS.stop_max_chars + 1),)}, {"stop": (HUGE,)}, {"stop": (3,)},
])
def test_sampling_rejects_hostile_values(kw: dict) -> None:
    name = next(iter(kw))
    assert name.split("_")[0] in _short_error(SamplingParams, **kw)


@pytest.mark.parametrize("kw", [
    {"budget": NAN}, {"budget": INF}, {"budget": 0.0}, {"budget": -0.5}, {"budget": 1.5}, {"budget": True},
    {"budget": "0.1"}, {"gen_len": 0}, {"gen_len": -1}, {"gen_len": 2**31}, {"gen_len": 2.0},
    {"sink": -1}, {"tail": -1}, {"sink": LIMITS.anchor_max + 1}, {"tail": 2**63},
    {"budget_tokens": 0}, {"budget_tokens": -3}, {"budget_tokens": LIMITS.budget_tokens_max + 1},
    {"budget_tokens": 64.0}, {"budget_tokens": True},
    {"ratio": NAN}, {"ratio": 0.0}, {"ratio": -0.1}, {"ratio": 1.01}, {"ratio": True}, {"ratio": "0.3"},
    {"ratio": 1e-5},
])
def test_decode_rejects_hostile_values(kw: dict) -> None:
    assert next(iter(kw)) in _short_error(DecodeConfig, **kw)


def test_in_range_values_are_kept_and_normalized() -> None:
    s = SamplingParams(max_new_tokens=LIMITS.max_new_tokens_cap, temperature=1, top_p=1e-300, seed=LIMITS.seed_max,
                       stop=["a", "b"])
    assert s.temperature == 1.0 and isinstance(s.temperature, float) and s.stop == ("a", "b")
    assert SamplingParams(temperature=5e-324).temperature == 0.0  # a denormal temperature is greedy, not inf logits
    assert SamplingParams(temperature=LIMITS.temperature_floor).temperature == LIMITS.temperature_floor
    d = DecodeConfig(budget=1, gen_len=LIMITS.gen_len_max, sink=0, tail=LIMITS.anchor_max)
    assert d.budget == 1.0 and isinstance(d.budget, float)
    assert SamplingParams() == SamplingParams(max_new_tokens=LIMITS.max_new_tokens_default)
    assert DecodeConfig() == DecodeConfig(sink=LIMITS.sink_default, tail=LIMITS.tail_default, gen_len=1)


@pytest.mark.parametrize("kw", [
    {"query": HUGE}, {"query": None}, {"prefix_id": "p" * (LIMITS.prefix_id_max_chars + 1)},
    {"method": ""}, {"method": "m" * (LIMITS.method_max_chars + 1)}, {"raw": "yes"}, {"decode": {"budget": 0.1}},
])
def test_generate_request_rejects_hostile_values(kw: dict) -> None:
    _short_error(GenerateRequest, **{"prefix_id": "a" * 32, "query": "q", **kw})


def test_prefill_request_is_text_never_a_server_side_path() -> None:
    _short_error(PrefillRequest, document=b"bytes")
    req = PrefillRequest(document="text")
    assert PrefillRequest.from_json(req.to_json()) == req
    for body in ({}, {"document": None}, {"document": "d", "extra": 1}):
        _short_error(PrefillRequest.from_json, body=body)
    for body in ({"file_path": "/proc/self/environ"}, {"document": "d", "file_path": "/x"}):
        with pytest.raises(InvalidInput, match="file_path is not accepted"):
            PrefillRequest.from_json(body)


def _full_request() -> GenerateRequest:
    return GenerateRequest(prefix_id="a" * 32, query=" Who?", method="topk+phi", raw=True,
                           decode=DecodeConfig(budget=0.05, budget_tokens=96, ratio=0.3, gen_len=64),
                           sampling=SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, seed=2**63 - 1,
                                                   stop=("\n", "Q:")))


@pytest.mark.parametrize("req", [_full_request(), GenerateRequest(prefix_id="b" * 32, query="q")],
                         ids=["every-field", "defaults"])
def test_both_wires_round_trip_every_field(req: GenerateRequest) -> None:
    assert GenerateRequest.from_json(req.prefix_id, req.to_json()) == req
    assert generate_request_from_pb(generate_request_to_pb(req)) == req


def test_wire_defaults_and_errors() -> None:
    # Unset or zero protobuf fields and absent or null JSON fields mean the declared defaults.
    bare = GenerateRequest(prefix_id="c" * 32, query="q")
    assert generate_request_from_pb(pb.GenerateRequest(prefix_id="c" * 32, query="q")) == bare
    assert GenerateRequest.from_json("c" * 32, {"query": "q", "seed": None, "budget": None}) == bare
    _short_error(GenerateRequest.from_json, prefix_id="c" * 32, body={"query": "q", "temprature": 1})
    _short_error(GenerateRequest.from_json, prefix_id="c" * 32, body={"method": "full"})
    # The wires carry no sink/tail, so a request that sets them cannot be sent remotely by mistake.
    custom = GenerateRequest(prefix_id="c" * 32, query="q", decode=DecodeConfig(sink=0))
    _short_error(custom.to_json)
    _short_error(generate_request_to_pb, req=custom)
    for msg in (pb.GenerateRequest(prefix_id="c", query="q", temperature=NAN),
                pb.GenerateRequest(prefix_id="c", query="q", top_p=INF),
                pb.GenerateRequest(prefix_id="c", query="q", budget=NAN),
                pb.GenerateRequest(prefix_id="c", query="q", seed=-1),
                pb.GenerateRequest(prefix_id="c", query="q", gen_len=-1),
                pb.GenerateRequest(prefix_id="c", query="q", max_new_tokens=-5)):
        _short_error(generate_request_from_pb, msg=msg)


def test_stats_round_trip_on_both_wires() -> None:
    st = GenerationStats(steps=3, prompt_tokens=5, new_tokens=2, bytes_fetched=10, bytes_full=40, seconds=0.25,
                         finish_reason="eos", extra={"budget_k": 12.0, "offload_pages_requested": 4.0})
    for back in (GenerationStats.from_json(st.to_json()), stats_from_pb(stats_to_pb(st))):
        assert back == st
    held = GenerationStats()
    held.copy_from(st)
    assert held == st


def test_limits_are_consistent() -> None:
    with pytest.raises(ValueError):
        RequestLimits(max_new_tokens_default=100, max_new_tokens_cap=10)
    with pytest.raises(ValueError):
        RequestLimits(gen_len_max=2**31)
