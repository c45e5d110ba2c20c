"""Fair turns on one model: bounded admission, then one turn at a time, round-robin across tenants.

A generation is admitted once (per-tenant and global bounds; refusals are ``Overloaded`` with a
retry-after hint) and then asks for a turn before every decode step. The next turn goes to the
waiting tenant that has used the model least (its virtual time: seconds of turns) and, within a
tenant, to its longest-waiting generation (FIFO). Tenants thus share the model's time equally
whatever their number of generations or the cost of their steps (a long context makes a step
dearer): with equal steps, turns alternate. A tenant that was away comes back at most
``idle_credit_s`` behind the running tenants: a light, intermittent tenant gets that much
priority, a long absence banks no more.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from store.errors import Cancelled, Overloaded


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Bounds of a worker's admission."""

    max_per_tenant: int = 4
    """Generations and prefills one tenant may have admitted at once."""
    max_active: int = 16
    """Generations and prefills admitted at once, all tenants together (the bounded queue)."""
    retry_after_s: int = 1
    """Seconds a refused caller is told to wait before retrying."""
    idle_credit_s: float = 0.25
    """Most model seconds a returning tenant may be behind the running ones (it had that little while away)."""
    hand_back_s: float = 0.002
    """How long a freed model waits for the tenant that just used it to ask for its next step, when that
    tenant is still owed time, before another tenant gets it (between two steps a generation hands its
    output on; without the wait, every gap would go to a heavier tenant). Bounded idle: a generation
    that does not come back (ended, or stuck sending to a slow client) loses its claim."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_per_tenant <= self.max_active:
            raise ValueError("need 1 <= max_per_tenant <= max_active")
        if self.retry_after_s < 1:
            raise ValueError("retry_after_s must be >= 1")
        if not 0 <= self.idle_credit_s <= 60:
            raise ValueError("idle_credit_s must be in [0, 60]")
        if not 0 <= self.hand_back_s <= 0.1:
            raise ValueError("hand_back_s must be in [0, 0.1]")


@dataclass(eq=False)
class Ticket:
    """One admitted generation (or prefill): what it waits on for its turns."""

    tenant: str
    cancelled: bool = False
    _wake: threading.Event = field(default_factory=threading.Event)
    """Set when the ticket is given the model, is cancelled, or should look again (a claim may lapse)."""

    def cancel(self) -> None:
        """Stop waiting: the next (or current) wait for a turn raises ``Cancelled``."""
        self.cancelled = True
        self._wake.set()


class FairScheduler:
    """Admits work within bounds and hands the model to one ticket at a time, fairly across tenants."""

    def __init__(self, config: SchedulerConfig | None = None):
        self.config = config or SchedulerConfig()
        self._lock = threading.Lock()
        self._admitted: Counter[str] = Counter()
        self._waiting: dict[str, deque[Ticket]] = {}
        """Tickets waiting for a turn, per tenant in arrival order."""
        self._used: dict[str, float] = {}
        """Model seconds each admitted tenant has had (its virtual time)."""
        self._away: dict[str, float] = {}
        """Virtual time of tenants with nothing admitted, while it is within ``idle_credit_s`` of the clock."""
        self._clock = 0.0
        """The least virtual time of the running tenants (never goes back)."""
        self._holder: Ticket | None = None
        self._since = 0.0
        """When the holder's turn began."""
        self._services: dict[str, Ticket] = {}
        """The one ticket of each service name (its turns come one at a time)."""
        self._claim: Ticket | None = None
        self._claim_until = 0.0
        """A ticket that just ended a turn while owed time, and until when the model waits for it."""

    @contextlib.contextmanager
    def admit(self, tenant: str) -> Iterator[Ticket]:
        """A ticket for one generation; ``Overloaded`` when the tenant or the worker is at its bound."""
        cfg = self.config
        with self._lock:
            if self._admitted[tenant] >= cfg.max_per_tenant:
                raise Overloaded(f"this tenant already has {cfg.max_per_tenant} generations running; retry later",
                                 cfg.retry_after_s)
            if sum(self._admitted.values()) >= cfg.max_active:
                raise Overloaded(f"the worker is at its limit of {cfg.max_active} generations; retry later",
                                 cfg.retry_after_s)
            if tenant not in self._used:
                self._come_back(tenant)
            self._admitted[tenant] += 1
        ticket = Ticket(tenant)
        try:
            yield ticket
        finally:
            with self._lock:
                self._leave(ticket)
                self._admitted[tenant] -= 1
                if not self._admitted[tenant]:
                    del self._admitted[tenant]
                    self._away[tenant] = self._used.pop(tenant)

    @contextlib.contextmanager
    def service_turn(self, name: str) -> Iterator[None]:
        """One turn for work done for every tenant at once (a batched decode step), scheduled like a
        tenant's turn under the name ``name`` but outside the admission bounds."""
        with self._lock:
            ticket = self._services.get(name)
            if ticket is None:
                ticket = self._services[name] = Ticket(name)
            if name not in self._used:
                self._come_back(name)
        try:
            with self.turn(ticket):
                yield
        finally:
            with self._lock:  # between its turns the service is away, like a tenant with nothing admitted
                if not self._admitted.get(name) and name in self._used and name not in self._waiting:
                    self._away[name] = self._used.pop(name)

    @contextlib.contextmanager
    def turn(self, ticket: Ticket) -> Iterator[None]:
        """Hold the model for one step; waits for this ticket's turn (``Cancelled`` if cancelled meanwhile)."""
        with self._lock:
            if ticket.cancelled:
                raise Cancelled("the call was cancelled")
            self._waiting.setdefault(ticket.tenant, deque()).append(ticket)
            self._dispatch()
        self._wait(ticket)
        if ticket.cancelled:
            with self._lock:
                self._leave(ticket)
            raise Cancelled("the call was cancelled")
        try:
            yield
        finally:
            with self._lock:
                self._release()
                if self._owed(ticket.tenant):
                    self._claim, self._claim_until = ticket, time.perf_counter() + self.config.hand_back_s
                self._dispatch()

    def _wait(self, ticket: Ticket) -> None:
        """Until ``ticket`` holds the model or is cancelled; woken early to end a claim that lapses."""
        timeout: float | None = None
        while True:
            ticket._wake.wait(timeout)
            with self._lock:
                if self._holder is not ticket:
                    self._dispatch()  # a claim may have lapsed
                ticket._wake.clear()  # also a poke of our own dispatch's: we are looking already
                if ticket.cancelled or self._holder is ticket:  # cancel() sets the flag before the event
                    return
                timeout = max(0.0, self._claim_until - time.perf_counter()) if self._claim is not None else None

    def _come_back(self, tenant: str) -> None:
        """Place a tenant that had nothing admitted at most ``idle_credit_s`` behind the clock (lock held)."""
        if self._used:
            self._clock = max(self._clock, min(self._used.values()))
        floor = self._clock - self.config.idle_credit_s
        self._used[tenant] = max(self._away.pop(tenant, floor), floor)
        for t in [t for t, v in self._away.items() if v <= floor]:  # as good as new: forget
            del self._away[t]

    def _owed(self, tenant: str) -> bool:
        """Whether ``tenant`` has used the model no more than any tenant waiting for it (lock held)."""
        return self.config.hand_back_s > 0 and all(self._used[tenant] <= self._used[t] for t in self._waiting)

    def _release(self) -> None:
        """End the holder's turn, charging its tenant (lock held)."""
        if self._holder is not None:
            self._used[self._holder.tenant] += time.perf_counter() - self._since
            self._holder._wake.clear()
            self._holder = None

    def _leave(self, ticket: Ticket) -> None:
        """Take a ticket out of the model and the queues for good (lock held)."""
        if self._claim is ticket:
            self._claim = None
        if self._holder is ticket:
            self._release()
        elif ticket in self._waiting.get(ticket.tenant, ()):
            queue = self._waiting[ticket.tenant]
            queue.remove(ticket)
            if not queue:
                del self._waiting[ticket.tenant]
        self._dispatch()

    def _dispatch(self) -> None:
        """Give a free model to the oldest ticket of the waiting tenant that used it least (lock held)."""
        if self._holder is not None or not self._waiting:
            return
        claim, self._claim = self._claim, None
        lapsed = time.perf_counter() >= self._claim_until
        tenant = min(self._waiting, key=self._used.__getitem__)  # ties: the tenant waiting longest
        queue = self._waiting[tenant]
        if claim is not None and claim not in self._waiting.get(claim.tenant, ()) and not lapsed:
            self._claim = claim  # keep the model for it a moment longer ...
            queue[0]._wake.set()  # ... and have the next in line end the claim if it lapses
            return
        self._holder = queue.popleft()
        if not queue:
            del self._waiting[tenant]
        self._since = time.perf_counter()
        self._holder._wake.set()

    def snapshot(self) -> dict[str, int]:
        """Admitted tickets per tenant (for tests and metrics)."""
        with self._lock:
            return dict(self._admitted)
