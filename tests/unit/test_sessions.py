"""Stateful sessions without processes: the header forms (container/core/sessions.py),
LMI's SessionManager (handlers/api/sessions.py, djl_python.session_manager) and the
frontend's sticky routes (container/frontend/sessions.py) over small fake groups."""

import math
import time

import pytest
from prometheus_client import REGISTRY

from container.core.errors import InputError, ServiceUnavailable, TooManySessions, describe
from container.core.protocol import WorkerState
from container.core.sessions import (
    ExpiryIndex,
    expires_text,
    new_session_value,
    parse_new_session,
    valid_session_id,
)
from container.core.settings import SettingsError
from container.core.settings import resolve_settings
from container.frontend.sessions import SessionRoutes
from djl_python.session_manager import SessionManager
from handlers.api import Input
from handlers.engines.sessions import EngineSessions

ID = "3f6c0f4e-8a8e-4d3b-9a57-1d5b2f9e0c11"


class FakeGroup:
    """What SessionRoutes reads of a GroupClient."""

    def __init__(self, name: str, incarnation: int = 1) -> None:
        self.name = name
        self.incarnation = incarnation
        self.state = WorkerState.READY


def test_new_session_value_round_trips_in_sagemakers_form():
    value = new_session_value(ID, 1_800_000_000)
    assert value == f"{ID}; Expires=2027-01-15T08:00:00Z"
    assert parse_new_session(value) == (ID, 1_800_000_000)
    assert parse_new_session(ID) == (ID, None)
    assert parse_new_session(f"{ID}; Expires=tomorrow") == (ID, None)
    assert valid_session_id(ID) and not valid_session_id("a/b") and not valid_session_id("-a") and not valid_session_id(
        "a" * 257
    )


def test_session_manager_keeps_values_until_closed(tmp_path):
    manager = SessionManager({"sessions_path": str(tmp_path), "sessions_expiration": "60"})
    session = manager.create_session()
    assert 59 < session.expiration_ts - time.time() <= 60
    session.put("state", {"turns": 2})
    array = session.get_as_numpy("kv", shape=(2, 3), create=True)
    array[:] = 7
    again = manager.get_session(session.session_id)
    assert again.get("state") == {"turns": 2} and again.get_as_numpy("kv", shape=(2, 3)).sum() == 42
    assert manager.get_session("NEW_SESSION") is None and manager.get_session("") is None
    # a manager started later (a restarted worker) takes up what is on disk, as LMI's does
    assert SessionManager({"sessions_path": str(tmp_path)}).get_session(session.session_id).get("state") == {"turns": 2}
    manager.close_session(session.session_id)
    assert not (tmp_path / session.session_id).exists()
    with pytest.raises(ValueError, match="session not found"):
        manager.get_session(session.session_id)
    with pytest.raises(ValueError, match="session not found"):
        manager.close_session(session.session_id)
    with pytest.raises(ValueError, match="invalid session key"):
        manager.create_session().put("..", 1)


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_session_manager_removes_expired_sessions_without_traffic(tmp_path):
    manager = SessionManager({"sessions_path": str(tmp_path), "sessions_expiration": "1"})
    sessions = [manager.create_session() for _ in range(3)]
    assert all((tmp_path / s.session_id).is_dir() for s in sessions)
    # nothing calls the manager from here: its sweeper removes the files when they expire
    assert wait_for(lambda: not any(tmp_path.iterdir()), timeout=5), list(tmp_path.iterdir())
    assert manager.get_session(sessions[0].session_id) is None  # LMI's answer for an expired session
    moved = manager.create_session()
    moved.expiration_ts = time.time() - 1  # an expiry moved earlier by the handler: expired at once
    assert manager.get_session(moved.session_id) is None


def test_session_manager_refuses_sessions_past_max_sessions(tmp_path):
    manager = SessionManager({"sessions_path": str(tmp_path), "max_sessions": "2"})
    first, _ = manager.create_session(), manager.create_session()
    refused_before = REGISTRY.get_sample_value("sagelmi_sessions_refused_total")
    with pytest.raises(TooManySessions) as refused:
        manager.create_session()
    assert describe(refused.value)[0] == 429
    assert "2 stateful sessions are open" in str(refused.value) and "option.max_sessions=2" in str(refused.value)
    assert REGISTRY.get_sample_value("sagelmi_sessions_refused_total") == refused_before + 1
    assert len(list(tmp_path.iterdir())) == 2  # the refusal wrote nothing
    manager.close_session(first.session_id)
    manager.create_session()  # a closed session makes room
    # sessions a manager takes up from disk (another group's, or its own before a restart) are not its own
    SessionManager({"sessions_path": str(tmp_path), "max_sessions": "2"}).create_session()


