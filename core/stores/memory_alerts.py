"""MemoryStore's alerts (issue 16): lua/lib.lua's "Alerts" section in Python, for one process.

The same decisions, markers and expiries as the scripts (the conformance suite runs both):
thresholds per (budget, window) once, the first refusal once, velocity once per window, hourly
spend buckets, the outbox and the alert log. Atomic for the reason MemoryStore is: nothing here
awaits.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from core.alerts import (
    EXCEEDED,
    THRESHOLD_CROSSED,
    VELOCITY,
    AlertConfig,
    AlertEvent,
    event_id_of,
)
from core.limits import (
    ALERT_RETENTION_MS,
    COUNTER_RETENTION_MS,
    SPEND_BUCKET_MS,
    SPEND_BUCKET_RETENTION_MS,
    VELOCITY_SLOTS,
    VELOCITY_TRAILING_HOURS,
)

# Expired entries dropped per write: bounds the work one call inherits (memory.PRUNE_BATCH_MAX).
ALERT_PRUNE_BATCH_MAX = 64


def threshold_micros(ceiling_micros: int, pct: int) -> int:
    """ceil(ceiling * pct / 100) (lua/lib.lua threshold_micros)."""
    return -(-ceiling_micros * pct // 100)


K = TypeVar("K")
V = TypeVar("V")


@dataclass
class _Expiring(Generic[K, V]):
    """Values that go at a time, as PEXPIRE'd keys do: a dict and a heap of drop times."""

    values: dict[K, tuple[int, V]] = field(default_factory=dict)
    heap: list[tuple[int, int, K]] = field(default_factory=list)
    _n: int = 0

    def get(self, key: K, now_ms: int) -> V | None:
        found = self.values.get(key)
        return None if found is None or found[0] <= now_ms else found[1]

    def put(self, key: K, value: V, drop_at_ms: int) -> None:
        self.values[key] = (drop_at_ms, value)
        self._n += 1
        heapq.heappush(self.heap, (drop_at_ms, self._n, key))

    def prune(self, now_ms: int) -> None:
        for _ in range(ALERT_PRUNE_BATCH_MAX):
            if not self.heap or self.heap[0][0] > now_ms:
                return
            _, _, key = heapq.heappop(self.heap)
            found = self.values.get(key)
            if found is not None and found[0] <= now_ms:
                del self.values[key]


