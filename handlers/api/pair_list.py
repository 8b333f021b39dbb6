"""LMI's ``PairList``: the ordered ``(key, value)`` pairs an ``Input``'s content and properties
are made of (``handlers.api.io``)."""

from __future__ import annotations

from typing import Any


class PairList:
    """An ordered list of ``(key, value)`` pairs; keys may repeat.

    ``keys`` and ``values`` are the two parallel lists (public, as in LMI)."""

    def __init__(
        self,
        keys: list | None = None,
        values: list | None = None,
        pair_list: list | None = None,
        pair_map: dict | None = None,
    ) -> None:
        self.keys: list
        self.values: list
        if keys and values:
            if len(keys) != len(values):
                raise ValueError("key value size mismatch.")
            self.keys, self.values = keys, values
            return
        self.keys = []
        self.values = []
        if pair_list:
            for pair in pair_list:
                self.keys.append(pair[0])
                self.values.append(pair[1])
        elif pair_map:
            self.add_all(pair_map)

    def add(self, key: Any = None, value: Any = None, index: int | None = None, pair: tuple | None = None) -> None:
        """Append ``(key, value)`` (at ``index`` if given), or ``pair``. As in LMI,
        a ``None`` value is not added (``pair`` may carry one)."""
        if index is not None and value is not None:
            self.keys.insert(index, key)
            self.values.insert(index, value)
        elif pair:
            self.keys.append(pair[0])
            self.values.append(pair[1])
        elif value is not None:
            self.keys.append(key)
            self.values.append(value)

    def add_all(self, other: dict | PairList | None) -> None:
        """Append every pair of a dict or of another ``PairList``."""
        if not other:
            return
        if isinstance(other, PairList):
            self.keys.extend(other.keys)
            self.values.extend(other.values)
        else:
            self.keys.extend(other.keys())
            self.values.extend(other.values())

    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def is_empty(self) -> bool:
        return not self.keys

    def get(self, key):
        """The value of the first pair with ``key``, else ``None``."""
        try:
            return self.values[self.keys.index(key)]
        except ValueError:
            return None

    def key_at(self, index: int):
        return self.keys[index]

    def value_at(self, index: int):
        return self.values[index]

    def get_keys(self) -> list:
        return self.keys

    def get_values(self) -> list:
        return self.values


# -- LMI's socket framing (big-endian), used by ``Input.read`` and ``Output.send``
