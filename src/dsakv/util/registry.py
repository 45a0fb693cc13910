"""One generic registry: name -> object (a class, a factory, a codec), filled by a decorator or a call.

BACKENDS: Registry[type[TransferBackend]] = Registry("transfer backend", flag="--transfer-backend")

@BACKENDS.register("mooncake")
class MooncakeBackend(TransferBackend): ...

BACKENDS.get("nixl")   # ConfigError naming the value, the flag and the choices when unknown
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from dsakv.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """An ordered name -> entry map with one error text for unknown names."""

    def __init__(self, what: str, flag: str | None = None) -> None:
        self.what = what
        self.flag = flag
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
            where = f" ({self.flag})" if self.flag else ""
            raise ConfigError(
                f"unknown {self.what} {name!r}{where}: choose one of {', '.join(self._entries) or '(none)'}"
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