class MemoryAlerts:
    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock
        # (budget, window, threshold | 'exceeded'); (budget, velocity window)
        self.markers: _Expiring[tuple[str, str, str], bool] = _Expiring()
        self.windows: _Expiring[tuple[str, int], bool] = _Expiring()
        self.buckets: _Expiring[tuple[str, int], int] = _Expiring()  # (budget, hour) -> micros
        self.slots: _Expiring[tuple[str, int], int] = _Expiring()  # (budget, slot) -> micros
        self.events: _Expiring[str, AlertEvent] = _Expiring()
        self.outbox: dict[str, dict[str, int]] = {}  # tag -> event id -> next attempt ms
        self.paused: dict[str, int] = {}  # budget -> paused at ms

    def _prune(self, now_ms: int) -> None:
        self.markers.prune(now_ms)
        self.windows.prune(now_ms)
        self.buckets.prune(now_ms)
        self.slots.prune(now_ms)
        self.events.prune(now_ms)

    def _emit(self, kind: str, budget_id: str, period_key: str, threshold: str,
              committed_micros: int, ceiling_micros: int, now_ms: int) -> None:
        eid = event_id_of(kind, budget_id, period_key, threshold)
        tag = budget_id.split("/", 1)[0]
        event = AlertEvent(eid, kind, budget_id, period_key, int(threshold) if threshold else None,
                           committed_micros, ceiling_micros, now_ms, tag)
        self.events.put(eid, event, now_ms + ALERT_RETENTION_MS)
        self.outbox.setdefault(tag, {})[eid] = now_ms

    def committed_moved(self, config: AlertConfig | None, budget_id: str, window_key: str,
                        ceiling_micros: int, resets_at_ms: int | None, after: int, delta: int,
                        now_ms: int, spent_at_ms: int, first_of_budget: bool,
                        watched: bool) -> None:
        """lua/lib.lua committed_moved: a step added `delta` to a budget's committed spend in
        one window, which now holds `after`; its hourly bucket is the hour of `spent_at_ms`,
        the call's own time; a velocity alarm counts it if it `watched` the call's hold."""
        self._prune(now_ms)
        config = config or AlertConfig()
        before = after - delta
        keep_until = (resets_at_ms + COUNTER_RETENTION_MS) if resets_at_ms else 2**62
        if delta > 0 and ceiling_micros > 0:
            for pct in sorted(config.thresholds_pct):
                at = threshold_micros(ceiling_micros, pct)
                marker = (budget_id, window_key, str(pct))
                if before < at <= after and self.markers.get(marker, now_ms) is None:
                    self.markers.put(marker, True, keep_until)
                    self._emit(THRESHOLD_CROSSED, budget_id, window_key, str(pct), after,
                               ceiling_micros, now_ms)
        if not first_of_budget:
            return
        bucket = (budget_id, spent_at_ms // SPEND_BUCKET_MS)
        held = self.buckets.get(bucket, now_ms)
        self.buckets.put(bucket, int(held or 0) + delta, now_ms + SPEND_BUCKET_RETENTION_MS
                         if held is None else self.buckets.values[bucket][0])
        if delta > 0 and watched and config.velocity is not None:
            self._velocity(config, budget_id, delta, now_ms)

    def _velocity(self, config: AlertConfig, budget_id: str, delta: int, now_ms: int) -> None:
        v = config.velocity
        assert v is not None
        window_ms = v.window_s * 1000
        slot_ms = window_ms / VELOCITY_SLOTS
        slot = math.floor(now_ms / slot_ms)
        held = self.slots.get((budget_id, slot), now_ms)
        self.slots.put((budget_id, slot), int(held or 0) + delta, now_ms + 2 * window_ms
                       if held is None else self.slots.values[(budget_id, slot)][0])
        spent = sum(int(self.slots.get((budget_id, slot - i), now_ms) or 0)
                    for i in range(VELOCITY_SLOTS))
        over = bool(v.max_micros) and spent > v.max_micros
        if not over and v.max_rate_multiple_milli:
            hour = now_ms // SPEND_BUCKET_MS
            # lua/lib.lua alert_velocity: over the hours since the oldest with spend
            history = [int(self.buckets.get((budget_id, hour - i), now_ms) or 0)
                       for i in range(1, VELOCITY_TRAILING_HOURS + 1)]
            trailing = sum(history)
            span = max((i + 1 for i, m in enumerate(history) if m), default=0)
            over = trailing > 0 and (spent * span * 3_600_000 * 1000
                                     > v.max_rate_multiple_milli * trailing * window_ms)
        if not over:
            return
        window = now_ms // window_ms
        if self.windows.get((budget_id, window), now_ms) is not None:
            return
        self.windows.put((budget_id, window), True, now_ms + 2 * window_ms)
        self._emit(VELOCITY, budget_id, f"velocity:{window * window_ms}", "", spent,
                   v.max_micros, now_ms)
        if v.pause:
            self.paused.setdefault(budget_id, now_ms)

    def refused(self, budget_id: str, window_key: str, ceiling_micros: int, committed_micros: int,
                resets_at_ms: int | None, now_ms: int) -> None:
        """lua/lib.lua alert_refused: the first budget_exceeded of a window."""
        self._prune(now_ms)
        marker = (budget_id, window_key, "exceeded")
        if self.markers.get(marker, now_ms) is not None:
            return
        self.markers.put(marker, True,
                         (resets_at_ms + COUNTER_RETENTION_MS) if resets_at_ms else 2**62)
        self._emit(EXCEEDED, budget_id, window_key, "", committed_micros, ceiling_micros, now_ms)

    # -- delivery, the log and the series (core.alerts.Outbox) -------------------------------

    def claim(self, tag: str, batch_max: int, lease_ms: int) -> list[AlertEvent]:
        now_ms = self._clock()
        self._prune(now_ms)
        box = self.outbox.get(tag, {})
        out: list[AlertEvent] = []
        for eid, due in sorted(box.items(), key=lambda x: x[1]):
            if len(out) >= batch_max or due > now_ms:
                break
            event = self.events.get(eid, now_ms)
            if event is None:
                del box[eid]
                continue
            box[eid] = now_ms + lease_ms
            out.append(event)
        return out

    def finish(self, event: AlertEvent, outcome: str, attempts: int, next_at_ms: int,
               last_error: str) -> None:
        now_ms = self._clock()
        found = self.events.get(event.event_id, now_ms)
        box = self.outbox.get(event.tag, {})
        if found is None:
            box.pop(event.event_id, None)
            return
        if outcome == "retry":
            self.events.put(event.event_id, replace(found, attempts=attempts,
                                                    last_error=last_error),
                            self.events.values[event.event_id][0])
            box[event.event_id] = next_at_ms
            return
        self.events.put(event.event_id, replace(found, attempts=attempts, last_error=last_error,
                                                state=outcome, done_ms=now_ms),
                        now_ms + ALERT_RETENTION_MS)
        box.pop(event.event_id, None)

    def log(self, tag: str, limit: int) -> list[AlertEvent]:
        now_ms = self._clock()
        self._prune(now_ms)
        found = [e for drop_at, e in self.events.values.values()
                 if e.tag == tag and drop_at > now_ms]
        return sorted(found, key=lambda e: (e.at_ms, e.event_id), reverse=True)[:limit]

    def series(self, budget_id: str, from_hour: int, to_hour: int) -> list[tuple[int, int]]:
        now_ms = self._clock()
        out = []
        for hour in range(from_hour, to_hour + 1):
            micros = int(self.buckets.get((budget_id, hour), now_ms) or 0)
            if micros:
                out.append((hour, micros))
        return out
