"""Where a tenant's action request goes, and what happens when its replica goes away: one rule for
both runtimes, over their transports (a replica in this process, or a Ray actor).

A request goes to the least loaded replica that can serve the tenant (none being restarted, if any
other can). If that replica goes away before answering (its queue closed, its actor died), the
request goes to another one at once, up to `tries` replicas; after that, when a replica answers that
it does not know a tenant the runtime does know (restarted, not restored yet), and when no replica
serves a tenant the runtime knows yet (its policy published, not delivered), it is sent again every
`retry_s` until `give_up_s` after it was made. Anything else is the request's answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from vlamux.errors import UnknownTenantError


@dataclass(frozen=True)
class _Attempt:
    tenant: str
    obs: object
    deterministic: bool
    deadline_s: float | None
    explore: object  # a FlowExploration, or None
    tries: int  # replicas it may still be sent to at once, when one goes away
    avoid: frozenset  # replicas it was sent to
    give_up_at: float


class Router:
    def __init__(self, candidates: Callable[[str, frozenset], list[str]], send: Callable[..., Future],
                 gone: tuple[type[BaseException], ...], known: Callable[[str], bool],
                 no_replica: Callable[[str], BaseException], later: Callable[[Callable[[], None], float], None],
                 tries: int = 3, give_up_s: float = 60.0, retry_s: float = 0.2):
        """candidates(tenant, avoid): replica names, best first; send(name, tenant, obs, deterministic,
        deadline_s, explore): a future of the replica's answer (it may also raise); gone: the errors that say a
        replica went away; known(tenant): whether the runtime has a policy for it; no_replica(tenant):
        the error when no replica is there; later(fn, delay_s): run `fn` off the caller's thread (a
        transport's callbacks must not block)."""
        self.candidates, self.send, self.gone, self.known = candidates, send, gone, known
        self.no_replica, self.later = no_replica, later
        self.tries, self.give_up_s, self.retry_s = tries, give_up_s, retry_s

    def predict(self, tenant: str, obs, deterministic: bool = False, deadline_s: float | None = None,
                explore=None) -> Future:
        out: Future = Future()
        self._route(out, _Attempt(tenant, obs, deterministic, deadline_s, explore, self.tries, frozenset(),
                                  time.monotonic() + self.give_up_s))
        return out

    def _route(self, out: Future, a: _Attempt) -> None:
        names = self.candidates(a.tenant, a.avoid)
        if not names:
            if self.known(a.tenant) and time.monotonic() < a.give_up_at:
                # published, not delivered to a replica yet (the weight lane is behind under load), or
                # every replica restarting: a moment later
                self._again(out, a, self.retry_s)
            else:
                out.set_exception(self.no_replica(a.tenant))
            return
        name = names[0]
        try:
            inner = self.send(name, a.tenant, a.obs, a.deterministic, a.deadline_s, a.explore)
        except Exception as e:  # noqa: BLE001 - decided below, as an answer's error is
            self._failed(out, a, name, e)
            return
        inner.add_done_callback(lambda f: self._failed(out, a, name, f.exception()) if f.exception() is not None
                                else out.set_result(f.result()))

    def _failed(self, out: Future, a: _Attempt, name: str, e: BaseException) -> None:
        again = replace(a, tries=a.tries - 1, avoid=a.avoid | {name})
        went = isinstance(e, self.gone)
        if went and a.tries > 1:  # its replica went away: another one, now
            self._again(out, again, 0.0)
        elif (went or isinstance(e, UnknownTenantError) and self.known(a.tenant)) and time.monotonic() < a.give_up_at:
            # a replica being restarted, or restarted and still being restored: another one, or this one
            # a moment later (bounded by time, not by a count: a restart takes seconds)
            self._again(out, again, self.retry_s)
        else:
            out.set_exception(e)

    def _again(self, out: Future, a: _Attempt, delay_s: float) -> None:
        try:
            self.later(lambda: self._route(out, a), delay_s)
        except RuntimeError as e:  # the runtime is stopping
            if not out.done():
                out.set_exception(e)
