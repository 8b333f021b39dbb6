"""Process hygiene shared by sagelmi's child processes."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies, so a
    killed supervisor never leaves model workers holding accelerators."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux/glibc: nothing to arrange
        return
    parent = os.getppid()
    libc.prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)
