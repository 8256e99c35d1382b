"""The expressions a program appends to its state with `s += ...`.

An expression is data, not an action: `gen("x")` only describes a call, which the state's executor
makes when it reaches it. `+` joins expressions (and strings) into a flat `ExprList`, so
`"Q: " + gen("a") + "\n"` is three steps run in order.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# REGEX_*: gen(dtype=...)'s patterns, re-exported where SGLang's programs import them from (its ir)
from sglbus.lang.params import REGEX_BOOL as REGEX_BOOL
from sglbus.lang.params import REGEX_FLOAT as REGEX_FLOAT
from sglbus.lang.params import REGEX_INT as REGEX_INT
from sglbus.lang.params import REGEX_STR as REGEX_STR
from sglbus.lang.params import SamplingParams

if TYPE_CHECKING:
    from sglbus.lang.choices import ChoiceMethod


class Expr:
    def __add__(self, other: Any) -> ExprList:
        return ExprList([*leaves(self), *leaves(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([*leaves(other), *leaves(self)])

    # a dataclass subclass compares by value; identity would do as well, but equal steps look equal
    __hash__ = object.__hash__


@dataclass(eq=False)
class ExprList(Expr):
    items: list[Expr]


@dataclass(eq=False)
class AppendedExprList(ExprList):
    """What `s.user(x)` returns: the role it has already appended to `s`, as SGLang returns it, so that
    `s += s.user(x)` (SGLang's tutorial: "same as `s += sgl.user(x)`") appends it once. SGLang's own
    `+=` appends it a second time; here `+=` on the state it came from appends nothing, and on any
    other state it appends the role as any expression."""

    owner: weakref.ref[Any] | None = None

    def appended_to(self, state: Any) -> bool:
        return self.owner is not None and self.owner() is state


@dataclass(eq=False)
class Text(Expr):
    value: str
    # the images its image tokens stand for, in order (image_data items): only the text a joined
    # branch hands its parent (join("concate_and_append")) has any; a program's strings have none
    images: tuple[str, ...] = ()


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    method: ChoiceMethod


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class Image(Expr):
    path: Any  # a file path, bytes, a PIL image, a data URL or base64: sglbus/lang/media.py encodes it


@dataclass(eq=False)
class Video(Expr):
    path: Any  # a video file's path or bytes, or its frames
    num_frames: int


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class SeparateReasoning(Expr):
    """After the gen (or select) `name`: its text split by the reasoning parser of `model_type`
    (shared/reasoning_parser.py): `name` keeps the answer, `name + "_reasoning_content"` gets the
    reasoning, and the state's text keeps the answer alone."""

    model_type: str
    name: str | None
    constrained: bool = False  # a select, or a gen with a regex / json_schema / dtype: see ReasoningParser

    @property
    def reasoning_name(self) -> str:
        return f"{self.name}_reasoning_content"


def leaves(x: Any) -> list[Expr]:
    """x as the flat list of steps it stands for; TypeError for what a state cannot take."""
    if isinstance(x, ExprList):
        return [leaf for item in x.items for leaf in leaves(item)]
    if isinstance(x, Expr):
        return [x]
    if isinstance(x, str):
        return [Text(x)]
    raise TypeError(
        f"a program appends strings and sgl expressions (gen, select, roles, image), got "
        f"{type(x).__name__}: {x!r}"
    )


def produced_names(x: Expr) -> list[str | None]:
    """The variables a step sets (what `s[name]` waits for); a gen or select without a name sets None."""
    if isinstance(x, (Gen, Select, VarScopeEnd)):
        return [x.name]
    if isinstance(x, SeparateReasoning):
        return [x.name, x.reasoning_name]
    return []


def __getattr__(name: str) -> Any:
    """`from sglang.lang.ir import SglFunction`, as sglbus (function.py imports this module)."""
    if name == "SglFunction":
        from sglbus.lang.function import Function

        return Function
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
