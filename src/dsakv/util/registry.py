"""One generic registry: name -> object (a class, a factory, a codec), filled by a decorator or a call.

BACKENDS: Registry[type[TransferBackend]] = Registry("transfer backend", flag="--transfer-backend")

@BACKENDS.register("mooncake")
class MooncakeBackend(TransferBackend): ...

BACKENDS.get("nixl")   # ConfigError naming the value, the flag and the choices when unknown

`unknown` rewords that error (fields: what, name, flag, choices), e.g. "host layout {name!r} is unknown: use one
of {choices}". `names()` is the ordered tuple of names (argparse choices, a public FORMATS tuple).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from dsakv.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """An ordered name -> entry map with one error text for unknown names."""

    def __init__(self, what: str, flag: str | None = None, unknown: str | None = None) -> None:
        self.what = what
        self.flag = flag
        self.unknown = unknown
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: add the decorated object under `name` (refuses a second entry of the same name)."""

        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        if not name:
            raise ValueError(f"{self.what}: empty name")
        if name in self._entries and self._entries[name] is not obj:
            raise ValueError(f"{self.what} {name!r} registered twice")
        self._entries[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(self.unknown_error(name)) from None

    def unknown_error(self, name: object) -> str:
        """The error text for a name that is not registered."""
        choices = ", ".join(self._entries) or "(none)"
        if self.unknown is not None:
            return self.unknown.format(what=self.what, name=name, flag=self.flag, choices=choices)
        where = f" ({self.flag})" if self.flag else ""
        return f"unknown {self.what} {name!r}{where}: choose one of {choices}"

    def check(self, name: str) -> str:
        """`name` itself if registered, else the ConfigError of get()."""
        self.get(name)
        return name

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
