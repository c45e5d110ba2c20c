"""Fair turns on one model: bounded admission, then one turn at a time, round-robin across tenants.

A generation is admitted once (per-tenant and global bounds; refusals are ``Overloaded`` with a
retry-after hint) and then asks for a turn before every decode step. The next turn goes to the
waiting tenant served least recently (round-robin) and, within a tenant, to its longest-waiting
generation (FIFO), so a tenant with many long generations gets one step in each round, like every
other waiting tenant, and cannot starve them.
"""

from __future__ import annotations

import contextlib
import threading
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

    def __post_init__(self) -> None:
        if not 1 <= self.max_per_tenant <= self.max_active:
            raise ValueError("need 1 <= max_per_tenant <= max_active")
        if self.retry_after_s < 1:
            raise ValueError("retry_after_s must be >= 1")


@dataclass(eq=False)
class Ticket:
    """One admitted generation (or prefill): what it waits on for its turns."""

    tenant: str
    cancelled: bool = False
    _wake: threading.Event = field(default_factory=threading.Event)

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
        self._served: dict[str, int] = {}
        """When each admitted tenant last got a turn (a turn counter)."""
        self._turns = 0
        self._holder: Ticket | None = None

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
            self._admitted[tenant] += 1
        ticket = Ticket(tenant)
        try:
            yield ticket
        finally:
            with self._lock:
                self._admitted[tenant] -= 1
                if not self._admitted[tenant]:
                    del self._admitted[tenant]
                    self._served.pop(tenant, None)

    @contextlib.contextmanager
    def turn(self, ticket: Ticket) -> Iterator[None]:
        """Hold the model for one step; waits for this ticket's turn (``Cancelled`` if cancelled meanwhile)."""
        self._wait_turn(ticket)
        try:
            yield
        finally:
            with self._lock:
                self._holder = None
                self._dispatch()

    def _wait_turn(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.cancelled:
                raise Cancelled("the call was cancelled")
            ticket._wake.clear()
            self._waiting.setdefault(ticket.tenant, deque()).append(ticket)
            self._dispatch()
        ticket._wake.wait()
        if ticket.cancelled:
            with self._lock:
                if self._holder is ticket:
                    self._holder = None
                    self._dispatch()
                else:
                    self._drop(ticket)
            raise Cancelled("the call was cancelled")

    def _dispatch(self) -> None:
        """Give a free model to the oldest ticket of the waiting tenant served least recently (lock held)."""
        if self._holder is not None or not self._waiting:
            return
        tenant = min(self._waiting, key=lambda t: self._served.get(t, -1))  # ties: first to arrive
        queue = self._waiting[tenant]
        self._holder = queue.popleft()
        if not queue:
            del self._waiting[tenant]
        self._turns += 1
        self._served[tenant] = self._turns
        self._holder._wake.set()

    def _drop(self, ticket: Ticket) -> None:
        """Take a cancelled ticket out of its tenant's queue (lock held)."""
        queue = self._waiting.get(ticket.tenant)
        if queue is not None and ticket in queue:
            queue.remove(ticket)
            if not queue:
                del self._waiting[ticket.tenant]

    def snapshot(self) -> dict[str, int]:
        """Admitted tickets per tenant (for tests and metrics)."""
        with self._lock:
            return dict(self._admitted)
