"""A handler that ends its own process, for the crash-loop and poison-request tests.

{"exit": code} ends the process with that code while answering (a request that kills the
engine); anything else is echoed with the process id. With OPTION_DIE_AFTER_SECONDS set, the
process ends (exit code 9) that long after loading, in its first OPTION_DIE_STARTS starts
(counted in the file OPTION_START_COUNT_FILE): a group that dies soon after every start.
"""

import os
import threading
import time
from pathlib import Path

from djl_python import Input, Output

_started = False


def _die_later(seconds: float) -> None:
    time.sleep(seconds)
    os._exit(9)


def _on_load(properties: dict) -> None:
    seconds = properties.get("die_after_seconds")
    if not seconds:
        return
    counter = Path(properties["start_count_file"])
    starts = int(counter.read_text()) + 1 if counter.exists() else 1
    tmp = counter.with_suffix(".tmp")
    tmp.write_text(str(starts))
    tmp.replace(counter)  # the test reads it meanwhile: never an empty file
    if starts <= int(properties.get("die_starts", "1000000")):
        threading.Thread(target=_die_later, args=(float(seconds),), daemon=True).start()


def handle(inputs: Input) -> Output | None:
    global _started
    if not _started:
        _started = True
        _on_load(inputs.get_properties())
    if inputs.is_empty():
        return None
    body = inputs.get_as_json()
    if "exit" in body:
        time.sleep(0.2)
        os._exit(int(body["exit"]))
    return Output().add_as_json({"echo": body, "pid": os.getpid()})
