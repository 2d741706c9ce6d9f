"""``traceable_property``: ``@property`` for the opaque values of spmd/compile/values.py.

torch 2.13's Dynamo fails on every ``@property`` read of an opaque value that comes from outside the
compiled function (an argument, a closure cell, a global): it resolves a ``property`` through the
class's source, which it never sets for opaque objects, and stops with "cls_source must not be None
for MRO walk". A read-only descriptor of our own (a Python ``__get__``) takes Dynamo's generic
descriptor path instead, which traces ``__get__``: the getter then runs like a method body.
Depends on no other spmd module, so any module may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, NoReturn, TypeVar, overload

from typing_extensions import Self

__all__ = ["traceable_property"]

T = TypeVar("T")


class traceable_property(Generic[T]):
    """A read-only attribute computed by ``fget``, used like ``@property``.

    >>> class Box:
    ...     def __init__(self, n: int) -> None:
    ...         self._n = n
    ...     @traceable_property
    ...     def n(self) -> int:
    ...         return self._n
    >>> Box(3).n
    3
    """

    def __init__(self, fget: Callable[[Any], T]) -> None:
        self.fget = fget
        self.__doc__ = fget.__doc__
        self.__name__ = fget.__name__
        # so that ``traceable_property(abstractmethod(f))`` keeps its class abstract, as a property does
        self.__isabstractmethod__: bool = getattr(fget, "__isabstractmethod__", False)

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Self: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...
    def __get__(self, instance: object | None, owner: type | None = None) -> T | Self:
        return self if instance is None else self.fget(instance)

    def __set__(self, instance: object, value: object) -> NoReturn:
        # A data descriptor, as a property without a setter: the value cannot be shadowed or set.
        raise AttributeError(f"{type(instance).__name__}.{self.__name__} is read-only")
