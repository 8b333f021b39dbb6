"""A handler whose every request leaves a process behind: a shell starts `sleep`
in the background and exits, so the sleep is orphaned. Answers with the sleep's pid
and the worker's, for the test of what a killed group leaves (nothing)."""

import os
import subprocess

from djl_python import Input, Output


def handle(inputs: Input):
    if inputs.is_empty():
        return None
    started = subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True)
    return Output().add_as_json({"orphan": int(started.stdout), "worker": os.getpid()})