def test_session_manager_frees_room_as_sessions_expire(tmp_path):
    manager = SessionManager({"sessions_path": str(tmp_path), "sessions_expiration": "1", "max_sessions": "1"})
    manager.create_session()
    with pytest.raises(TooManySessions):
        manager.create_session()
    time.sleep(1.1)
    assert manager.create_session().session_id


def test_expiry_index_takes_due_entries_in_order_and_stays_small_under_churn():
    index = ExpiryIndex()
    for n, expires_at in enumerate([5.0, 1.0, 3.0, math.inf]):
        index.put(f"s{n}", expires_at, n)
    index.put("s2", 6.0, 2)  # moved later: its old place is stale
    assert index.pop("s0") == 0 and index.pop("s0") is None
    assert index.next_expiry() == 1.0
    assert index.take_due(5.5) == [("s1", 1)]
    assert index.take_due(10.0) == [("s2", 2)]
    assert len(index) == 1 and "s3" in index and index.next_expiry() == math.inf
    for n in range(10_000):  # sessions opened and closed long before they expire
        index.put(f"c{n}", 1e12 + n, n)
        index.pop(f"c{n}")
    assert len(index._heap) <= 2 * len(index) + ExpiryIndex.COMPACT_SLACK


def test_routes_forget_expired_sessions_when_one_opens():
    routes, group = routes_with_session(time.time() + 0.2)
    time.sleep(0.3)
    routes.observe("NEW_SESSION", group, 1, 200, {"X-Amzn-SageMaker-New-Session-Id": "other"})
    assert routes.open_count == 1
    with pytest.raises(InputError, match=f"session {ID} expired at"):
        routes.route(ID)


def test_session_settings_from_lmi_and_vllm_sagemaker_names(tmp_path):
    defaults = resolve_settings({}, str(tmp_path))
    assert (defaults.enable_stateful_sessions, defaults.sessions_path, defaults.sessions_expiration) == (True, None, 1200)
    env = {"OPTION_ENABLE_STATEFUL_SESSIONS": "false", "SAGEMAKER_SESSIONS_EXPIRATION": "30"}
    settings = resolve_settings(env, str(tmp_path))
    assert (settings.enable_stateful_sessions, settings.sessions_expiration) == (False, 30)
    assert (defaults.max_sessions, resolve_settings({"OPTION_MAX_SESSIONS": "5"}, str(tmp_path)).max_sessions) == (
        1000,
        5,
    )
    with pytest.raises(SettingsError, match="option.max_sessions='0'"):
        resolve_settings({"OPTION_MAX_SESSIONS": "0"}, str(tmp_path))


def routes_with_session(expires_at: float | None = None) -> tuple[SessionRoutes, FakeGroup]:
    routes, group = SessionRoutes(enabled=True, expiration=600), FakeGroup("1")
    value = new_session_value(ID, expires_at) if expires_at else ID
    headers = routes.observe("NEW_SESSION", group, group.incarnation, 200, {"X-Amzn-SageMaker-New-Session-Id": value})
    assert headers["X-Amzn-SageMaker-New-Session-Id"] == value
    return routes, group


def test_a_session_goes_to_the_group_that_opened_it():
    routes, group = routes_with_session(time.time() + 60)
    assert routes.route(ID) is group
    assert routes.route(None) is None and routes.route("NEW_SESSION") is None


def test_lmi_and_djl_answer_forms_are_learned_and_given_sagemakers_headers():
    routes, group = SessionRoutes(enabled=True, expiration=600), FakeGroup("0")
    headers = routes.observe(None, group, 1, 200, {"x-amzn-sagemaker-session-id": ID})  # DJL's example: no expiry
    opened, expires = parse_new_session(headers["X-Amzn-SageMaker-New-Session-Id"])
    assert opened == ID and 598 < expires - time.time() <= 600  # the option's expiration
    assert routes.route(ID) is group
    headers = routes.observe(ID, group, 1, 200, {"X-Amzn-SageMaker-Session-Closed": "true"})  # DJL's close
    assert headers["X-Amzn-SageMaker-Closed-Session-Id"] == ID
    with pytest.raises(InputError, match=f"session {ID} was closed"):
        routes.route(ID)


def test_an_echoed_session_header_or_a_failed_answer_opens_nothing():
    routes, group = SessionRoutes(enabled=True, expiration=600), FakeGroup("0")
    routes.observe(ID, group, 1, 200, {"X-Amzn-SageMaker-Session-Id": ID})
    routes.observe(None, group, 1, 424, {"X-Amzn-SageMaker-New-Session-Id": ID})
    assert routes.open_count == 0


