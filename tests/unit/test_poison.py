"""container/frontend/poison.py: which requests are refused after group deaths."""

import pytest

from container.core.ingress import fingerprint
from container.frontend import poison
from container.core.errors import RequestStoppedEngine
from container.frontend.poison import PoisonRequests

A = fingerprint("/invocations?", b'{"inputs": "a"}')
B = fingerprint("/invocations?", b'{"inputs": "b"}')


def test_the_fingerprint_depends_on_route_and_body():
    assert A != B != fingerprint("/v1/completions?", b'{"inputs": "a"}')
    assert A == fingerprint("/invocations?", b'{"inputs": "a"}')


def test_a_request_in_flight_at_two_deaths_is_refused_and_bystanders_are_not():
    p = PoisonRequests()
    p.group_died("0", [(A, "r1", "/invocations"), (A, "r2", "/invocations"), (B, "r3", "/invocations")], now=0)
    p.check(A, now=1)  # copies at one death count once
    p.group_died("0", [(A, "r4", "/invocations")], now=10)
    with pytest.raises(RequestStoppedEngine) as refused:
        p.check(A, now=11)
    assert refused.value.status == 422 and "twice" in refused.value.detail
    p.check(B, now=11)
    p.check(A, now=10 + poison.REFUSE_FOR + 1)  # refused for a while, not for ever


def test_deaths_further_apart_than_the_window_do_not_add_up():
    p = PoisonRequests()
    p.group_died("0", [(A, "r1", "/invocations")], now=0)
    p.group_died("0", [(A, "r2", "/invocations")], now=poison.WINDOW + 1)
    p.check(A, now=poison.WINDOW + 2)


def test_what_is_remembered_is_bounded(monkeypatch):
    monkeypatch.setattr(poison, "MAX_REMEMBERED", 3)
    p = PoisonRequests()
    prints = [fingerprint("/invocations?", str(i).encode()) for i in range(10)]
    p.group_died("0", [(f, "r", "/invocations") for f in prints], now=0)
    assert len(p._deaths) == 3
