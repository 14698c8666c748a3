"""Per-request timelines: what the engine did with each request, and when, for the last N requests.

Aggregate metrics say that some requests were slow; a timeline says why one was: how long it queued, how its
prompt was cut into chunks and beside how many others, whether the prefix cache served part of it, whether it was
preempted, when its first token came and how it ended. Recording costs a few dict operations per scheduled request
per step, so it runs only when asked for (``--enable-debug-routes``).

Bounded: ``capacity`` finished requests are kept (oldest dropped first), and a request keeps at most
``max_events`` events. Consecutive decode steps fold into one ``decode`` run, so a long generation is a handful of
events, not one per token. Times are ``time.monotonic()`` seconds, one clock for both server processes on a host.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.outputs import EngineCoreOutput
    from engine.scheduler import SchedulerOutput

DEFAULT_CAPACITY = 1000
MAX_EVENTS = 256


@dataclass
class RequestTimeline:
    request_id: str
    num_prompt_tokens: int
    arrival_time: float
    events: list[dict] = field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    dropped_events: int = 0

    def add(self, event: dict, max_events: int) -> None:
        if len(self.events) < max_events:
            self.events.append(event)
        else:
            self.dropped_events += 1

    def summary(self) -> dict:
        """The timeline without its events: a row of the dashboard's list of requests."""
        done = self.finish_time
        return {
            "request_id": self.request_id, "arrival_time": self.arrival_time,
            "num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens,
            "num_cached_tokens": self.num_cached_tokens, "num_preemptions": self.num_preemptions,
            "ttft_s": None if self.first_token_time is None else self.first_token_time - self.arrival_time,
            "e2e_s": None if done is None else done - self.arrival_time, "finish_reason": self.finish_reason,
            "state": self.state,
        }

    @property
    def state(self) -> str:
        """finished, queued (never scheduled yet), preempted (waiting to resume) or running."""
        if self.finish_time is not None:
            return "finished"
        last = next((e["event"] for e in reversed(self.events) if e["event"] in ("preempted", "resumed",
                                                                                 "scheduled")), None)
        return {None: "queued", "preempted": "preempted"}.get(last, "running")

    def as_dict(self) -> dict:
        return {**self.summary(), "events": list(self.events), "dropped_events": self.dropped_events}


class Timelines:
    """The engine's record of its requests' histories (see the module docstring)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_events: int = MAX_EVENTS) -> None:
        if capacity < 1 or max_events < 4:
            raise ValueError(f"timelines need capacity >= 1 and max_events >= 4, got {capacity}, {max_events}")
        self.capacity = capacity
        self.max_events = max_events
        self.live: dict[str, RequestTimeline] = {}
        self.finished: OrderedDict[str, RequestTimeline] = OrderedDict()
        self.num_steps = 0

    def arrived(self, request_id: str, num_prompt_tokens: int, arrival_time: float | None = None) -> None:
        """A request reached the engine; ``arrival_time``: when it reached the server, where it came through one."""
        now = time.monotonic()
        timeline = RequestTimeline(request_id, num_prompt_tokens, arrival_time if arrival_time is not None else now)
        if arrival_time is not None:
            timeline.add({"t": arrival_time, "event": "arrival"}, self.max_events)
        timeline.add({"t": now, "event": "queued"}, self.max_events)
        self.live[request_id] = timeline

    def stepped(self, scheduled: SchedulerOutput, started: float, ended: float) -> None:
        """One step ran ``scheduled`` from ``started`` to ``ended``: a prefill chunk or a decode per request."""
        self.num_steps += 1
        batch, tokens = len(scheduled.scheduled_requests), scheduled.total_num_scheduled_tokens
        for request_id in scheduled.preempted_request_ids:
            timeline = self.live.get(request_id)
            if timeline is not None:
                timeline.num_preemptions += 1
                timeline.add({"t": started, "event": "preempted"}, self.max_events)
        for request in scheduled.scheduled_requests:
            timeline = self.live.get(request.request_id)
            if timeline is None:
                continue
            n = scheduled.num_scheduled_tokens[request.request_id]
            last = timeline.events[-1] if timeline.events else None
            if last is not None and last["event"] in ("queued", "preempted"):
                resumed = last["event"] == "preempted"
                if not resumed:
                    timeline.num_cached_tokens = request.num_cached_tokens
                timeline.add({"t": started, "event": "resumed" if resumed else "scheduled",
                              "cached_tokens": request.num_computed_tokens}, self.max_events)
            computed = request.num_computed_tokens
            if computed < request.num_prompt_tokens or request.num_tokens - computed > 1:  # a prompt chunk, or a redo
                timeline.add({"t": started, "event": "prefill", "step": self.num_steps, "tokens": n,
                              "computed": request.num_computed_tokens, "batch": batch, "step_tokens": tokens,
                              "duration_s": ended - started}, self.max_events)
            elif last is not None and last["event"] == "decode":  # the run goes on: verified drafts count too
                last["steps"] += 1
                last["tokens"] += n
                last["last_t"] = ended
                last["batch_min"] = min(last["batch_min"], batch)
                last["batch_max"] = max(last["batch_max"], batch)
            else:
                timeline.add({"t": started, "event": "decode", "steps": 1, "tokens": n, "last_t": ended,
                              "batch_min": batch, "batch_max": batch}, self.max_events)

    def produced(self, outputs: list[EngineCoreOutput]) -> None:
        """A step's outputs: first tokens, token counts, and requests that ended (moved to the finished ring)."""
        now = time.monotonic()
        for out in outputs:
            timeline = self.live.get(out.request_id)
            if timeline is None:
                continue
            if out.new_token_ids and timeline.first_token_time is None:
                timeline.first_token_time = now
                timeline.add({"t": now, "event": "first_token"}, self.max_events)
            timeline.num_output_tokens += len(out.new_token_ids)
            if out.finished:
                self._finish(timeline, out.finish_reason, now, out.error)

    def aborted(self, request_id: str) -> None:
        timeline = self.live.get(request_id)
        if timeline is not None:
            self._finish(timeline, "abort", time.monotonic(), None)

    def _finish(self, timeline: RequestTimeline, reason: str | None, now: float, error: str | None) -> None:
        timeline.finish_time, timeline.finish_reason = now, reason
        event = {"t": now, "event": "finished", "reason": reason, "output_tokens": timeline.num_output_tokens}
        if error:
            event["error"] = error
        timeline.events.append(event)  # past max_events too: how it ended is always kept
        del self.live[timeline.request_id]
        self.finished[timeline.request_id] = timeline
        while len(self.finished) > self.capacity:
            self.finished.popitem(last=False)

    def recent(self, limit: int) -> list[dict]:
        """Summaries of the running requests and the last finished ones, newest first, at most ``limit``."""
        newest = itertools.chain(reversed(self.live.values()), reversed(self.finished.values()))
        return [t.summary() for t in itertools.islice(newest, limit)]

    def get(self, request_id: str) -> list[dict]:
        """The timelines of ``request_id``: the engine request itself, or the samples a server request fanned out
        into (``{id}-0``, ``{id}-1``, ...), live ones included; [] if none is kept."""
        found = [t for t in (self.live.get(request_id), self.finished.get(request_id)) if t is not None]
        if not found:
            prefix = request_id + "-"
            found = [t for store in (self.finished, self.live) for key, t in store.items() if key.startswith(prefix)]
        return [t.as_dict() for t in found]
