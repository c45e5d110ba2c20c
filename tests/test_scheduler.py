"""The worker's fair scheduler: bounded admission, round-robin turns across tenants, cancellation."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from services.scheduler import FairScheduler, SchedulerConfig, Ticket
from store.errors import Cancelled, Overloaded

STEP_S = 0.01


def _wait_until(cond, timeout: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _queued(s: FairScheduler) -> int:
    return sum(len(q) for q in s._waiting.values())


def test_admission_bounds_per_tenant_and_in_all() -> None:
    s = FairScheduler(SchedulerConfig(max_per_tenant=2, max_active=3, retry_after_s=7))
    with s.admit("a"), s.admit("a"):
        with pytest.raises(Overloaded) as e:
            s.admit("a").__enter__()
        assert e.value.retry_after_s == 7 and e.value.http_status == 429
        with s.admit("b"), pytest.raises(Overloaded):  # the global bound, though b has room of its own
            s.admit("c").__enter__()
        assert s.snapshot() == {"a": 2}
    assert s.snapshot() == {}
    with s.admit("a"), s.admit("a"):  # released tickets free their places
        pass


def _run_queued(s: FairScheduler, plan: list[tuple[str, str, int, float]]) -> list[tuple[str, float]]:
    """Queue generations (tenant, name, steps, seconds per step) while the model is held, then let them run.

    Returns the turns in the order they were taken: (name, seconds).
    """
    order: list[tuple[str, float]] = []

    def run(ticket: Ticket, name: str, steps: int, step_s: float) -> None:
        for _ in range(steps):
            with s.turn(ticket):
                order.append((name, step_s))
                time.sleep(step_s)

    with s.admit("gate") as gate, contextlib.ExitStack() as admitted:
        tickets = [admitted.enter_context(s.admit(tenant)) for tenant, *_ in plan]
        with s.turn(gate):  # hold the model until every generation is queued
            threads = []
            for n, (ticket, (_, name, steps, step_s)) in enumerate(zip(tickets, plan), 1):
                threads.append(threading.Thread(target=run, args=(ticket, name, steps, step_s)))
                threads[-1].start()
                _wait_until(lambda n=n: _queued(s) == n)
        for t in threads:
            t.join(30)
    return order


def test_turns_alternate_between_tenants_whatever_their_number_of_generations() -> None:
    s = FairScheduler(SchedulerConfig(max_per_tenant=8, max_active=16))
    order = _run_queued(s, [("a", f"a{i}", 6, STEP_S) for i in range(4)] + [("b", "b", 6, STEP_S)])
    names = [name for name, _ in order]
    b_turns = [i for i, name in enumerate(names) if name == "b"]
    assert len(names) == 30 and len(b_turns) == 6
    # Tenant a has four generations, b one: b still gets about every other turn while it waits
    # (equal steps: which of two tenants level on model time goes first depends on the clock).
    assert b_turns[-1] <= 13 and max(b - a for a, b in zip([-1, *b_turns], b_turns)) <= 3, names
    # Within tenant a, its generations take turns first come, first served.
    assert [n for n in names if n != "b"][:4] == ["a0", "a1", "a2", "a3"]


def test_tenants_share_model_time_when_their_steps_cost_differently() -> None:
    # a's steps (a long context) cost 4x b's: b gets about four turns for each of a's.
    s = FairScheduler(SchedulerConfig(max_per_tenant=8, max_active=16))
    order = _run_queued(s, [("a", "a0", 12, 4 * STEP_S), ("a", "a1", 12, 4 * STEP_S), ("b", "b", 24, STEP_S)])
    last_b = max(i for i, (name, _) in enumerate(order) if name == "b")
    a_time = sum(t for name, t in order[:last_b] if name != "b")
    b_time = sum(t for name, t in order if name == "b")
    # Counting turns instead of time, a would have had 24 turns (0.96 s) by the time b finished.
    assert a_time <= b_time + 2 * 4 * STEP_S, [name for name, _ in order]


def test_a_cancelled_waiter_leaves_the_queue_and_the_holder_is_not_stuck() -> None:
    s = FairScheduler()
    errors: list[BaseException] = []
    with s.admit("a") as holder, s.admit("b") as waiter:
        with s.turn(holder):
            def wait() -> None:
                try:
                    with s.turn(waiter):
                        pass
                except Cancelled as e:
                    errors.append(e)
            t = threading.Thread(target=wait)
            t.start()
            _wait_until(lambda: _queued(s) == 1)
            waiter.cancel()
            t.join(5)
            assert not t.is_alive() and len(errors) == 1 and _queued(s) == 0
        with s.turn(holder):  # the model is free again
            pass
        with pytest.raises(Cancelled):  # a cancelled ticket gets no more turns
            s.turn(waiter).__enter__()


def test_a_returning_tenant_comes_back_at_most_idle_credit_behind() -> None:
    s = FairScheduler(SchedulerConfig(idle_credit_s=0.02))
    with s.admit("a") as a:
        for _ in range(5):
            with s.turn(a):
                time.sleep(STEP_S)
        with s.admit("b"):  # b never ran: it starts 20 ms of model time behind a, not 50
            assert s._used["a"] - s._used["b"] == pytest.approx(0.02)
        with s.admit("b"), s.admit("b"):  # back at once: no fresh credit, its own place
            assert s._used["a"] - s._used["b"] == pytest.approx(0.02)


def test_a_claim_on_the_freed_model_lapses_when_its_tenant_does_not_come_back() -> None:
    s = FairScheduler(SchedulerConfig(hand_back_s=0.05))
    with s.admit("a") as a, s.admit("b") as b:
        with s.turn(b):
            time.sleep(STEP_S)
        with s.turn(a):  # a is owed time: the model waits for it a moment after this turn
            pass
        t0 = time.perf_counter()
        with s.turn(b):  # a never asks again (say it is stuck sending to a slow client)
            waited = time.perf_counter() - t0
        assert 0.03 < waited < 0.5
        with s.turn(a):  # owed and back within the claim: no wait
            pass
        t0 = time.perf_counter()
        with s.turn(a):
            assert time.perf_counter() - t0 < 0.03
