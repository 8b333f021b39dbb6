"""A stateful LMI handler, written as for LMI's djl_python (in the manner of
djl-serving's own stateful test model): it keeps a counter per session with
``SessionManager``. Bodies: {"requestType": "NEW_SESSION"} opens a session
(answered in LMI's form: ``X-Amzn-SageMaker-Session-Id: <id>; Expires=<time>``),
{"requestType": "CLOSE"} closes the session named by the header, {"add": n}
adds n to the session's counter and answers it with the worker's pid."""

import os
from datetime import datetime, timezone

from djl_python import Input, Output, SessionManager

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
sessions = None


def handle(inputs: Input):
    global sessions
    if sessions is None:
        sessions = SessionManager(inputs.get_properties())
    if inputs.is_empty():
        return None
    body = inputs.get_as_json()
    session_id = inputs.get_property(SESSION_HEADER)
    out = Output()
    if body.get("requestType") == "NEW_SESSION":
        session = sessions.create_session()
        session.put("count", 0)
        expires = datetime.fromtimestamp(session.expiration_ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        out.add_property(SESSION_HEADER, f"{session.session_id}; Expires={expires}")
        return out.add_as_json({"result": f"Session {session.session_id} created"})
    if body.get("requestType") == "CLOSE":
        sessions.close_session(session_id)
        out.add_property("X-Amzn-SageMaker-Closed-Session-Id", session_id)
        return out.add_as_json({"result": f"Session {session_id} closed"})
    session = sessions.get_session(session_id)
    if session is None:
        return out.error("this request needs a session", code=400)
    count = session.get("count") + int(body["add"])
    session.put("count", count)
    return out.add_as_json({"count": count, "pid": os.getpid(), "session": session.session_id})
