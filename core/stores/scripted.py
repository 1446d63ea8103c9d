"""ScriptedStore: the LedgerStore of every backend that runs the lua/ scripts.

The domain side (arguments, replies, ledger identity, time zones, probe) lives here once; a
Transport (redis-py, redis-py cluster, the Upstash REST SDK) only carries commands and translates
its client's exceptions into the core error tree.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

from core import output_stats
from core.budgets import BudgetDef, BudgetId, Limit, Period, windows_around
from core.errors import (
    BudgetNotFound,
    CeilingError,
    IdempotencyConflict,
    InvariantBroken,
    LedgerUnavailable,
    ReservationNotFound,
    ReservationResolved,
    ensure,
)
from core.ledger import (
    ROLES_OF_LEGACY_KEYS,
    STATE_CODES,
    Correction,
    KeyRecord,
    LegStatus,
    Probe,
    Release,
    Reservation,
    ReservationRef,
    ReservationView,
    ReserveRequest,
    Role,
    RunLimit,
    Settlement,
    refusal,
    resolved_replay,
    tag_digest,
)
from core.limits import (
    COUNTER_RETENTION_MS,
    INT_EXACT_MAX,
    RECLAIM_BATCH_MAX,
    RECORD_RETENTION_MS,
    RUN_COUNTER_IDLE_MS,
    TZ_CACHE_MAX,
    WINDOW_RETRIES_MAX,
)
from core.replies import ScriptedReplies
from core.stores import keys
from core.stores.scripts import Script, script

Clock = Callable[[], int]
"""Milliseconds since the epoch. Only tests inject one; in production the ledger uses Redis TIME."""

# An instance counts as live in health's `instances_seen` for this long after its last probe.
INSTANCE_SEEN_WINDOW_MS = 10 * 60_000
# The probe's value lives a minute: long enough to read back, short enough to leave no trace.
PROBE_TTL_MS = 60_000
LEG_FIELDS = 8


class Transport(Protocol):
    """Carries commands to one Redis-speaking backend. Raises only core errors."""

    backend: str

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        """EVALSHA, loading the script and retrying once when the server does not know it."""
        ...

    async def execute(self, *args: str) -> Any: ...

    async def durable(self) -> bool | None:
        """Whether the backend persists writes (AOF or RDB); None when it cannot be told."""
        ...

    async def close(self) -> None: ...


def _ledger_reset() -> LedgerUnavailable:
    return LedgerUnavailable(
        "the ledger's data is gone or was replaced (flushed, or restarted without persistence); "
        "enforcement is refused until an operator re-initialises it",
        reason="ledger_reset",
    )


def _roles(stored: str) -> frozenset[Role]:
    # A role this version does not know (a newer instance wrote it) grants nothing here.
    known = {r.value: r for r in Role}
    return frozenset(known[name] for name in stored.split(",") if name in known)


def _resolved(reservation_id: str, reply: Sequence[Any]) -> CeilingError:
    """{'resolved', st, outcome, amount_micros, charged_micros} as the error it stands for."""
    return resolved_replay(
        reservation_id, STATE_CODES[str(reply[1])], str(reply[2]), int(reply[3]), int(reply[4])
    )


def _legs(flat: Sequence[Any]) -> tuple[LegStatus, ...]:
    ensure(len(flat) % LEG_FIELDS == 0, "leg status comes in groups of 8")
    # Positional, in LegStatus' field order: every reserve parses one per leg, and keyword
    # arguments to a frozen dataclass cost a third more on this path.
    return tuple(
        LegStatus(
            str(bid), str(wkey), int(ceil), int(committed), int(reserved), int(overshoot),
            None if wkey == "total" else int(wend), int(allow),
        )
        for bid, wkey, ceil, committed, reserved, overshoot, wend, allow in zip(
            *(iter(flat),) * LEG_FIELDS, strict=True
        )
    )


class ScriptedStore:
    """A shared ledger on a Redis-speaking backend. See core.ledger.LedgerStore."""

    shared = True

    def __init__(self, transport: Transport, *, clock: Clock | None = None) -> None:
        self.backend = transport.backend
        self._t = transport
        self.replies = ScriptedReplies(transport)
        self._clock = clock
        self._ledger_id: str | None = None
        self._reset = False
        self._tz: dict[str, str] = {}
        self._offset_ms = 0
        # Per set of zones: the windows part of ARGV, and the span [from_ms, until_ms) it holds
        # for (the local day it was built for, in every zone).
        self._window_args: dict[tuple[str, ...], tuple[int, int, list[str]]] = {}

    # -- identity and time -------------------------------------------------------------

    async def open(self) -> str:
        if self._reset:
            raise _ledger_reset()
        if self._ledger_id is None:
            found = await self._t.execute("GET", keys.LEDGER_ID_KEY)
            if found is None:
                await self._t.execute("SET", keys.LEDGER_ID_KEY, uuid.uuid4().hex, "NX")
                found = await self._t.execute("GET", keys.LEDGER_ID_KEY)
            ensure(isinstance(found, str), "the ledger id is a string")
            self._ledger_id = str(found)
        return self._ledger_id

    async def _identity_lost(self) -> bool:
        """Called when a tag is not stamped with our ledger id: is the whole ledger gone?"""
        found = await self._t.execute("GET", keys.LEDGER_ID_KEY)
        if found != self._ledger_id:
            self._reset = True
        return self._reset

    def _now_arg(self) -> str:
        return str(self._clock()) if self._clock else ""

    def _now_estimate(self) -> int:
        if self._clock:
            return self._clock()
        return int(time.time() * 1000) + self._offset_ms

    def _learn_now(self, ledger_now_ms: int) -> None:
        if not self._clock:
            self._offset_ms = ledger_now_ms - int(time.time() * 1000)

    def _remember_tz(self, budget_id: str, tz: str) -> None:
        if len(self._tz) >= TZ_CACHE_MAX:
            self._tz.clear()
        self._tz[budget_id] = tz

    # -- scripts that need period windows ------------------------------------------------

    def _windows_arg(self, zones: tuple[str, ...], now_ms: int) -> list[str]:
        """The windows part of ARGV; rebuilt only when a local day passes in one of the zones."""
        cached = self._window_args.get(zones)
        if cached is not None and cached[0] <= now_ms < cached[1]:
            return cached[2]
        args = [str(len(zones))]
        from_ms, until_ms = 0, INT_EXACT_MAX
        for tz in zones:
            ws = windows_around(tz, now_ms)
            args += [tz, str(len(ws))]
            for w in ws:
                args += [w.key, str(w.start_ms), str(w.end_ms)]
            # The windows are a function of the local date alone: they hold all of that day.
            today = next(
                w for w in ws if w.period is Period.DAY and w.start_ms <= now_ms < w.end_ms
            )
            from_ms, until_ms = max(from_ms, today.start_ms), min(until_ms, today.end_ms)
        if len(self._window_args) >= TZ_CACHE_MAX:
            self._window_args.clear()
        self._window_args[zones] = (from_ms, until_ms, args)
        return args

    async def _run_windowed(
        self,
        op: Script,
        script_keys: Sequence[str],
        head: list[str],
        budget_ids: tuple[BudgetId, ...],
        run: RunLimit | None,
        now_ms: int | None = None,
    ) -> list[Any]:
        """Run a script that needs period windows; retry when it says our tz or clock was off."""
        now_ms = self._now_estimate() if now_ms is None else now_ms
        for _ in range(WINDOW_RETRIES_MAX + 1):
            zones = tuple(sorted({self._tz.get(b.path, "UTC") for b in budget_ids}))
            args = [*head, *self._windows_arg(zones, now_ms)]
            args.append(str(len(budget_ids) + (1 if run else 0)))
            for b in budget_ids:
                args += [b.path, self._tz.get(b.path, "UTC"), ""]
            if run:
                args += [run.budget_id.path, "UTC", str(run.ceiling_micros)]
            reply = await self._t.run(op, script_keys, args)
            if reply[0] == "tz":
                self._remember_tz(str(reply[1]), str(reply[2]))
            elif reply[0] == "clock":
                now_ms = int(reply[1])
            else:
                return list(reply)
        raise InvariantBroken("period windows did not match the ledger's time after retries")

    # -- the ledger operations -------------------------------------------------------------

    async def reserve(self, request: ReserveRequest) -> Reservation:
        ledger_id = await self.open()
        ref = request.ref
        ensure(all(b.tag == ref.tag for b in request.budget_ids), "one tag per reservation")
        head = [
            ledger_id,
            self._now_arg(),
            ref.reservation_id,
            ref.owner,
            request.fingerprint,
            str(request.amount_micros),
            str(request.ttl_ms),
            request.price_version,
            request.model,
            request.expire_policy,  # a StrEnum is its value; .value costs a descriptor call
            str(RECLAIM_BATCH_MAX),
            str(RECORD_RETENTION_MS),
            str(COUNTER_RETENTION_MS),
            str(RUN_COUNTER_IDLE_MS),
        ]
        reply = await self._run_windowed(
            script("reserve"),
            (keys.meta(ref.tag), keys.reservation(ref.tag, ref.reservation_id),
             keys.open_leases(ref.tag)),
            head,
            request.budget_ids,
            request.run,
        )
        kind = reply[0]
        if kind == "ok":
            now_ms = int(reply[4])
            self._learn_now(now_ms)
            return Reservation(
                reservation_id=str(reply[1]),
                reserved_micros=int(reply[2]),
                expires_at_ms=int(reply[3]),
                now_ms=now_ms,
                replayed=reply[5] == 1,
                legs=_legs(reply[6:]),
            )
        if kind in ("exceeded", "busy"):
            raise refusal(kind, _legs(reply[3:])[0], int(reply[1]))
        if kind == "resolved":
            raise _resolved(ref.reservation_id, reply)
        if kind == "conflict":
            raise IdempotencyConflict(
                "this reservation id was used with other parameters",
                reservation_id=ref.reservation_id,
            )
        if kind == "ledger_reset" and await self._identity_lost():
            raise _ledger_reset()
        raise BudgetNotFound(
            "no budget applies to this call", budget_id=request.budget_ids[-1].path
        )

    async def settle(self, ref: ReservationRef, actual_micros: int) -> Settlement:
        ledger_id = await self.open()
        reply = await self._t.run(
            script("settle"),
            (keys.meta(ref.tag), keys.reservation(ref.tag, ref.reservation_id),
             keys.open_leases(ref.tag)),
            [ledger_id, self._now_arg(), ref.reservation_id, ref.owner, str(actual_micros),
             str(RECORD_RETENTION_MS), str(RUN_COUNTER_IDLE_MS)],
        )
        kind = reply[0]
        if kind == "ok":
            return Settlement(
                charged_micros=int(reply[1]),
                released_micros=int(reply[2]),
                overshoot_micros=int(reply[3]),
                late=reply[4] == 1,
                replayed=reply[5] == 1,
            )
        if kind == "conflict":
            raise IdempotencyConflict(
                "this reservation was settled before with another amount",
                reservation_id=ref.reservation_id,
            )
        if kind == "released":
            raise ReservationResolved(
                "this reservation was released; it cannot be settled",
                reservation_id=ref.reservation_id,
            )
        await self._not_found(kind, ref)

    async def release(self, ref: ReservationRef) -> Release:
        ledger_id = await self.open()
        reply = await self._t.run(
            script("release"),
            (keys.meta(ref.tag), keys.reservation(ref.tag, ref.reservation_id),
             keys.open_leases(ref.tag)),
            [ledger_id, self._now_arg(), ref.reservation_id, ref.owner, str(RECORD_RETENTION_MS),
             str(RUN_COUNTER_IDLE_MS)],
        )
        kind = reply[0]
        if kind == "ok":
            return Release(released_micros=int(reply[1]), replayed=reply[2] == 1)
        if kind == "settled":
            raise ReservationResolved(
                "this reservation was settled; it cannot be released",
                reservation_id=ref.reservation_id,
            )
        await self._not_found(kind, ref)

    async def book(self, request: ReserveRequest, actual_micros: int, admitted_at_ms: int) -> bool:
        ledger_id = await self.open()
        ref = request.ref
        head = [
            ledger_id, str(admitted_at_ms), ref.reservation_id, ref.owner, request.fingerprint,
            str(request.amount_micros), str(actual_micros), request.price_version, request.model,
            str(RECORD_RETENTION_MS), str(COUNTER_RETENTION_MS), str(RUN_COUNTER_IDLE_MS),
            self._now_arg(),
        ]
        reply = await self._run_windowed(
            script("book"),
            (keys.meta(ref.tag), keys.reservation(ref.tag, ref.reservation_id)),
            head, request.budget_ids, request.run, now_ms=admitted_at_ms,
        )
        if reply[0] == "ok":
            return bool(reply[1] == 0)
        if reply[0] == "ledger_reset" and await self._identity_lost():
            raise _ledger_reset()
        raise BudgetNotFound("no budget applies to this journal entry")

    async def reservation(self, ref: ReservationRef) -> ReservationView | None:
        await self.open()
        st, owner, amt, exp, model, ver, charged, outcome = await self._t.execute(
            "HMGET", keys.reservation(ref.tag, ref.reservation_id),
            "st", "owner", "amt", "exp", "model", "ver", "charged", "outcome",
        )
        if st is None or owner != ref.owner:
            return None
        return ReservationView(
            ref.reservation_id, STATE_CODES[st], int(amt), int(exp), str(model or ""),
            str(ver or ""), None if charged is None else int(charged), str(outcome or ""),
        )

    async def inspect(self, tag: str, reservation_id: str) -> ReservationView | None:
        await self.open()
        (st, owner, amt, exp, model, ver, charged, outcome, created, resolved, by, at, from_,
         reason) = await self._t.execute(
            "HMGET", keys.reservation(tag, reservation_id),
            "st", "owner", "amt", "exp", "model", "ver", "charged", "outcome", "created_ms",
            "resolved_ms", "corrected_by", "corrected_at_ms", "corrected_from_micros",
            "correction_reason",
        )
        if st is None:
            return None

        def number(value: Any) -> int | None:
            return None if value is None else int(value)

        return ReservationView(
            reservation_id, STATE_CODES[st], int(amt), int(exp), str(model or ""),
            str(ver or ""), number(charged), str(outcome or ""), str(owner or ""),
            number(created), number(resolved), None if by is None else str(by), number(at),
            number(from_), None if reason is None else str(reason),
        )

    async def correct(
        self, tag: str, reservation_id: str, actual_micros: int, correction: Correction
    ) -> Settlement:
        ledger_id = await self.open()
        reply = await self._t.run(
            script("correct"),
            (keys.meta(tag), keys.reservation(tag, reservation_id), keys.open_leases(tag)),
            [ledger_id, self._now_arg(), reservation_id, str(actual_micros),
             correction.corrected_by, correction.reason, str(RECORD_RETENTION_MS),
             str(RUN_COUNTER_IDLE_MS)],
        )
        kind = reply[0]
        if kind == "ok":
            return Settlement(
                charged_micros=int(reply[1]),
                released_micros=int(reply[2]),
                overshoot_micros=int(reply[3]),
                late=reply[4] == 1,
                replayed=reply[5] == 1,
            )
        if kind == "resolved":
            raise _resolved(reservation_id, reply)
        if kind == "conflict":
            raise IdempotencyConflict(
                "this reservation was corrected before to another amount",
                reservation_id=reservation_id,
            )
        await self._not_found(kind, ReservationRef(tag, reservation_id, ""))

    async def tag_of(self, digest: str) -> str | None:
        await self.open()
        found = await self._t.execute("HGET", keys.TAG_MAP_KEY, digest)
        return None if found is None else str(found)

    async def _not_found(self, kind: str, ref: ReservationRef) -> NoReturn:
        if kind == "ledger_reset" and await self._identity_lost():
            raise _ledger_reset()
        raise ReservationNotFound(
            "no such reservation", reservation_id=ref.reservation_id
        )

    async def expire(self, tag: str, batch_max: int) -> int:
        ledger_id = await self.open()
        reply = await self._t.run(
            script("expire"),
            (keys.meta(tag), keys.open_leases(tag)),
            [ledger_id, self._now_arg(), str(batch_max), str(RECORD_RETENTION_MS),
             str(RUN_COUNTER_IDLE_MS)],
        )
        if reply[0] == "ok":
            return int(reply[1])
        if await self._identity_lost():
            raise _ledger_reset()
        return 0

    # -- budgets -----------------------------------------------------------------------

    async def put_budget(self, budget: BudgetDef) -> None:
        ledger_id = await self.open()
        bid = budget.budget_id
        await self._map_tag(bid.tag)
        args = [ledger_id, budget.timezone, str(budget.outage_allowance_micros)]
        for lim in budget.limits:
            args += [lim.period.value, str(lim.ceiling_micros)]
        reply = await self._t.run(
            script("put_budget"), (keys.meta(bid.tag), keys.definition(bid.tag, bid.path)), args
        )
        if reply[0] != "ok":
            self._reset = True
            raise _ledger_reset()
        self._remember_tz(bid.path, budget.timezone)

    async def _map_tag(self, tag: str) -> None:
        """Write the tag map entry that lets an operator find this tag's reservations by id.

        Before the budget itself, so every tag whose calls mint ids has one; writing it again
        is a no-op, so a repeated put_budget is safe."""
        digest = tag_digest(tag)
        if not await self._t.execute("HSETNX", keys.TAG_MAP_KEY, digest, tag):
            found = await self._t.execute("HGET", keys.TAG_MAP_KEY, digest)
            ensure(found == tag, f"the tags {found!r} and {tag!r} share a reservation-id digest")

    async def get_budget(self, budget_id: BudgetId) -> BudgetDef | None:
        await self.open()
        tz, allow, *ceils = await self._t.execute(
            "HMGET", keys.definition(budget_id.tag, budget_id.path),
            "tz", "allow", "ceil:day", "ceil:month", "ceil:total",
        )
        if tz is None:
            return None
        limits = tuple(
            Limit(p, int(c)) for p, c in zip(Period, ceils, strict=True) if c is not None
        )
        return BudgetDef(budget_id, limits, str(tz), int(allow))

    async def status(
        self, budget_ids: tuple[BudgetId, ...], run: RunLimit | None = None
    ) -> tuple[LegStatus, ...]:
        ledger_id = await self.open()
        if not budget_ids:
            return ()
        tag = budget_ids[0].tag
        ensure(all(b.tag == tag for b in budget_ids), "one tag per status read")
        reply = await self._run_windowed(
            script("status"), (keys.meta(tag),),
            [ledger_id, self._now_arg(), str(RUN_COUNTER_IDLE_MS)], budget_ids, run,
        )
        if reply[0] == "ok":
            self._learn_now(int(reply[1]))
            return _legs(reply[2:])
        if await self._identity_lost():
            raise _ledger_reset()
        return ()

    # -- output lengths ------------------------------------------------------------------

    async def observe_output(self, model: str, output_tokens: int) -> None:
        await self._t.run(
            script("observe"), (output_stats.model_key(model),),
            [str(output_stats.bucket(output_tokens)), str(output_stats.OBSERVATIONS_MAX),
             str(output_stats.HISTOGRAM_IDLE_MS)],
        )

    async def output_histogram(self, model: str) -> dict[int, int]:
        flat = await self._t.execute("HGETALL", output_stats.model_key(model))
        pairs = flat.items() if isinstance(flat, dict) else zip(flat[::2], flat[1::2], strict=True)
        return {int(k): int(v) for k, v in pairs if k != "n"}

    # -- API keys ------------------------------------------------------------------------

    async def put_key(self, record: KeyRecord) -> None:
        await self.open()
        await self._t.execute("SET", keys.api_key_id(record.key_id), record.key_hash)
        await self._t.execute(
            "HSET", keys.api_key(record.key_hash),
            "key_id", record.key_id,
            "budget_id", record.budget_id.path,
            "run", "" if record.run_ceiling_micros is None else str(record.run_ceiling_micros),
            "roles", ",".join(sorted(record.roles)),
        )

    async def get_key(self, key_hash: str) -> KeyRecord | None:
        await self.open()
        key_id, budget_id, run, roles = await self._t.execute(
            "HMGET", keys.api_key(key_hash), "key_id", "budget_id", "run", "roles"
        )
        if key_id is None:
            if await self._identity_lost():
                raise _ledger_reset()
            return None
        return KeyRecord(
            key_id=str(key_id),
            key_hash=key_hash,
            budget_id=BudgetId(str(budget_id)),
            run_ceiling_micros=int(run) if run else None,
            roles=ROLES_OF_LEGACY_KEYS if roles is None else _roles(str(roles)),
        )

    async def delete_key(self, key_id: str) -> bool:
        await self.open()
        key_hash = await self._t.execute("GET", keys.api_key_id(key_id))
        if key_hash is None:
            return False
        # The record that authenticates goes first: from here on the key is refused.
        await self._t.execute("DEL", keys.api_key(str(key_hash)))
        await self._t.execute("DEL", keys.api_key_id(key_id))
        return True

    # -- health --------------------------------------------------------------------------

    async def probe(self, instance_id: str) -> Probe:
        reasons: list[str] = []
        try:
            ledger_id = await self.open()
            started = time.perf_counter()
            found = await self._t.execute("GET", keys.LEDGER_ID_KEY)
            latency_ms = round((time.perf_counter() - started) * 1000, 3)
            if found != ledger_id:
                self._reset = True
                raise _ledger_reset()
            token = uuid.uuid4().hex
            await self._t.execute("SET", keys.probe(instance_id), token, "PX", str(PROBE_TTL_MS))
            if await self._t.execute("GET", keys.probe(instance_id)) != token:
                reasons.append("ledger_not_shared")
            seconds, micros = await self._t.execute("TIME")
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            await self._t.execute("ZADD", keys.INSTANCES_KEY, str(now_ms), instance_id)
            await self._t.execute(
                "ZREMRANGEBYSCORE", keys.INSTANCES_KEY, "-inf",
                str(now_ms - INSTANCE_SEEN_WINDOW_MS),
            )
            # Gone once no instance has probed for the window (instances of a serverless
            # deployment come and go; their ids must not pile up).
            await self._t.execute("PEXPIRE", keys.INSTANCES_KEY, str(INSTANCE_SEEN_WINDOW_MS))
            seen = int(await self._t.execute("ZCARD", keys.INSTANCES_KEY))
            durable = await self._t.durable()
        except CeilingError as exc:
            reason = exc.reason if isinstance(exc, LedgerUnavailable) else "ledger_unreachable"
            reachable = reason not in ("ledger_unreachable", "ledger_auth")
            return Probe(
                self.backend, self.shared, reachable, None,
                self._ledger_id, None, (reason,), None,
            )
        if durable is False:
            reasons.append("ledger_not_durable")
        return Probe(
            self.backend, self.shared, True, latency_ms, ledger_id, durable, tuple(reasons), seen
        )

    async def close(self) -> None:
        await self._t.close()
