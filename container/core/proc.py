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


_PR_SET_CHILD_SUBREAPER = 36

# Popen arguments that start a child in a process group of its own, in sagelmi's
# session: a terminal's Ctrl-C reaches the supervisor alone, which stops the rest in
# order. Not a session of its own: where Linux shares CPU time between sessions
# (autogroup), each session is one contender, and a CPU-bound engine's session kept
# the frontend's off the CPU for seconds on 2 cores (see docs/architecture.md).
NEW_PROCESS_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def adopt_orphans() -> None:
    """Become the parent of this process's orphaned descendants, instead of init
    (``PR_SET_CHILD_SUBREAPER``; kept across exec): whatever a worker group starts
    stays below the group's first process while it lives, and below the supervisor
    after, so that ``descendants`` finds all of it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux/glibc
        return
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)


_PR_SET_DUMPABLE = 4


def keep_private() -> None:
    """Make this process non-dumpable (``PR_SET_DUMPABLE`` 0): other processes of the same user
    that lack ``CAP_SYS_PTRACE`` (in a container, by default, every one) can no longer read its
    ``/proc/PID/environ`` nor its memory. Its children are dumpable again once they exec. No core
    dumps of this process either."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux/glibc
        return
    libc.prctl(_PR_SET_DUMPABLE, 0)


def _stat(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command (state, parent pid ...); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Fields after the command (which may hold spaces) start at the last ')'.
    return stat[stat.rindex(b")") + 2 :].split()


def process_table() -> dict[int, tuple[int, bool]]:
    """pid -> (parent pid, whether it is a zombie) of every process."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(entry)) is not None:
            found[int(entry)] = (int(fields[1]), fields[0] == b"Z")
    return found


def parents(zombies: bool = False, table: dict[int, tuple[int, bool]] | None = None) -> dict[int, int]:
    """pid -> parent pid of every live process (and of zombies too, if asked), from
    ``table`` (``process_table()`` when not given)."""
    table = process_table() if table is None else table
    return {pid: parent for pid, (parent, zombie) in table.items() if zombies or not zombie}


def running(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is no zombie (one that ended and waits for its parent)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != b"Z"


def titled(pids: list[int], prefix: str) -> dict[int, str]:
    """pid -> title of those of ``pids`` whose command line starts with ``prefix`` (a process that
    set its title, as vLLM's do)."""
    found = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(prefix):
            found[pid] = title
    return found


def descendants(roots: list[int], table: dict[int, int] | None = None) -> list[int]:
    """The live processes below ``roots`` (``parents()`` when ``table`` is not given)."""
    table = parents() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, parent in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


# The nice value of the processes a handler starts (the engine's) while the worker is busy:
# below the worker's and the frontend's 0, so that the request path, which needs little CPU but
# at once, is not kept waiting by an engine that busy-waits between its steps; an engine with the
# CPU to itself still gets all of it. When is in container/worker/priority.py.
ENGINE_NICE = 10


def set_nice(pids: list[int], nice: int) -> None:
    """Give every thread of ``pids`` the nice value ``nice``.

    Linux keeps a nice value per thread, and a new thread takes its creator's, so each existing
    thread is set; the threads they start later inherit it. Processes and threads that ended
    meanwhile are skipped. Raises ``PermissionError`` when a thread would get a higher priority
    than it has and this process may not give it (no ``CAP_SYS_NICE``)."""
    for pid in pids:
        try:
            tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # gone, or no /proc
            continue
        for tid in tids:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
            except ProcessLookupError:  # the thread ended meanwhile
                continue


def exec_dying_with_parent(argv: list[str]) -> None:
    """Become ``argv`` (``execvp``), set to get SIGTERM when the parent dies: the
    setting outlives exec. ``mpirun`` is started this way, since it has no such
    tie of its own and a killed supervisor would leave it and its ranks running;
    it adopts its group's orphans too (``adopt_orphans``)."""
    die_with_parent(signal.SIGTERM)
    adopt_orphans()
    os.execvp(argv[0], argv)


if __name__ == "__main__":  # python -m container.core.proc COMMAND ...
    exec_dying_with_parent(sys.argv[1:])
