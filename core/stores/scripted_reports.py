"""What ScriptedStore (core/stores/scripted.py) reports back: output lengths, the alert outbox,
and reconciliation's reads and alerts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import date
from typing import Any

from core import alerts, output_stats
from core.budgets import BudgetId
from core.errors import BudgetNotFound, InvalidRequest, InvariantBroken
from core.ledger import DriftEvent, UnseenBooked, Upstream, day_index, day_of_index
from core.limits import DAILY_SPEND_DAYS_MAX, DAILY_SPEND_RETENTION_MS
from core.stores import keys, wire
from core.stores.scripted_core import ScriptedCore, ledger_reset
from core.stores.scripts import script


class ScriptedReports(ScriptedCore):
    """What the ledger reports back (core/ledger.py): output lengths (OutputStats), the alert
    outbox (AlertOutbox), and the spend and drift alerts of reconciliation (Reconciliation)."""

    # -- output lengths ------------------------------------------------------------------------

    async def observe_output(self, model: str, output_tokens: int) -> None:
        await self._t.run(
            script("observe"), (keys.output_lengths(model),),
            [str(output_stats.bucket(output_tokens)), str(output_stats.OBSERVATIONS_MAX),
             str(output_stats.HISTOGRAM_IDLE_MS)],
        )

    async def output_histogram(self, model: str) -> dict[int, int]:
        flat = await self._t.execute("HGETALL", keys.output_lengths(model))
        pairs = flat.items() if isinstance(flat, dict) else zip(flat[::2], flat[1::2], strict=True)
        return {int(k): int(v) for k, v in pairs if k != "n"}

    # -- alerts --------------------------------------------------------------------------------

    async def alert_tags(self) -> list[str]:
        """Every tag that has budgets (the tag map put_budget writes): where outboxes can be."""
        await self.open()
        found = await self._t.execute("HVALS", keys.TAG_MAP_KEY)
        return sorted({str(t) for t in found} | {keys.LEDGER_EVENTS_TAG})

    def _events(self, tag: str, reply: Sequence[Any]) -> list[alerts.AlertEvent]:
        out = []
        for flat in reply:
            if isinstance(flat, dict):
                fields = {str(k): str(v) for k, v in flat.items()}
            else:
                fields = {str(k): str(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}
            out.append(alerts.AlertEvent.from_fields(tag, fields))
        return out

    async def claim_alerts(self, tag: str, batch_max: int, lease_ms: int
                           ) -> list[alerts.AlertEvent]:
        reply = await self._t.run(
            script("alert_claim"), (keys.outbox(tag),),
            [str(batch_max), str(lease_ms), *([self._now_arg()] if self._clock else [])])
        return self._events(tag, reply)

    async def finish_alert(self, event: alerts.AlertEvent, outcome: str, attempts: int,
                           next_at_ms: int, last_error: str) -> None:
        await self._t.run(
            script("alert_done"),
            (keys.outbox(event.tag), keys.alert(event.tag, event.event_id)),
            [event.event_id, outcome, str(attempts), str(next_at_ms), last_error,
             *([self._now_arg()] if self._clock else [])])

    async def alert_log(self, tag: str, limit: int) -> list[alerts.AlertEvent]:
        reply = await self._t.run(
            script("alert_log"), (keys.alert_log(tag),),
            [str(limit), *([self._now_arg()] if self._clock else [])])
        return self._events(tag, reply)

    async def spend_series(self, budget_id: BudgetId, from_hour: int, to_hour: int
                           ) -> list[tuple[int, int]]:
        """(hour index, committed micros booked in it) for every hour in [from_hour, to_hour]
        with spend: the hourly buckets the ledger keeps (SPEND_BUCKET_MS)."""
        hours = list(range(from_hour, to_hour + 1))
        if not hours:
            return []
        found = await self._t.execute(
            "MGET", *(keys.spend(budget_id.tag, budget_id.path, h) for h in hours))
        return [(h, int(v)) for h, v in zip(hours, found, strict=True) if v not in (None, "0")]

    # -- reconciliation ------------------------------------------------------------------------

    async def _budget_tags(self) -> list[str]:
        await self.open()
        return sorted({str(t) for t in await self._t.execute("HVALS", keys.TAG_MAP_KEY)})

    async def _by_day(self, first_day: date, last_day: date, key_of: Callable[[str, date], str],
                      tags: Sequence[str] | None = None) -> dict[date, int]:
        """The sum over every tag (or `tags`) of the integer under `key_of(tag, day)`, for each
        day in [first_day, last_day] where it is not zero."""
        days = [day_of_index(d) for d in range(day_index(first_day), day_index(last_day) + 1)]
        if len(days) > DAILY_SPEND_DAYS_MAX:
            raise InvalidRequest(
                f"at most {DAILY_SPEND_DAYS_MAX} days at a time: the ledger keeps a day's spend "
                "that long", field="from")
        total = dict.fromkeys(days, 0)
        for tag in (await self._budget_tags() if tags is None else tags) if days else []:
            found = await self._t.execute("MGET", *(key_of(tag, d) for d in days))
            for d, value in zip(days, found, strict=True):
                if value is not None:
                    total[d] += int(value)
        return {d: micros for d, micros in total.items() if micros}

    async def gateway_spend_by_day(self, upstream: Upstream, first_day: date, last_day: date
                                   ) -> dict[date, int]:
        return await self._by_day(first_day, last_day, lambda tag, day: keys.daily_spend(
            tag, upstream.value, day_index(day)))

    async def emit_drift_alert(self, event: DriftEvent) -> bool:
        reply = await self._t.run(
            script("drift_alert"), (keys.meta(keys.LEDGER_EVENTS_TAG),),
            wire.arguments(wire.DRIFT_ARGS, provider=event.provider.value,
                           day=event.day.isoformat(), ledger_micros=str(event.ledger_micros),
                           provider_micros=str(event.provider_micros), now_ms=self._now_arg()),
        )
        return int(reply) == 1

    async def unseen_booked_by_day(self, upstream: Upstream, first_day: date, last_day: date,
                                   tag: str | None = None) -> dict[date, int]:
        tags = None if tag is None else [tag]
        return await self._by_day(first_day, last_day, lambda t, day: keys.unseen_booked(
            t, upstream.value, day.isoformat()), tags)

    async def book_unseen(self, budget_id: BudgetId, upstream: Upstream, day: date,
                          unseen_micros: int) -> UnseenBooked:
        ledger_id = await self.open()
        tag, day_text = budget_id.tag, day.isoformat()
        reply = await self._run_windowed(
            script("book_unseen"),
            (keys.meta(tag), keys.unseen_booked(tag, upstream.value, day_text)),
            {"ledger_id": ledger_id, "user": "", "provider": upstream.value, "day": day_text,
             "unseen_micros": str(unseen_micros)},
            budget_id.lineage, None)
        if reply[0] == "ok":
            return UnseenBooked(int(reply[1]), int(reply[2]))
        if reply[0] == "ledger_reset":
            raise ledger_reset(tag)
        if reply[0] == "no_budget":
            raise BudgetNotFound(
                f"no budget {budget_id.path} to book {upstream}'s unseen spend into",
                budget_id=budget_id.path, field="book_into")
        raise InvariantBroken(f"book_unseen answered {reply[0]!r}")

    async def take_booking_lease(self, upstream: Upstream, token: str, ttl_ms: int) -> bool:
        await self.open()
        taken = await self._t.execute("SET", keys.booking_lease(upstream.value), token, "NX",
                                      "PX", str(ttl_ms))
        return taken is not None and str(taken) in ("OK", "True", "1")

    async def end_booking_lease(self, upstream: Upstream, token: str) -> None:
        await self._t.run(script("lease_end"), (keys.booking_lease(upstream.value),), [token])

    async def unseen_audited(self, tag: str, upstream: Upstream, days: Sequence[date]
                             ) -> dict[date, int]:
        if not days:
            return {}
        found = await self._t.execute("MGET", *(keys.unseen_audited(
            tag, upstream.value, d.isoformat()) for d in days))
        return {d: int(v) for d, v in zip(days, found, strict=True) if v is not None}

    async def audit_unseen_booked(self, tag: str, upstream: Upstream, day: date, was_micros: int,
                                  total_micros: int, fields: dict[str, str], retention_ms: int
                                  ) -> bool:
        written = await self._t.run(
            script("audit_booked"),
            (keys.AUDIT_KEY, keys.unseen_audited(tag, upstream.value, day.isoformat())),
            [str(was_micros), str(total_micros), str(DAILY_SPEND_RETENTION_MS), str(retention_ms),
             *(x for kv in fields.items() for x in kv)])
        return int(written) == 1

    async def refusal_counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for tag in await self._budget_tags():
            found = await self._t.execute("HGETALL", keys.refused(tag))
            pairs = found.items() if isinstance(found, dict) else zip(
                found[::2], found[1::2], strict=True)
            for code, count in pairs:
                total[str(code)] = total.get(str(code), 0) + int(count)
        return total
