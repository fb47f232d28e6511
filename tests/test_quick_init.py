"""`quick_init`: the hot path's frozen dataclasses built as the dataclass builds them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from sidecar.admission.cost import ModelInputs, RequestCost
from sidecar.admission.outcomes import Decision, Outcome
from sidecar.admission.prefix import PrefixPlan
from sidecar.admission.quick_init import quick_init
from sidecar.admission.running import AdmissionRequest
from sidecar.server.client_headers import Steering
from sidecar.server.requests import GenerationRequest


def built_both_ways(cls: type, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    quick = cls(*args, **kwargs)
    reference = object.__new__(cls)
    cls.__dataclass_init__(reference, *args, **kwargs)  # type: ignore[attr-defined]
    return quick, reference


def same(quick: Any, reference: Any) -> None:
    assert quick == reference
    hashable = all(getattr(value, "__hash__", None) is not None
                   for value in vars(reference).values())
    if hashable:  # a field holding a dict or a list makes the instance unhashable, alike
        assert hash(quick) == hash(reference)
    assert repr(quick) == repr(reference)
    assert vars(quick) == vars(reference)
    assert list(vars(quick)) == list(vars(reference))  # the fields' order too


CASES: list[tuple[type, tuple[Any, ...], dict[str, Any]]] = [
    (Decision, (Outcome.ADMITTED, "fits"), {}),
    (Decision, (Outcome.DEADLINE, "late", 1.5), {"details": {"kv_blocks": 3}}),
    (AdmissionRequest, (120,), {}),
    (AdmissionRequest, (120, 64, 2, True, 0, "t", 0.5, (b"a", b"b")), {}),
    (AdmissionRequest, (), {"prompt_tokens": 9, "tenant": "x", "block_keys": (b"k",)}),
    (PrefixPlan, (1, (b"a",), 0, 32), {}),
    (RequestCost, (10, 20, 1, 3, 9, 1e9, 0.1, 0.01), {}),
    (RequestCost, (10, 20, 1, 3, 9, 1e9, 0.1, 0.01), {
        "prefill_work_s": 0.2, "shared_blocks": 1, "cached_tokens": 4,
        "model_inputs": ModelInputs(6, 4, 1, 10, 2, 30, 1.0, 0),
        "server_prefill_tokens": 6}),
    (Steering, (1, "default", None), {}),
]


@pytest.mark.parametrize(("cls", "args", "kwargs"), CASES,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_the_quick_init_builds_what_the_dataclass_builds(
        cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    same(*built_both_ways(cls, *args, **kwargs))


def test_every_field_of_a_generation_request_and_its_defaults() -> None:
    names = [f.name for f in dataclasses.fields(GenerationRequest)]
    required = [f.name for f in dataclasses.fields(GenerationRequest)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    values = {name: f"v-{name}" for name in required}
    same(*built_both_ways(GenerationRequest, **values))
    every = {name: f"w-{name}" for name in names}
    same(*built_both_ways(GenerationRequest, **every))


def test_a_default_factory_gives_each_instance_its_own_value() -> None:
    first, second = Decision(Outcome.ADMITTED, "a"), Decision(Outcome.ADMITTED, "b")
    assert first.details == {} and first.details is not second.details


def test_still_frozen_and_the_signature_is_kept() -> None:
    import inspect
    import typing

    for cls in (Decision, RequestCost, GenerationRequest):
        original = cls.__dataclass_init__  # type: ignore[attr-defined]
        # As text: a default factory's marker is another object, shown alike.
        assert str(inspect.signature(cls.__init__)) == str(inspect.signature(original))
        assert typing.get_type_hints(cls.__init__) == typing.get_type_hints(original)
        assert cls.__init__.__module__ == original.__module__
    decision = Decision(Outcome.ADMITTED, "fits")
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.reason = "changed"  # type: ignore[misc]
    assert dataclasses.replace(decision, reason="r").reason == "r"
    with pytest.raises(TypeError):
        Decision(Outcome.ADMITTED)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Decision(Outcome.ADMITTED, "a", 1.0, {}, "one too many")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        AdmissionRequest(1, unknown=2)  # type: ignore[call-arg]


def test_fields_not_in_the_init_get_their_defaults() -> None:
    @quick_init
    @dataclass(frozen=True)
    class Shape:
        a: int
        b: list[int] = field(default_factory=list, init=False)
        c: int = field(default=7, init=False)

    quick, reference = built_both_ways(Shape, 1)
    same(quick, reference)
    assert quick.c == 7 and quick.b == []


def test_what_it_cannot_build_is_refused_when_defined() -> None:
    with pytest.raises(TypeError, match="not a frozen dataclass"):
        @quick_init
        @dataclass
        class Plain:
            a: int

    with pytest.raises(TypeError, match="slots or a __post_init__"):
        @quick_init
        @dataclass(frozen=True, slots=True)
        class Slotted:
            a: int

    with pytest.raises(TypeError, match="slots or a __post_init__"):
        @quick_init
        @dataclass(frozen=True)
        class Checked:
            a: int

            def __post_init__(self) -> None:
                pass

    with pytest.raises(TypeError, match="keyword-only"):
        @quick_init
        @dataclass(frozen=True, kw_only=True)
        class Named:
            a: int

    with pytest.raises(TypeError, match="a name its __init__ uses"):
        @quick_init
        @dataclass(frozen=True)
        class Clashing:
            stored: int

    with pytest.raises(TypeError, match="do not make its __init__"):
        @quick_init
        @dataclass(frozen=True)
        class WithInitVar:
            a: int
            b: dataclasses.InitVar[int] = 0
