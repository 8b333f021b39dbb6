"""A handler written the way LMI's examples write them (djl_python's API as
LMI documents it): it must run unchanged. The route is chosen by the query
parameter ``op`` (a content entry, as DJL Serving passes query parameters)."""

import logging
import os

import numpy as np

from djl_python import Input, Output
from djl_python.encode_decode import decode, encode
from djl_python.session_manager import SessionManager

log = logging.getLogger(__name__)
properties = None
sessions = None


def _finalized(path):
    with open(path, "w") as f:
        f.write("finalized")


def handle(inputs: Input):
    global properties, sessions
    if properties is None:
        properties = dict(inputs.get_properties())
        device = "cpu" if properties.get("device_id") == "-1" else "cuda:" + properties.get("device_id")
        log.info("initialising on %s", device)
        sessions = SessionManager({"sessions_path": os.path.join(properties["model_dir"], ".sessions")
                                   if os.access(properties["model_dir"], os.W_OK) else "/tmp/lmi_compat_sessions"})
    if inputs.is_empty():
        return None

    op = inputs.get_as_string(key="op") if inputs.contains_key("op") else "echo"
    if op == "properties":
        return Output().add_as_json({"init": properties, "request": {
            k: v for k, v in inputs.get_properties().items() if isinstance(v, (str, int))}})
    if op == "form":
        return Output().add_as_json({"prompt": inputs.get_as_string(key="prompt"),
                                     "data_size": len(inputs.get_as_bytes(key="data")),
                                     "keys": inputs.get_content().get_keys()})
    if op == "numpy":
        arrays = inputs.get_as_numpy()
        return Output().add_as_numpy([a * 2 for a in arrays]).add_property("Content-Type", "tensor/ndlist")
    if op == "npz":
        arrays = inputs.get_as_npz()
        return Output().add_as_json({"shapes": [list(a.shape) for a in arrays],
                                     "sums": [a.sum() for a in arrays]})
    if op == "image":
        image = inputs.get_as_image()
        return Output().add_as_json({"size": image.size, "mode": image.mode})
    if op == "csv":
        return Output().add_as_json({"rows": inputs.get_as_csv(), "decoded": decode(inputs, "text/csv")})
    if op == "decode":
        payload = decode(inputs, inputs.get_property("Content-Type"))
        prediction = np.asarray(payload["inputs"], dtype=np.float32) + 1
        outputs = Output()
        encode(outputs, [prediction], inputs.get_property("Accept"))
        return outputs
    if op == "data":
        return Output().add_as_json({"data": repr(type(inputs.get_data()).__name__)})
    if op == "none":
        return None
    if op == "not_output":
        return {"plain": "dict"}
    if op == "finalize":
        return Output().add("done").finalize(_finalized, inputs.get_as_string(key="path"))
    if op == "stream":
        words = inputs.get_as_json()["inputs"].split()
        return Output().add_stream_content(iter(words))
    if op == "session":
        session = sessions.get_session(inputs.get_property("X-Session-Id") or "") or sessions.create_session()
        count = session.get("count", 0) + 1
        session.put("count", count)
        return Output().add_as_json({"session": session.session_id, "count": count})
    if op == "open":
        with open(inputs.get_as_string(key="path")) as f:
            return Output().add(f.read())
    return Output().add_as_json({"echo": inputs.get_as_json()})
