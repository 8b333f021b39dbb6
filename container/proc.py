"""Process hygiene shared by sagelmi's child processes."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

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


# The autogroup nice of a worker group's session (see lower_session_priority).
WORKER_SESSION_NICE = 5


def lower_session_priority(session: int) -> None:
    """Give the processes of ``session`` (a worker group: its engine and ranks) a
    lower share of the CPU than other sessions' when both want it. Where Linux
    groups CPU time by session (autogroup, on by default in many kernels), each
    session is one contender: a CPU-bound engine, whose processes busy-wait on
    each other, then kept the frontend's session off the CPU for seconds at a
    time on 2 cores (``/metrics`` answered in 5-27 s, a departed client noticed
    after 6-14 s; 0.2 s at nice 5). The frontend needs little CPU, but at once;
    when nothing else wants the CPU the engine gets all of it as before."""
    try:
        with open(f"/proc/{session}/autogroup", "w") as f:
            f.write(str(WORKER_SESSION_NICE))
    except OSError:  # a kernel without autogroup, or the session is gone: nothing to adjust
        pass


def session_members(session: int) -> list[int]:
    """PIDs of the live processes in ``session`` (a child started with
    ``start_new_session=True`` leads the session numbered by its pid). MPI ranks
    and engine processes each lead their own process group, but all stay in the
    session of the process that started them."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the command (which may hold spaces) start at the last ')'.
        fields = stat[stat.rindex(b")") + 2:].split()
        state, sid = fields[0], int(fields[3])
        if sid == session and state != b"Z":
            members.append(int(entry))
    return members


def signal_session(session: int, sig: int) -> int:
    """Send ``sig`` to every process of ``session``; returns how many there were."""
    pids = session_members(session)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return len(pids)


def exec_dying_with_parent(argv: list[str]) -> None:
    """Become ``argv`` (``execvp``), set to get SIGTERM when the parent dies: the
    setting outlives exec. ``mpirun`` is started this way, since it has no such
    tie of its own and a killed supervisor would leave it and its ranks running."""
    die_with_parent(signal.SIGTERM)
    os.execvp(argv[0], argv)


if __name__ == "__main__":  # python -m container.proc COMMAND ...
    exec_dying_with_parent(sys.argv[1:])
