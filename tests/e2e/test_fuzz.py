"""Fuzzing every route of a real server from its own ``GET /openapi.json`` (schemathesis):
the built-in vLLM engine on the tiny model, and an LMI ``model.py``.

Each route gets a bounded number of generated requests, valid and invalid. Every answer
must be in its documented shape (status, content type, JSON schema), no answer may be a
5xx other than the documented 503/504 causes, and afterwards ``/ping`` is 200, the engine
holds no request and the log has no traceback. The figures go to docs/reliability.md.
"""

from __future__ import annotations

import collections
import json
import os
import re
import threading
import time
import traceback

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode, checks

from tests.reliability import record
from tests.server import MODEL_DIRS, Server, wait_idle

pytestmark = pytest.mark.slow

# Generated requests per operation and mode. Derandomized: every run sends the same ones, so a deeper
# run is a local one (SAGELMI_FUZZ_EXAMPLES=100); CI's 15 keep it at about 3 minutes of its 60.
EXAMPLES = int(os.environ.get("SAGELMI_FUZZ_EXAMPLES", "15"))
REQUEST_TIMEOUT = 120
# The 503 and 504 a healthy server may give one client (container/frontend/openapi.py's table): a full
# queue, shutting down, predict_timeout. A worker group that stopped (an engine a request
# crashed) or that is not ready is a failure here.
DOCUMENTED_5XX = {503: ("request queue is full", "shutting down"), 504: ("predict_timeout",)}
LOCAL_PATH = re.compile(r'"/(tmp|home|root|opt|var|usr|work)/')  # a local path as a JSON string
CHECKS = [checks.status_code_conformance, checks.content_type_conformance, checks.response_schema_conformance]


class Tally:
    """What the fuzzing sent and got, for the figures (schemathesis runs cases in this thread)."""

    def __init__(self, builtin: bool) -> None:
        self.builtin = builtin
        self.lock = threading.Lock()
        self.statuses: collections.Counter[int] = collections.Counter()
        self.operations: collections.Counter[str] = collections.Counter()
        self.unexpected: list[str] = []
        self.slowest = 0.0
        self.started: float | None = None  # the first request
        self.without_invalid: list[str] = []  # operations no invalid request can be made for

    def add(self, case, response, seconds: float) -> None:
        with self.lock:
            self.started = self.started or time.monotonic() - seconds
            self.statuses[response.status_code] += 1
            self.operations[f"{case.method} {case.path}"] += 1
            self.slowest = max(self.slowest, seconds)


def _text(response) -> str:
    """The answer's body as text, whatever it is: the vectors of ``encoding_format`` bytes are not UTF-8."""
    return response.content.decode("utf-8", errors="replace")


def _documented_5xx(status: int, text: str) -> bool:
    causes = DOCUMENTED_5XX.get(status)
    return causes is not None and any(cause in text.lower() for cause in causes)


def fuzz(case, tally: Tally) -> None:
    started = time.monotonic()
    response = case.call(timeout=REQUEST_TIMEOUT)
    tally.add(case, response, time.monotonic() - started)
    text = _text(response)
    if response.status_code >= 500 and not _documented_5xx(response.status_code, text):
        tally.unexpected.append(f"{case.method} {case.path} -> {response.status_code}: {text[:300]}")
        raise AssertionError(f"{response.status_code} for {case.method} {case.path} with body "
                             f"{str(case.body)[:500]!r}: {text[:500]}")
    # The Responses API echoes fields of the request (tools, instructions ...); hypothesis draws strings from the
    # constants of the code it runs in, "Traceback" among them: what the request itself holds proves nothing
    sent = json.dumps(case.body, default=repr) if case.body is not None else ""
    if "Traceback" not in sent:
        assert "Traceback" not in text, text[:500]
    mine = tally.builtin or response.status_code >= 400  # a model.py's own answers are its business
    if mine and not LOCAL_PATH.search(sent):
        assert not LOCAL_PATH.search(text), text[:500]
    case.validate_response(response, checks=CHECKS)


def _check_after(server: Server, tally: Tally, name: str, title: str) -> None:
    ping = requests.get(server.url("/ping"), timeout=60)
    assert ping.status_code == 200, ping.text
    assert [w["in_flight"] for w in ping.json()["workers"]] == [0] * len(ping.json()["workers"])
    idle = time.monotonic()
    wait_idle(server, timeout=120)
    idle_seconds = time.monotonic() - idle
    if tally.builtin:  # a model.py that raises gets its traceback logged, for its author
        assert "Traceback" not in server.log()
    assert not tally.unexpected, tally.unexpected
    total = sum(tally.statuses.values())
    record(name, title, {
        "operations fuzzed": len(tally.operations),
        "operations with no invalid request possible": len(tally.without_invalid),
        "requests": total,
        "answers by status": ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items())),
        "undocumented 5xx": 0,
        "answers not in their documented shape": 0,
        "slowest answer": f"{tally.slowest:.1f} s",
        "whole run": f"{time.monotonic() - tally.started:.0f} s",
        "engine idle after the run": f"{idle_seconds:.1f} s",
        "/ping after the run": ping.status_code,
    }, note=f"schemathesis {schemathesis.__version__}: up to {EXAMPLES} valid and {EXAMPLES} invalid requests "
            "per operation (derandomized, so every run sends the same ones); checks: status code, content type and response schema conformance, "
            "no 5xx but a full queue, shutting down or predict_timeout, no traceback or local path in any answer. "
            "schemathesis leaves out the route it reads the schema from (/openapi.json).")


def run_fuzzing(server: Server, tally: Tally, paths: tuple[str, ...] | None = None) -> list[str]:
    """Fuzz every operation of ``server``'s /openapi.json (those on ``paths`` if given), with valid
    and invalid requests; returns the failures (an operation stops at its first). schemathesis's
    pytest plugin does not run on pytest 9, so its strategies are driven by hypothesis here."""
    schema = schemathesis.openapi.from_url(server.url("/openapi.json"))
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if paths is not None and operation.path not in paths:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @SETTINGS
            @given(case=operation.as_strategy(generation_mode=mode))
            def one(case):
                fuzz(case, tally)

            try:
                one()
            except Unsatisfiable as exc:
                if mode is GenerationMode.POSITIVE:  # every operation must get valid requests
                    failures.append(f"{operation.label}: no valid request could be generated: {exc}")
                else:  # nothing of it can be made invalid (no body, any string in the path): noted
                    tally.without_invalid.append(operation.label)
            except Exception as exc:  # noqa: BLE001 - every failure is reported with its operation
                where = "".join(traceback.format_tb(exc.__traceback__)[-3:])  # the line that raised
                failures.append(f"{operation.label} ({mode.value}): {type(exc).__name__}: {str(exc)[:1500]}\n{where}")
    return failures


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def test_fuzzing_the_builtin_engine(vllm_server):
    tally = Tally(builtin=True)
    failures = run_fuzzing(vllm_server, tally)
    assert not failures, "\n".join(failures)
    _check_after(vllm_server, tally, "fuzz-builtin", "Fuzzing the built-in engine")


def test_fuzzing_a_custom_handler():
    tally = Tally(builtin=False)
    with Server(MODEL_DIRS / "lmi_echo", env={"OPTION_SYNC_HANDLER_THREADS": "4"}) as server:
        failures = run_fuzzing(server, tally)
        assert not failures, "\n".join(failures)
        _check_after(server, tally, "fuzz-custom-handler", "Fuzzing a custom handler")
