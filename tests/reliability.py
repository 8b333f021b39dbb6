"""Figures for docs/reliability.md, written by the tests that measure them.

Each scenario owns one block of the document, between ``<!-- scenario: NAME -->`` and
``<!-- /scenario: NAME -->``; ``record`` rewrites that block (or appends it) with a
table of what the test measured, when, and at which commit. The text around the
blocks is written by hand. A test records only after its assertions passed, so the
document never shows figures from a failed run.

A test run writes its figures into ``build/reliability.md`` (a copy of the page made at the
run's first ``record``; ``start_run`` removes the last run's), never into the tracked page:
a run leaves the tree as it found it. ``make reliability-report`` runs the tests that record
(marked ``reliability``) and copies the result over ``docs/reliability.md``, for a commit of
its own.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import platform
import re
import subprocess

from tests.server import REPO

PAGE = REPO / "docs" / "reliability.md"
DOCUMENT = REPO / "build" / "reliability.md"  # what this run measured; make reliability-report publishes it


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return out.stdout.strip() or "unknown"


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def block(name: str, title: str, figures: dict[str, object], note: str = "") -> str:
    """The Markdown of one scenario: a heading, a table of ``figures``, then ``note``."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    test = os.environ.get("PYTEST_CURRENT_TEST", name).rsplit(" (", 1)[0]
    lines = [f"<!-- scenario: {name} -->", f"### {title}", "",
             f"Measured by `{test}` on {when}, commit {_commit()}, {_cores()} cores ({platform.machine()}).", "",
             "| measure | value |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in figures.items()]
    if note:
        lines += ["", note]
    lines.append(f"<!-- /scenario: {name} -->")
    return "\n".join(lines)


def record(name: str, title: str, figures: dict[str, object], note: str = "", merge: bool = False) -> None:
    """Put this scenario's figures into build/reliability.md (several test processes may write).
    ``merge``: keep the block's other rows (the cases of a parametrized test each add theirs)."""
    _start_document()
    pattern = re.compile(rf"<!-- scenario: {re.escape(name)} -->.*?<!-- /scenario: {re.escape(name)} -->", re.S)
    with open(DOCUMENT, "r+", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        current = handle.read()
        if merge:
            figures = {**_rows(pattern.search(current).group(0) if pattern.search(current) else ""), **figures}
        text = block(name, title, figures, note)
        updated = pattern.sub(lambda _: text, current) if pattern.search(current) else \
            current.rstrip("\n") + "\n\n" + text + "\n"
        handle.seek(0)
        handle.write(updated)
        handle.truncate()


def start_run() -> None:
    """Forget the figures of an earlier run (the test session starts with this)."""
    DOCUMENT.unlink(missing_ok=True)


def _start_document() -> None:
    """Make build/reliability.md from the page once, so that blocks no test of this run wrote keep their figures."""
    DOCUMENT.parent.mkdir(exist_ok=True)
    try:
        with open(DOCUMENT, "x", encoding="utf-8") as created:
            created.write(PAGE.read_text(encoding="utf-8"))
    except FileExistsError:
        pass


def _rows(text: str) -> dict[str, str]:
    rows = re.findall(r"^\| (.+?) \| (.+?) \|$", text, re.M)
    return {key: value for key, value in rows if key != "measure" and not set(key) <= {"-"}}
