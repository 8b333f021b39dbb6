"""SageMaker's stateful sessions on the built-in vLLM engine (tests/e2e/conftest.py's
shared server: option.enable_stateful_sessions is on by default, as in LMI's vLLM
handler): {"requestType": "NEW_SESSION"} opens a session, requests naming it are
served, {"requestType": "CLOSE"} closes it, and it is refused from then on."""

import re
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import requests

from tests.readme import shell_commands
from tests.server import REPO

pytestmark = pytest.mark.slow

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_VALUE = re.compile(r"([0-9a-f-]{36}); Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")
DEFAULT_SESSIONS = Path("/dev/shm/djl_sessions")  # LMI's default option.sessions_path


def test_the_engine_opens_serves_and_closes_a_session(vllm_server):
    created = vllm_server.invoke({"requestType": "NEW_SESSION"}, headers={SESSION: "NEW_SESSION"})
    assert created.status_code == 200, created.text
    match = NEW_SESSION_VALUE.fullmatch(created.headers["X-Amzn-SageMaker-New-Session-Id"])
    assert match, created.headers
    session_id, expires = match.groups()
    assert created.json() == {"result": f"Session {session_id} created"}
    lives = datetime.strptime(expires, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp() - time.time()
    assert 1200 - 60 < lives <= 1200
    assert (DEFAULT_SESSIONS / session_id).is_dir()

    lmi = vllm_server.invoke({"inputs": "Hello", "parameters": {"max_new_tokens": 4}}, headers={SESSION: session_id})
    assert lmi.status_code == 200 and lmi.json()["generated_text"], lmi.text
    chat = requests.post(vllm_server.url("/v1/chat/completions"), headers={SESSION: session_id}, timeout=60,
                         json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] is not None, chat.text
    assert lmi.headers["X-Sagelmi-Group"] == chat.headers["X-Sagelmi-Group"] == created.headers["X-Sagelmi-Group"]

    closed = vllm_server.invoke({"requestType": "CLOSE"}, headers={SESSION: session_id})
    assert closed.status_code == 200, closed.text
    assert closed.headers["X-Amzn-SageMaker-Closed-Session-Id"] == session_id
    assert closed.json() == {"result": f"Session {session_id} closed"}
    assert not (DEFAULT_SESSIONS / session_id).exists()

    again = vllm_server.invoke({"inputs": "Hello", "parameters": {"max_new_tokens": 4}}, headers={SESSION: session_id})
    assert again.status_code == 400 and f"session {session_id} was closed" in again.json()["error"], again.text
    chat = requests.post(vllm_server.url("/v1/chat/completions"), headers={SESSION: session_id}, timeout=60,
                         json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 400 and session_id in chat.json()["error"]["message"], chat.text


def test_bad_session_requests_are_refused(vllm_server):
    bogus = vllm_server.invoke({"requestType": "OPEN"})
    assert bogus.status_code == 400 and "requestType must be NEW_SESSION or CLOSE" in bogus.json()["error"], bogus.text
    nameless = vllm_server.invoke({"requestType": "CLOSE"})
    assert nameless.status_code == 400 and SESSION in nameless.json()["error"], nameless.text


def test_the_documented_command_opens_a_session(vllm_server):
    (command,) = shell_commands((REPO / "docs" / "sessions.md").read_text())
    command = command.replace("localhost:8080", f"127.0.0.1:{vllm_server.port}")
    out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "HTTP/1.1 200" in out.stdout, out.stdout + out.stderr
    assert re.search(r"(?im)^X-Amzn-SageMaker-New-Session-Id: " + NEW_SESSION_VALUE.pattern, out.stdout), out.stdout
