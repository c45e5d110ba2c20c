"""The worker's fair scheduler: bounded admission, round-robin turns across tenants, cancellation."""

from __future__ import annotations

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


def test_turns_alternate_between_tenants_whatever_their_load() -> None:
    s = FairScheduler(SchedulerConfig(max_per_tenant=8, max_active=16))
    order: list[str] = []

    def run(ticket: Ticket, name: str, steps: int) -> None:
        for _ in range(steps):
            with s.turn(ticket):
                order.append(name)
                time.sleep(STEP_S)

    with s.admit("gate") as gate:
        tickets = [(s.admit("a").__enter__(), f"a{i}", 6) for i in range(4)] + [(s.admit("b").__enter__(), "b", 6)]
        with s.turn(gate):  # hold the model until every generation is queued
            threads = []
            for n, (ticket, name, steps) in enumerate(tickets, 1):
                threads.append(threading.Thread(target=run, args=(ticket, name, steps)))
                threads[-1].start()
                _wait_until(lambda n=n: _queued(s) == n)
        for t in threads:
            t.join(10)
    b_turns = [i for i, name in enumerate(order) if name == "b"]
    assert len(order) == 30 and len(b_turns) == 6
    # Tenant a has four generations, b one: b still gets every other turn while it is waiting.
    assert b_turns == [1, 3, 5, 7, 9, 11], order
    # Within tenant a, its generations take turns first come, first served.
    assert order[:8:2] == ["a0", "a1", "a2", "a3"]


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
