"""``sagelmi engine-args [--write]``: the list of the installed vLLM's engine arguments
(``container/core/vllm_engine_args.json``) that the core checks option names against without vLLM."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

from container.core.engine_args import SIMPLE_KINDS
from handlers.engines.vllm_args import engine_fields


def _value_kind(tp: Any) -> str | list:
    """A simple kind for an engine argument's annotation: ``bool``, ``int``,
    ``float``, ``str``, ``json`` (a dict, list or set), the allowed values of a
    ``Literal``, or ``any`` (unions, classes, unresolved names: not checked)."""
    origin = typing.get_origin(tp)
    members = [a for a in typing.get_args(tp) if a is not type(None)] if origin in (Union, types.UnionType) else [tp]
    literals = [m for m in members if typing.get_origin(m) is Literal]
    others = [m for m in members if typing.get_origin(m) is not Literal]
    if literals and not others:
        return list(dict.fromkeys(v for m in literals for v in typing.get_args(m)))
    if literals and others == [str]:
        return "str"
    if len(others) != 1:
        return "any"
    (member,) = others
    if member in SIMPLE_KINDS:
        return SIMPLE_KINDS[member]
    return "json" if (typing.get_origin(member) or member) in (dict, list, set) else "any"


def engine_arg_list() -> dict[str, Any]:
    """What ``vllm_engine_args.json`` holds, built from the installed vLLM
    (imports it): its version and each public ``AsyncEngineArgs`` field's kind."""
    import vllm

    args = {name: _value_kind(f.type) for name, f in sorted(engine_fields().items()) if not name.startswith("_")}
    return {"vllm_version": vllm.__version__, "engine_args": args}
