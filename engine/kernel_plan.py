"""The kernel plan: every choice start-up makes about how this machine runs the model, each with what its candidates
measured, in one table printed at start, kept by the engine and exported (``/metrics``, the bench's JSON).

The engine builds it (``EngineCore._plan_kernels``). It asks the backend which choices its kernels leave open
(``TorchBackend.kernel_choices``: a ``KernelChoice`` names its candidates and how to time one call of each), times
them in turns on this machine, and hands the chosen candidates back (``TorchBackend.use_plan``); the backend never
decides by itself what it asked. Choices the backend had to make while packing the weights, because the packing
depends on them (which format a weight is packed in), it reports with their measurements as rows of the same plan
(``TorchBackend.packing_choices``). The engine's own choices (the step's token budget) join it too. A server's
engine times the kernels' choices again once started, when the API process has stopped loading and no longer takes
a core from the timings (``EngineCore`` with ``own_process``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.timing import best_in_turns

TIMING_TURNS = 4  # turns each candidate is timed in (best_in_turns), its best kept


@dataclass(frozen=True)
class KernelChoice:
    """A choice the backend leaves to start-up: ``candidates`` maps each candidate to one call of it (already
    warmed up where its first call would pay one-off costs), ``where`` says what the calls run (shapes, rows).
    ``measure``, where given, replaces the timing in turns: a choice whose candidates are not simply the fastest
    (a threshold of rows, a run of batch sizes) times itself and returns the chosen candidate and the seconds it
    read. ``default``: the candidate taken where there is nothing to time (one candidate)."""

    name: str
    where: str
    candidates: dict[str, Callable[[], object]] = field(default_factory=dict)
    measure: Callable[[], tuple[str, dict[str, float]]] | None = None

    def decide(self) -> PlanRow:
        if self.measure is not None:
            chosen, seconds = self.measure()
            return PlanRow(self.name, chosen, seconds, self.where)
        if len(self.candidates) == 1:
            return PlanRow(self.name, next(iter(self.candidates)), {}, self.where, "the only one")
        seconds = best_in_turns(self.candidates, turns=TIMING_TURNS)
        return PlanRow(self.name, min(seconds, key=seconds.get), seconds, self.where)


@dataclass(frozen=True)
class PlanRow:
    """One choice made: the candidate ``chosen``, what each candidate measured (seconds, the fastest of its turns;
    empty where nothing was timed), where, and why where it is not simply the fastest."""

    name: str
    chosen: str
    seconds: dict[str, float]
    where: str = ""
    note: str = ""

    def as_dict(self) -> dict:
        return {"name": self.name, "chosen": self.chosen, "ms": {k: round(v * 1e3, 3) for k, v in self.seconds.items()},
                "where": self.where, "note": self.note}


@dataclass(frozen=True)
class KernelPlan:
    """The choices of one engine's start-up, in the order they were made."""

    rows: tuple[PlanRow, ...] = ()

    def chosen(self, name: str, default: str | None = None) -> str | None:
        return next((r.chosen for r in self.rows if r.name == name), default)

    def with_rows(self, rows: list[PlanRow]) -> KernelPlan:
        """This plan with ``rows``, each replacing a row of its name (a choice timed again) or appended."""
        names = {r.name for r in rows}
        return KernelPlan(tuple(r for r in self.rows if r.name not in names) + tuple(rows))

    def table(self) -> str:
        """The plan as a text table: the choice, what was chosen, where it was timed, what each candidate measured
        (or why nothing was)."""
        lines = [("choice", "chosen", "where", "measured (ms)")]
        for r in self.rows:
            measured = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r.seconds.items())
            note = r.note if not measured else f"{measured} ({r.note})" if r.note else measured
            lines.append((r.name, r.chosen, r.where or "-", note or "-"))
        widths = [max(len(line[i]) for line in lines) for i in range(3)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)) + "  " + line[3]
                         for line in lines)

    def as_dict(self) -> list[dict]:
        return [r.as_dict() for r in self.rows]

    def labels(self) -> str:
        """``name=chosen`` for every row, ``;``-separated: one label of the engine's info series in ``/metrics``."""
        return ";".join(f"{r.name}={r.chosen}" for r in self.rows)


class Planned(Protocol):
    """What the engine asks of a backend for its plan (``TorchBackend``'s kernel plan methods)."""

    def kernel_choices(self) -> list[KernelChoice]: ...

    def use_choice(self, row: PlanRow) -> None: ...

    def use_plan(self) -> None: ...


def plan_kernels(backend: Planned) -> list[PlanRow]:
    """Time the backend's open choices on this machine, in order, each one's result given back before the next is
    timed (a later choice is timed with the earlier ones in force), then the whole plan put in force."""
    rows = []
    for choice in backend.kernel_choices():
        row = choice.decide()
        backend.use_choice(row)
        rows.append(row)
    backend.use_plan()
    return rows
