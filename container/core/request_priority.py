"""A request's scheduling priority, in vLLM's meaning: a whole number, lower values served
first, 0 for a request that names none; requests of equal priority are served in the order
they came.

A request names one by LMI's ``X-Priority`` header (or ``x-priority=<n>`` in SageMaker's
``X-Amzn-SageMaker-Custom-Attributes``, which SageMaker's ``InvokeEndpoint`` passes on where it
passes on no header of the client's choosing: both become the ``x-priority`` property of the
request, as in LMI), or in its body: ``priority``
in an OpenAI body, ``parameters.priority`` in LMI's. The header wins over the body, as vLLM's
own ``X-Vllm-Priority`` header does on its server.

Priorities are honoured only with ``option.scheduling_policy=priority`` (vLLM's engine argument,
which also orders the built-in engine's queue); without it a request that names a priority
other than 0 is refused (400) rather than served first-come while it asked for more. vLLM's
OpenAI classes document the same refusal ("any priority other than 0 will raise an error if
the served model does not use priority scheduling"), though vLLM 0.32's engine ignores such a
priority instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from container.core.errors import InputError

HEADER = "X-Priority"  # LMI's request header
PROPERTY = HEADER.lower()  # the request property it becomes (a custom attribute too)
# The integers vLLM's requests carry (its OpenAI schema bounds `priority` so; msgpack carries int64)
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1
POLICY_OPTION = "option.scheduling_policy"


def header_priority(properties: Mapping[str, str]) -> int | None:
    """The priority the request's ``X-Priority`` property names (matched without regard to
    case), or None without one. Raises ``InputError`` naming the header for a value that is not
    a whole number within [``PRIORITY_MIN``, ``PRIORITY_MAX``]."""
    raw = next((value for key, value in properties.items() if key.lower() == PROPERTY), None)
    return None if raw is None else parse_priority(raw)


def parse_priority(raw: str) -> int:
    """The priority an ``X-Priority`` value names; ``InputError`` naming the header for one that is
    not a whole number within [``PRIORITY_MIN``, ``PRIORITY_MAX``]."""
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not digits.isascii() or not digits.isdigit() or len(digits) > 19:  # 19 digits hold every int64
        raise InputError(f"{HEADER}: {raw[:40]!r} is not a whole number (lower values are served first)")
    return checked(int(text), HEADER)


def checked(value: int, where: str) -> int:
    """``value`` if it is within [``PRIORITY_MIN``, ``PRIORITY_MAX``]; else ``InputError`` naming ``where``."""
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise InputError(f"{where}: {value} is out of range; a priority is within [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    return value


def refusal(priority: int | None, where: str, scheduled: bool) -> str | None:
    """Why a request naming ``priority`` (in ``where``) is refused, or None: a priority other than
    0 needs ``option.scheduling_policy=priority`` (``scheduled``)."""
    if not priority or scheduled:
        return None
    return (
        f"{where}={priority}: this server serves requests first-come ({POLICY_OPTION} is not priority); "
        f"start it with {POLICY_OPTION}=priority to order requests by priority, or send none"
    )


def check_allowed(priority: int | None, where: str, scheduled: bool) -> None:
    """``InputError`` with ``refusal``'s message when there is one."""
    message = refusal(priority, where, scheduled)
    if message is not None:
        raise InputError(message)