def test_refusals_name_the_session_and_why():
    routes, group = routes_with_session(time.time() + 60)
    with pytest.raises(InputError, match="session 0b1e is not open on this server"):
        routes.route("0b1e")
    with pytest.raises(InputError, match="is not a session id"):
        routes.route("../etc")
    group.state = WorkerState.LOADING  # same incarnation, not ready: retry later
    with pytest.raises(ServiceUnavailable, match=f"worker group 1, which holds session {ID}, is loading"):
        routes.route(ID)
    group.state, group.incarnation = WorkerState.READY, 2  # the group restarted
    for _ in range(2):
        with pytest.raises(InputError, match=f"session {ID} was held by worker group 1, which stopped since"):
            routes.route(ID)
    routes, group = routes_with_session(time.time() + 60)
    group.state = WorkerState.DOWN  # killed, not back yet
    with pytest.raises(InputError, match="which stopped since"):
        routes.route(ID)


def test_an_expired_session_is_refused():
    routes, _ = routes_with_session(time.time() - 1)
    with pytest.raises(InputError, match=f"session {ID} expired at {expires_text(time.time() - 1)[:13]}"):
        routes.route(ID)


def test_disabled_sessions_refuse_the_header():
    routes = SessionRoutes(enabled=False, expiration=600)
    assert routes.route(None) is None
    with pytest.raises(InputError, match="option.enable_stateful_sessions=false"):
        routes.route("NEW_SESSION")
    assert routes.observe(None, FakeGroup("0"), 1, 200, {"X-Amzn-SageMaker-New-Session-Id": ID}) == {
        "X-Amzn-SageMaker-New-Session-Id": ID
    }
    assert routes.open_count == 0


def engine_sessions(tmp_path, **env) -> EngineSessions:
    return EngineSessions(resolve_settings({"OPTION_SESSIONS_PATH": str(tmp_path / "s"), **env}, str(tmp_path)))


def named(session_id: str) -> Input:
    return Input({"x-amzn-sagemaker-session-id": session_id}, b"{}")


def test_the_built_in_engine_opens_checks_and_closes_sessions(tmp_path):
    sessions = engine_sessions(tmp_path, OPTION_SESSIONS_EXPIRATION="90")
    opened = sessions.answer(Input({}, b"{}"), {"requestType": "NEW_SESSION"})
    session_id, expires = parse_new_session(opened.get_property("X-Amzn-SageMaker-New-Session-Id"))
    assert 88 < expires - time.time() <= 90 and (tmp_path / "s" / session_id).is_dir()
    sessions.check(session_id)
    closed = sessions.answer(named(session_id), {"requestType": "CLOSE"})
    assert closed.get_property("X-Amzn-SageMaker-Closed-Session-Id") == session_id
    with pytest.raises(InputError, match=f"session {session_id} is not open on this server"):
        sessions.check(session_id)
    with pytest.raises(InputError, match="is not open on this server"):
        sessions.answer(named(session_id), {"requestType": "CLOSE"})
    late = sessions.manager.create_session()
    late.expiration_ts = time.time() - 1
    with pytest.raises(InputError, match=f"session {late.session_id} has expired"):
        sessions.check(late.session_id)


def test_the_built_in_engine_caps_open_sessions(tmp_path):
    sessions = engine_sessions(tmp_path, OPTION_MAX_SESSIONS="1")
    opened = sessions.answer(Input({}, b"{}"), {"requestType": "NEW_SESSION"})
    with pytest.raises(TooManySessions, match="option.max_sessions=1"):
        sessions.answer(Input({}, b"{}"), {"requestType": "NEW_SESSION"})
    session_id, _ = parse_new_session(opened.get_property("X-Amzn-SageMaker-New-Session-Id"))
    sessions.answer(named(session_id), {"requestType": "CLOSE"})
    sessions.answer(Input({}, b"{}"), {"requestType": "NEW_SESSION"})


def test_the_built_in_engine_without_sessions_refuses_them(tmp_path):
    sessions = engine_sessions(tmp_path, OPTION_ENABLE_STATEFUL_SESSIONS="false")
    with pytest.raises(InputError, match="option.enable_stateful_sessions=false"):
        sessions.check(ID)
    with pytest.raises(InputError, match="option.enable_stateful_sessions=false"):
        sessions.answer(Input({}, b"{}"), {"requestType": "NEW_SESSION"})
    assert not (tmp_path / "s").exists()
