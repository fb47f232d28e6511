"""`quick_init`: a frozen dataclass built as fast as a plain one.

A frozen dataclass's generated `__init__` sets each field through
`object.__setattr__`, one call per field: about 2 us for the 21 fields of a
`RequestCost`, built for every request. `quick_init` replaces that `__init__` with one
of the same signature (the same parameters, defaults and default factories) that
stores the fields straight into the instance's `__dict__`, as a plain class's does.
Everything else stays the dataclass's own: equality, hashing, `repr`, `replace`, and
the frozen `__setattr__` that refuses changes.

For frozen dataclasses with an instance `__dict__` (no `slots`), no `__post_init__`,
no `InitVar` and no keyword-only fields: anything else is refused when the class is
defined. The dataclass's own `__init__` stays as `__dataclass_init__` (the tests
compare the two).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any, TypeVar

_Class = TypeVar("_Class", bound=type)


class _Factory:
    """The default of a parameter whose field has a default factory."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()
# The generated code's own names: a field may not take one.
_RESERVED = frozenset({"self", "stored", "_FACTORY"})


def quick_init(cls: _Class) -> _Class:
    """`cls` (a frozen dataclass) with an `__init__` that stores its fields directly.
    A class mypyc compiled as a native class (no instance `__dict__` and no `__slots__`
    of Python's: already built as fast) is returned as it is; mypyc compiles the classes
    this decorates as ordinary Python classes, which it rewrites as it does uncompiled."""
    if cls.__dictoffset__ == 0 and "__slots__" not in cls.__dict__:
        return cls  # native
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"quick_init: {cls.__name__} is not a frozen dataclass")
    if "__slots__" in cls.__dict__ or hasattr(cls, "__post_init__"):
        raise TypeError(f"quick_init: {cls.__name__} has slots or a __post_init__")
    namespace: dict[str, Any] = {"_FACTORY": _FACTORY}
    parameters: list[str] = []
    body: list[str] = ["    stored = self.__dict__"]
    for field in dataclasses.fields(cls):
        name = field.name
        if name in _RESERVED or name.startswith(("_factory_", "_default_")):
            raise TypeError(f"quick_init: {cls.__name__}.{name} is a name its __init__ uses")
        if field.kw_only:
            raise TypeError(f"quick_init: {cls.__name__}.{name} is keyword-only")
        has_factory = field.default_factory is not dataclasses.MISSING
        if has_factory:
            namespace[f"_factory_{name}"] = field.default_factory
        if not field.init:
            # As the dataclass's: a factory's value is stored, a plain default stays
            # the class attribute it is.
            if has_factory:
                body.append(f"    stored[{name!r}] = _factory_{name}()")
            continue
        if has_factory:
            parameters.append(f"{name}=_FACTORY")
            body.append(f"    stored[{name!r}] = _factory_{name}() if {name} is _FACTORY "
                        f"else {name}")
            continue
        if field.default is not dataclasses.MISSING:
            namespace[f"_default_{name}"] = field.default
            parameters.append(f"{name}=_default_{name}")
        else:
            parameters.append(name)
        body.append(f"    stored[{name!r}] = {name}")
    names = [parameter.partition("=")[0] for parameter in parameters]
    if names != list(inspect.signature(cls.__dict__["__init__"]).parameters)[1:]:
        raise TypeError(f"quick_init: {cls.__name__}'s fields do not make its __init__")
    # As the dataclass makes its own: in the class's module's globals (its annotations
    # resolve there), the defaults and factories the closure of a maker function, so
    # that nothing is added to the module.
    inner = "\n".join(f"    {line}" for line in
                      [f"def __init__(self, {', '.join(parameters)}):", *body])
    source = (f"def __make_init__({', '.join(namespace)}):\n{inner}\n"
              "    return __init__\n")
    makers: dict[str, Any] = {}
    exec(source, sys.modules[cls.__module__].__dict__, makers)
    init = makers["__make_init__"](**namespace)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    original = cls.__dict__["__init__"]
    init.__doc__ = original.__doc__
    init.__annotations__ = dict(original.__annotations__)  # for inspect and get_type_hints
    setattr(cls, "__dataclass_init__", original)  # noqa: B010  (not an attribute mypy knows)
    setattr(cls, "__init__", init)  # noqa: B010
    return cls
