"""What a gate is: its registry row (`Gate`), the evidence floor every gate's pass must meet (`Floor`), and
how a gate is shown (`Show`, `Column`). Each gate module defines its row as GATE; moe_eval.gates.registry
lists them. Apart from the registry so that a gate module can import these types without importing every
gate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import pydantic
import pydantic.dataclasses
from typing_extensions import (  # pydantic reads typing's TypedDict from 3.12 only
    TypedDict,
    dataclass_transform,
)

if TYPE_CHECKING:
    from pathlib import Path

    from moe_eval.core.layout import Layout
    from moe_eval.gates.measurements import Judgement, Measurements


T = TypeVar("T")


class GateConfig(Protocol):
    """What a gate reads of a row's config (moe_eval.configs.config.GateConfig is one): a few of the run's
    keys, what they imply, and the gate's own keys. gates/ imports no config module, not even for a type: the
    config knows the gates (it asks the registry for their keys), not the other way round."""

    @property
    def path(self) -> Path: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def accuracy_threshold(self) -> float | None: ...
    @property
    def tolerance(self) -> float: ...
    @property
    def num_questions(self) -> int: ...
    @property
    def random_weights(self) -> bool: ...
    @property
    def moe_backend(self) -> str | None: ...
    @property
    def moe_timing(self) -> bool: ...
    @property
    def on_gpu(self) -> bool | None: ...
    @property
    def logprob_texts(self) -> int: ...
    @property
    def decode_texts(self) -> int: ...
    @property
    def answers_gated(self) -> bool: ...
    @property
    def golden_gated(self) -> bool: ...
    @property
    def layer_checked(self) -> bool: ...

    def keys(self, kind: type[T]) -> T:
        """The gate's keys (its @gate_keys class) as this config set them."""
        ...

    def key(self, name: str) -> Any:
        """One key's value by name (a Floor's share_key)."""
        ...


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(pydantic.Field,))
def gate_keys(cls: type[T]) -> type[T]:
    """Makes a class a gate's config keys: a frozen pydantic dataclass, strict (a string "0.5" is not a
    number, an unknown key is an error). Its fields, every one with a default and a `description` (the
    key's doc), are keys of the per-model YAML, flat beside the run's own (moe_eval.configs.config); the gate
    names the class as its registry row's `keys` and reads them as `config.keys(TheClass)`."""
    config = pydantic.ConfigDict(strict=True, extra="forbid")
    # pydantic's stub types the result as a PydanticDataclass; it is the class given, made a dataclass.
    return cast("type[T]", pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=config)(cls))


class RowView(Protocol):
    """What a gate's table cell may read of a finished row (moe_eval.runner.ConfigOutcome)."""

    @property
    def config(self) -> GateConfig: ...

    @property
    def timing(self) -> dict[str, Any] | None: ...

    def section(self, key: str) -> Any: ...


@dataclass(frozen=True)
class Column:
    """One column of the run table: its header and each row's cell (from the gate's section)."""

    header: str
    cell: Callable[[Any, RowView], str]


@dataclass(frozen=True)
class Show:
    """How a gate is shown beyond its checks (each optional): run-table columns, JUnit properties from its
    section, and `moe-eval compare` rows from each compared run's section (runs as columns)."""

    columns: tuple[Column, ...] = ()
    junit: Callable[[Any], dict[str, object]] | None = None
    compare: Callable[[list[Any], int], list[list[str]]] | None = None


@dataclass(frozen=True)
class Floor:
    """The least evidence a pass needs, for every check of the gate that counts its evidence: at least
    `units` judged, and `share` of those it was given (the config can set the share: `share_key`). A check
    that passed on less is "not run" (decided by the judge, the same for every gate)."""

    units: int = 1
    share: float = 0.0
    share_key: str | None = None  # a config key holding the share, where the config sets it

    def required(self, config: GateConfig, total: int) -> int:
        share = config.key(self.share_key) if self.share_key else self.share
        return max(self.units, math.ceil(share * total - 1e-9))


@dataclass(frozen=True)
class Gate:
    name: str  # as `moe-eval list` prints it; `optional_gates` names it
    checks: tuple[str, ...]  # the checks it can make (results.json "checks" names)
    # The config's keys ask for it, given whether the run has an incumbent (baseline_config or --baseline).
    called_for: Callable[[GateConfig, bool], bool]
    needs_incumbent: bool  # cannot run without one: called for and none is "not run", not a pass
    # Appends the gate's checks and results.json section; returns why it could not judge (None: judged).
    rule: Callable[[GateConfig, Measurements, Judgement], str | None]
    what: str  # what it checks, in one line: the registry read as documentation
    keys: type | None = None  # its config keys (a @gate_keys class; None: it reads none)
    section: str | None = None  # its results.json key (None: it writes checks only)
    payload: Any = None  # its section's type (a dataclass or TypedDict): the schema's
    # The least evidence a pass of each check needs (a check not named: Floor(), one unit judged).
    floors: dict[str, Floor] = field(default_factory=dict)
    show: Show = field(default_factory=Show)
    # Why the config alone keeps it from running where it is called for, with the short words `moe-eval
    # list` shows: (why, short); None: nothing does.
    blocked: Callable[[GateConfig], tuple[str, str] | None] = lambda config: None
    # Where it is not called for but could still be computed: its section, reported only (no check, so
    # never a verdict).
    report: Callable[[GateConfig, Measurements, Judgement], None] | None = None

    def floor_of(self, check: str) -> Floor:
        return self.floors.get(check, Floor())


class Skipped(TypedDict):
    """A gate's section, or part of one, that measured nothing."""

    skipped: str
    """why"""
