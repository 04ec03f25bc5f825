"""The routing rule both runtimes share (vlamux/services/routing.py), over a transport of plain
futures: which replica a request goes to, and when it is sent again."""

import threading
import time
from concurrent.futures import Future

import pytest

from vlamux.errors import UnknownTenantError
from vlamux.services.routing import Router


class Gone(Exception):
    """The transport's "that replica went away"."""


class Replicas:
    """Replicas answering from a script: name -> list of outcomes (an exception or a result), one per call."""

    def __init__(self, script: dict[str, list], known=("a",), load=None):
        self.script, self.known, self.load = script, set(known), load or {}
        self.sent: list[str] = []
        self.later_delays: list[float] = []

    def candidates(self, tenant, avoid):
        names = [n for n in self.script if n not in avoid] or list(self.script)
        return sorted(names, key=lambda n: self.load.get(n, 0))

    def send(self, name, tenant, obs, deterministic, deadline_s, explore=None):
        self.sent.append(name)
        outcome = self.script[name].pop(0) if self.script[name] else {"actions": name}
        f = Future()
        if isinstance(outcome, BaseException):
            f.set_exception(outcome)
        else:
            f.set_result(outcome)
        return f

    def later(self, fn, delay_s):
        self.later_delays.append(delay_s)
        threading.Timer(delay_s, fn).start()

    def router(self, **kw):
        return Router(self.candidates, self.send, (Gone,), lambda t: t in self.known,
                      lambda t: UnknownTenantError(f"no replica for {t!r}"), self.later, **kw)


def test_a_request_goes_to_the_least_loaded_replica():
    r = Replicas({"r0": [], "r1": []}, load={"r0": 3, "r1": 1})
    assert r.router().predict("a", None).result(5) == {"actions": "r1"}
    assert r.sent == ["r1"]


def test_a_replica_that_went_away_is_replaced_by_another_at_once():
    r = Replicas({"r0": [Gone()], "r1": []})
    assert r.router().predict("a", None).result(5) == {"actions": "r1"}
    assert r.sent == ["r0", "r1"] and r.later_delays == [0.0]


def test_a_known_tenant_a_restarted_replica_does_not_know_yet_is_sent_again_until_it_does():
    r = Replicas({"r0": [UnknownTenantError("restoring"), UnknownTenantError("restoring")]})
    out = r.router(retry_s=0.01).predict("a", None).result(5)
    assert out == {"actions": "r0"} and r.sent == ["r0"] * 3 and r.later_delays == [0.01, 0.01]


def test_an_unknown_tenant_is_answered_at_once():
    r = Replicas({"r0": [UnknownTenantError("who?")]}, known=())
    with pytest.raises(UnknownTenantError, match="who"):
        r.router().predict("b", None).result(5)
    assert r.sent == ["r0"] and r.later_delays == []


def test_retries_stop_at_the_time_limit():
    r = Replicas({"r0": [Gone()] * 1000})
    t0 = time.monotonic()
    with pytest.raises(Gone):
        r.router(tries=2, give_up_s=0.2, retry_s=0.02).predict("a", None).result(5)
    assert time.monotonic() - t0 < 2.0 and len(r.sent) >= 3


def test_no_replica_is_the_transports_own_error():
    r = Replicas({})
    with pytest.raises(UnknownTenantError, match="no replica"):
        r.router().predict("b", None).result(5)  # a tenant the runtime does not know: at once
    with pytest.raises(UnknownTenantError, match="no replica"):
        r.router(give_up_s=0.1, retry_s=0.02).predict("a", None).result(5)  # one it knows: at the time limit


def test_a_known_tenant_no_replica_serves_yet_is_sent_once_one_does():
    """Its policy is published but not delivered yet (the weight lane is behind under load): the request
    waits for a replica that serves it instead of failing."""
    r = Replicas({})
    out = r.router(retry_s=0.01).predict("a", None)
    time.sleep(0.05)
    assert not out.done()
    r.script["r0"] = []  # delivered
    assert out.result(5) == {"actions": "r0"} and r.sent == ["r0"]


def test_other_errors_are_the_answer():
    r = Replicas({"r0": [ValueError("bad observation")], "r1": []})
    with pytest.raises(ValueError, match="bad observation"):
        r.router().predict("a", None).result(5)
    assert r.sent == ["r0"]
