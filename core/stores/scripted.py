"""ScriptedStore: the LedgerStore of every backend that runs the lua/ scripts.

The domain side (arguments, replies, ledger identity, time zones, probe) lives here once, with
the Lua boundary's names in core/stores/wire.py; a Transport (redis-py, redis-py cluster, the
Upstash REST SDK) only carries commands and translates its client's exceptions into the core
error tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import date
from typing import Any, NoReturn, Protocol

from core import alerts, output_stats
from core.budgets import USER_SCOPE_KIND, BudgetDef, BudgetId, Limit, Period, window_at
from core.errors import (
    BudgetNotFound,
    BudgetPaused,
    CeilingError,
    ConcurrencyLimited,
    IdempotencyConflict,
    InvalidRequest,
    InvariantBroken,
    LedgerUnavailable,
    RateLimited,
    ReservationNotFound,
    ReservationResolved,
    UserRequired,
    UsersExhausted,
    ensure,
    state_quota,
)
from core.ledger import (
    ROLES_OF_KEYS_BEFORE_ROLES,
    Claim,
    ClaimKind,
    Correction,
    DriftEvent,
    Kept,
    KeyRecord,
    LegStatus,
    OpenHold,
    OpenLeases,
    Probe,
    Release,
    ReplyRef,
    Reservation,
    ReservationRef,
    ReservationView,
    ReserveRequest,
    Role,
    RunLimit,
    RunSpend,
    Settlement,
    StoredReply,
    Upstream,
    UsersPage,
    UserSpend,
    day_index,
    day_of_index,
    refusal,
    resolved_replay,
    tag_digest,
)
from core.lifecycle import Event
from core.limits import DAILY_SPEND_DAYS_MAX, INT_EXACT_MAX, TZ_CACHE_MAX, WINDOW_RETRIES_MAX
from core.stores import keys, wire
from core.stores.durability import NOT_REPLICATED, ROLLED_BACK, Durability
from core.stores.scripts import Script, library, prune_libraries, script

Clock = Callable[[], int]
"""Milliseconds since the epoch. Only tests inject one; in production the ledger uses Redis TIME."""
Acknowledging = Callable[[Script, Sequence[str], Sequence[str]], Awaitable[tuple[Any, bool]]]
"""Runs a script and says whether the replicas the deployment asks for acknowledged its writes
(core/stores/redis.py, CEILING_REDIS_WAIT_REPLICAS)."""

# An instance counts as live in health's `instances_seen` for this long after its last probe.
INSTANCE_SEEN_WINDOW_MS = 10 * 60_000
# The probe's value lives a minute: long enough to read back, short enough to leave no trace.
PROBE_TTL_MS = 60_000
# An instance that found its ledger reset looks for an operator's adoption of a restored ledger
# (`ceiling ledger adopt`) at most this often: two reads a second while it refuses every call.
ADOPT_CHECK_INTERVAL_MS = 1_000
# An instance reads whether another found the ledger rolled back (or an operator adopted it) at
# most this often while it serves: one MGET a second, on the call that comes due, so that a
# rollback another instance found stops this one within a second, not at its next health probe.
ROLLBACK_CHECK_INTERVAL_MS = 1_000
# A key's last use is written when the stored one is older than this: at most one write a minute
# per key and instance, on the key check the key-trust window (core/service.py KEY_TRUST_MS)
# already makes rare, never on the reserve script. Operators read "last used" to find idle keys,
# which a minute's resolution answers.
KEY_LAST_USED_RESOLUTION_MS = 60_000
# What get_key reads of the entry under a secret's hash (core/stores/keys.py api_key), for a
# secret minted before secrets carried their key id: which key it leads to, whether it only
# leads there ('index_only'), and the fields of a key of the layout before records were by id.
# Such keys were given to users, so they keep working; an entry put before fields had Python
# names keeps its run ceiling under 'run'.
HASH_ONLY_KEY_FIELDS = ("key_id", "index_only", "budget_id", "run_ceiling_micros", "run", "roles",
                        "last_used_ms")
# Budget paths whose ledger form (their ids, joined) a process remembers; bounded because paths
# come from keys.
PATHS_CACHE_MAX = 10_000
# Tags whose reserve sequence (lua/lib.lua hold: the meta hash's 'seq') an instance remembers to
# notice a ledger that went back in time; the oldest is forgotten past this. Each is a short
# string and an int, about 150 B: 1.5 MB at most. A tag it forgot is checked again from its next
# reserve on.
SEQUENCES_REMEMBERED_MAX = 10_000
# The tags a health probe reads the sequence of (the most recently reserved), to notice a
# rollback on tags no call reached since: pipelined reads, bounded so a probe stays one burst.
SEQUENCES_PROBED_MAX = 32
# A page of a budget's end users (users_of) reads each user's legs with a status script of its
# own: at most this many at once, so that a page goes out in a few pipelined writes rather than
# one round trip after another, and the calls the instance serves meanwhile are not queued
# behind all of the page's reads.
USER_READS_IN_FLIGHT_MAX = 16
# The backends whose transports call the library's functions (FCALL), where other versions'
# libraries pile up (core/stores/scripts.py prune_libraries): the cluster's transport runs each
# operation as a script of its own, and the memory store's Redis is its process's alone.
LIBRARY_BACKENDS = frozenset({"redis", "upstash"})


def _holds(flat: Sequence[Any]) -> tuple[OpenHold, ...]:
    """open_listing.lua's {id, packed record, ...} as the protocol lists them."""
    out = []
    for rid, packed in zip(flat[::2], flat[1::2], strict=True):
        rec = wire.StoredRecord.unpacked(str(packed))
        legs = [leg.split(wire.PART_SEPARATOR) for leg in rec.legs.split(wire.ITEM_SEPARATOR)
                if leg]
        budgets = tuple(dict.fromkeys(p[0] for p in legs if p[-1] != "run"))
        run = next((p[0] for p in legs if p[-1] == "run"), None)
        out.append(OpenHold(str(rid), rec.owner, budgets, run, int(rec.reserved_micros),
                            int(rec.created_ms) if rec.created_ms else None,
                            int(rec.expires_at_ms)))
    return tuple(out)


def _runs(flat: Sequence[Any]) -> tuple[RunSpend, ...]:
    """open_listing.lua's {budget_id, ceiling, committed, reserved, seen_ms, ...}."""
    return tuple(
        RunSpend(str(flat[i]), int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]),
                 int(flat[i + 4]) if str(flat[i + 4]) else None)
        for i in range(0, len(flat), 5))


class Transport(Protocol):
    """Carries commands to one Redis-speaking backend. Raises only core errors."""

    backend: str

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        """EVALSHA, loading the script and retrying once when the server does not know it."""
        ...

    async def execute(self, *args: str) -> Any: ...

    async def durability(self) -> Durability:
        """What the backend says (INFO) of keeping writes: persistence, eviction, its identity."""
        ...

    async def close(self) -> None: ...


def _ledger_reset(tag: str | None = None) -> LedgerUnavailable:
    if tag is not None:
        return LedgerUnavailable(
            f"the ledger's data for {tag} is gone (its Redis Cluster shard was wiped or "
            "replaced); enforcement is refused for it until an operator restores the ledger "
            "(`ceiling ledger restore`)",
            reason="ledger_reset", organisation=tag,
        )
    return LedgerUnavailable(
        "the ledger's data is gone or was replaced (flushed, or restarted without persistence); "
        "enforcement is refused until an operator restores it (`ceiling ledger restore`, then "
        "`ceiling ledger adopt`)",
        reason="ledger_reset",
    )


def _rolled_back(token: str) -> LedgerUnavailable:
    # The token names the tag it was found on, an organisation: the message goes to any key
    # holder, so it names only when (its first field); operators read the rest in the ledger.
    found_at_ms = token.split(" ", 1)[0]
    return LedgerUnavailable(
        "the ledger went back in time: a reserve sequence came back below one this fleet was "
        f"answered (found at {found_at_ms} ms), so spend it acknowledged is gone (a failover "
        "to a replica that lagged, or a restart from an older snapshot); enforcement is refused "
        "until an operator adopts the ledger as it is (`ceiling ledger adopt`), or restores it "
        "and adopts that",
        reason=ROLLED_BACK,
    )


def _format_unknown(version: str) -> LedgerUnavailable:
    return LedgerUnavailable(
        f"the ledger was written by another format version ({version}; this instance reads "
        f"version {wire.LEDGER_FORMAT_VERSION}); enforcement is refused until it is served by "
        "a version of spend-ceiling that reads it",
        reason="ledger_reset",
    )


def _readable(version: Any) -> bool:
    """Whether this version's scripts read a ledger stamped with format `version`.

    A ledger with no stamp was made before ledgers were stamped, by code that wrote exactly what
    version 1 is (the stamp is all this version added): it is version 1. It is not stamped when
    opened either, since that would tell a later version nothing: a later version may meet a
    ledger no instance of this one opened, and must read a missing stamp as 1 all the same."""
    return version is None or str(version) == str(wire.LEDGER_FORMAT_VERSION)


_LIMIT_REFUSALS = ("user_required", "users_exhausted", "rate_limited", "concurrency_limited")


def _limit_refusal(kind: str, reply: Sequence[Any], user: str | None) -> CeilingError:
    """reserve.lua's refusal by a budget's end users or rates, naming the budget."""
    budget_id = str(reply[1])
    if kind == "user_required":
        return UserRequired(
            f"budget {budget_id!r} holds each end user to its own limits: name the call's user "
            "(X-Ceiling-User, or the provider's user field through the gateway)",
            budget_id=budget_id)
    if kind == "users_exhausted":
        return UsersExhausted(
            f"budget {budget_id!r} counts as many end users as its per_user users_max allows; "
            f"user {user!r} is not one of them", budget_id=budget_id, user=user)
    retry_after_s = int(reply[2])
    if kind == "rate_limited":
        return RateLimited(
            f"budget {budget_id!r} admitted all the requests its rate allows in the last minute",
            budget_id=budget_id, retry_after_s=retry_after_s)
    return ConcurrencyLimited(
        f"budget {budget_id!r} has all the calls open at once its rate allows",
        budget_id=budget_id, retry_after_s=retry_after_s)


def _paused(budget_id: str) -> BudgetPaused:
    return BudgetPaused(
        f"budget {budget_id} was paused by its velocity alarm; an operator resumes it "
        "(ceiling budgets resume)", budget_id=budget_id)


def _roles(stored: str) -> frozenset[Role]:
    # A role this version does not know (a newer instance wrote it) grants nothing here.
    known = {r.value: r for r in Role}
    return frozenset(known[name] for name in stored.split(",") if name in known)


def _resolved(reservation_id: str, reply: Sequence[Any]) -> CeilingError:
    """The error a repeat of a resolved reservation stands for."""
    found = wire.resolved(reply)
    return resolved_replay(reservation_id, found.state, found.outcome, found.reserved_micros,
                           found.charged_micros)


class ScriptedReplies:
    """ReplyStore on a Redis-speaking backend, through the transport its ledger store uses."""

    def __init__(self, transport: Transport) -> None:
        self._t = transport

    async def claim(self, ref: ReplyRef, fingerprint: str, token: str, ttl_ms: int) -> Claim:
        reply = await self._t.run(
            script("reply_claim"),
            (keys.reply(ref.tag, ref.digest), keys.quota(ref.tag, ref.owner)),
            [fingerprint, token, str(ttl_ms)],
        )
        if reply[0] == "state_quota":
            raise state_quota(str(reply[1]), int(reply[2]))
        kind = ClaimKind(reply[0])
        if kind is not ClaimKind.DONE:
            return Claim(kind)
        headers = tuple((str(k), str(v)) for k, v in json.loads(reply[2]))
        return Claim(kind, StoredReply(int(reply[1]), headers, str(reply[3])))

    async def complete(self, ref: ReplyRef, token: str, reply: StoredReply, ttl_ms: int,
                       *, counted: bool = True) -> Kept:
        result = await self._t.run(
            script("reply_complete"),
            (keys.reply(ref.tag, ref.digest), keys.quota(ref.tag, ref.owner)),
            [token, str(reply.status), json.dumps(reply.headers), reply.body, str(ttl_ms),
             "1" if counted else "0"],
        )
        return Kept(result[0])

    async def abandon(self, ref: ReplyRef, token: str) -> None:
        await self._t.run(script("reply_abandon"), (keys.reply(ref.tag, ref.digest),), [token])


class ScriptedStore:
    """A shared ledger on a Redis-speaking backend. See core.ledger.LedgerStore."""

    shared = True

    def __init__(self, transport: Transport, *, clock: Clock | None = None,
                 acknowledging: Acknowledging | None = None, replicas_required: int = 0
                 ) -> None:
        self.backend = transport.backend
        self._t = transport
        self.replies = ScriptedReplies(transport)
        self._clock = clock
        self._ledger_id: str | None = None
        self._reset = False
        # The format version of the ledger found when this instance stopped enforcing because it
        # cannot read that format (`_readable`); None for a reset of any other kind.
        self._format_refused: str | None = None
        self._tz: dict[str, str] = {}
        self._offset_ms = 0
        # Per set of zones: the zones field, and the span [from_ms, until_ms) it holds for (the
        # local day it was built for, in every zone).
        self._zones: dict[tuple[str, ...], tuple[int, int, str]] = {}
        self._paths: dict[tuple[BudgetId, ...], str] = {}
        self._adopt_checked_s = -float("inf")
        # Durability (docs/guarantees.md "Faults"): how a reserve is run when replicas must
        # acknowledge it; the highest reserve sequence seen per tag; the rollback this instance
        # refuses for (its token), and the last rollback adoption it knows of; the server it
        # last probed (INFO run_id and replication id).
        self._acknowledging = acknowledging
        self._replicas_required = replicas_required
        self._sequences: dict[str, int] = {}
        self._rolled_back: str | None = None
        self._rollback_adopted: str | None = None
        self._server_id: str | None = None
        self._rollback_checked_s = -float("inf")

    @property
    def transport(self) -> Transport:
        """The backend's commands, for the operators' catalogue (core/stores/operations.py)."""
        return self._t

    # -- identity and time -------------------------------------------------------------

    async def open(self) -> str:
        if self._reset and not await self._adopt():
            raise self._refusal()
        now_s = time.monotonic()
        if (now_s - self._rollback_checked_s) * 1000 >= ROLLBACK_CHECK_INTERVAL_MS:
            self._rollback_checked_s = now_s
            await self._stamp()  # another instance's finding, or an operator's adoption
        if self._rolled_back is not None:
            raise _rolled_back(self._rolled_back)
        if self._ledger_id is None:
            found, version = await self._stamp()
            if found is None:
                # A new ledger: its format version first, so that no instance finds the id
                # without it. Of instances of two versions making it at once, the first to write
                # the version decides it, and the other refuses the ledger below.
                await self._t.execute("SET", keys.LEDGER_FORMAT_KEY,
                                      str(wire.LEDGER_FORMAT_VERSION), "NX")
                await self._t.execute("SET", keys.LEDGER_ID_KEY, uuid.uuid4().hex, "NX")
                found, version = await self._stamp()
            ensure(isinstance(found, str), "the ledger id is a string")
            if not _readable(version):
                self._reset, self._format_refused = True, str(version)
                raise self._refusal()
            self._ledger_id = str(found)
            if self.backend in LIBRARY_BACKENDS:
                # Housekeeping: one that fails leaves its work to the next version's first
                # instance, and fails no call.
                with contextlib.suppress(LedgerUnavailable):
                    await prune_libraries(self._t.execute, library().name, self.ledger_time_ms)
        return self._ledger_id

    async def _stamp(self, *more: str) -> list[Any]:
        """The ledger id and its format version (None: not stamped), then the values of `more`
        keys of the catalogue: one read, all of them in the ledger id's slot. Learns from the
        same read whether the fleet found the ledger rolled back (`_rollback_seen`)."""
        found = list(await self._t.execute(
            "MGET", keys.LEDGER_ID_KEY, keys.LEDGER_FORMAT_KEY, *more, keys.ROLLED_BACK_KEY,
            keys.ROLLBACK_ADOPTED_KEY))
        self._rollback_seen(found[-2], found[-1])
        return found[:-2]

    def _rollback_seen(self, detected: Any, adopted: Any) -> None:
        """A rollback the fleet found and no operator adopted is refused here too; an adoption
        this instance has not seen makes it forget its sequences (those of the ledger before)."""
        adopted = None if adopted is None else str(adopted)
        if adopted != self._rollback_adopted:
            self._rollback_adopted, self._sequences = adopted, {}
            if self._rolled_back is not None and self._rolled_back == adopted:
                self._rolled_back = None
        if detected is not None and str(detected) != adopted:
            self._rolled_back = str(detected)

    async def _went_back(self, tag: str, sequence: int, floor: int,
                         seen: dict[str, int]) -> NoReturn:
        """A tag's sequence came back at or below one this instance saw acknowledged before the
        call began: the ledger lost writes. Unless an operator adopted a rollback since (then
        what this instance remembers is of the ledger before it), the fleet is told and every
        call is refused until an operator adopts the ledger."""
        await self._stamp()  # an adoption since forgets the sequences; a rollback found is kept
        if self._rolled_back is None and self._sequences is seen:
            token = f"{self._now_estimate()} {tag} {sequence} {floor}"
            with contextlib.suppress(LedgerUnavailable):
                await self._t.execute("SET", keys.ROLLED_BACK_KEY, token)
            self._rolled_back = token
        if self._rolled_back is not None:
            raise _rolled_back(self._rolled_back)
        raise LedgerUnavailable(
            "the ledger's rollback was adopted while this call ran; send it again",
            reason=ROLLED_BACK)

    def _saw(self, tag: str, sequence: int) -> None:
        if len(self._sequences) >= SEQUENCES_REMEMBERED_MAX and tag not in self._sequences:
            del self._sequences[next(iter(self._sequences))]  # the oldest
        if sequence > self._sequences.get(tag, 0):
            self._sequences[tag] = sequence

    def _refusal(self) -> LedgerUnavailable:
        """What a call is refused with once this instance stopped enforcing (`_reset`)."""
        if self._format_refused is not None:
            return _format_unknown(self._format_refused)
        return _ledger_reset()

    async def _adopt(self) -> bool:
        """Whether an operator confirmed a restored ledger since this instance found its own
        reset; if so, it enforces against the restored one from now on, without a restart. A
        ledger id alone is never adopted: an empty Redis gets a fresh one from the first instance
        that opens it, and enforcing against that would serve refilled budgets."""
        now_s = time.monotonic()
        if (now_s - self._adopt_checked_s) * 1000 < ADOPT_CHECK_INTERVAL_MS:
            return False
        self._adopt_checked_s = now_s
        found, version, adopted = await self._stamp(keys.ADOPTED_KEY)
        if found is None or found != adopted or found == self._ledger_id:
            return False
        if not _readable(version):
            self._format_refused = str(version)
            return False
        self._sequences = {}  # of the ledger before the restore
        self._ledger_id, self._reset, self._format_refused = str(found), False, None
        return True

    async def _org_lost(self, tag: str) -> bool:
        """Whether one organisation's data is gone while the ledger id survived: a Redis Cluster
        shard wiped or replaced. The catalogue, on the ledger id's shard, still names the
        organisation; its own meta hash no longer carries the ledger id."""
        if await self._t.execute("HGET", keys.ORGS_KEY, tag) is None:
            return False
        return bool(await self._t.execute("HGET", keys.meta(tag), "ledger") != self._ledger_id)

    async def _identity_lost(self) -> bool:
        """Called when a tag is not stamped with our ledger id, or a reservation is not found:
        is the whole ledger gone (or stamped with a format version this one cannot read)?"""
        found, version = await self._stamp()
        if not _readable(version):
            self._format_refused = str(version)
        if found != self._ledger_id or not _readable(version):
            self._reset = True
        return self._reset

    def now_arg(self) -> str:
        """now_ms for a script: '' (Redis TIME) unless a test injected a clock."""
        return self._now_arg()

    def now_estimate(self) -> int:
        """The ledger's time as this instance last learnt it, in ms."""
        return self._now_estimate()

    def use_ledger(self, ledger_id: str) -> None:
        """Enforce against `ledger_id` from now on: the one a restore made here just stamped."""
        self._ledger_id, self._reset, self._sequences = ledger_id, False, {}

    async def read_record(self, tag: str, reservation_id: str) -> wire.StoredRecord | None:
        return await self._read(tag, reservation_id)

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

    def _zones_field(self, zones: tuple[str, ...], now_ms: int) -> str:
        """The windows that hold `now_ms` in each zone; rebuilt only when a local day passes in
        one of them."""
        cached = self._zones.get(zones)
        if cached is not None and cached[0] <= now_ms < cached[1]:
            return cached[2]
        entries = []
        from_ms, until_ms = 0, INT_EXACT_MAX
        for tz in zones:
            day, week, month = (window_at(tz, p, now_ms)
                                for p in (Period.DAY, Period.WEEK, Period.MONTH))
            assert day is not None
            assert week is not None
            assert month is not None
            entries.append(wire.zone_entry(tz, day, week, month))
            # A week's and a month's window hold their days: the entries hold for all of this
            # local day.
            from_ms, until_ms = max(from_ms, day.start_ms), min(until_ms, day.resets_at_ms)
        field = wire.items(entries)
        if len(self._zones) >= TZ_CACHE_MAX:
            self._zones.clear()
        self._zones[zones] = (from_ms, until_ms, field)
        return field

    def _path(self, budget_ids: tuple[BudgetId, ...]) -> str:
        found = self._paths.get(budget_ids)
        if found is None:
            if len(self._paths) >= PATHS_CACHE_MAX:
                self._paths.clear()
            found = self._paths[budget_ids] = wire.items(b.path for b in budget_ids)
        return found

    async def _run_windowed(
        self,
        op: Script,
        script_keys: Sequence[str],
        fields: dict[str, str],
        budget_ids: tuple[BudgetId, ...],
        run: RunLimit | None,
        now_ms: int | None = None,
    ) -> list[Any]:
        """Run a script that needs period windows; ask again when it says the zones or the
        time the windows were made for were not the ledger's."""
        now_ms = self._now_estimate() if now_ms is None else now_ms
        fields["budget_ids"] = self._path(budget_ids)
        fields["run"] = wire.run_field(run.budget_id.path, run.ceiling_micros) if run else ""
        fields[wire.NOW] = self._now_arg()
        shape = {"reserve": wire.RESERVE_ARGS, "book": wire.BOOK_ARGS,
                 "status": wire.STATUS_ARGS}[op.name]
        for _ in range(WINDOW_RETRIES_MAX + 1):
            zones = tuple(sorted({self._tz.get(b.path, "UTC") for b in budget_ids}))
            fields["zones"] = self._zones_field(zones, now_ms)
            args = wire.arguments(shape, **fields)
            if self._acknowledging is not None and op.name == "reserve":
                reply, acknowledged = await self._acknowledging(op, script_keys, args)
                if not acknowledged and reply[0] in ("ok", "replayed"):
                    await self._unacknowledged(script_keys, fields["owner"], reply)
            else:
                reply = await self._t.run(op, script_keys, args)
            retry = wire.window_retry(reply)
            if retry is None:
                return list(reply)
            if retry.kind == "timezone":
                self._remember_tz(retry.budget_id, retry.timezone)
            else:
                now_ms = retry.now_ms
        raise InvariantBroken("period windows did not match the ledger's time after retries")

    async def _unacknowledged(self, record_keys: Sequence[str], owner: str,
                              reply: Sequence[Any]) -> NoReturn:
        """A hold whose replicas did not acknowledge it: the call is refused, so the hold is
        provably unused and is released (a release that fails leaves it to its lease, held)."""
        if reply[0] == "ok":
            with contextlib.suppress(CeilingError):
                await self._t.run(script("release"), record_keys, wire.arguments(
                    wire.RELEASE_ARGS, owner=owner, now_ms=self._now_arg()))
        raise LedgerUnavailable(
            "the ledger's replicas did not acknowledge the reservation in time "
            "(CEILING_REDIS_WAIT_REPLICAS): a failover now could lose it, so the call is refused",
            reason=NOT_REPLICATED)

    def _record_keys(self, tag: str, reservation_id: str) -> tuple[str, str, str]:
        return (keys.meta(tag), keys.reservation(tag, reservation_id), keys.open_leases(tag))

    # -- the ledger operations -------------------------------------------------------------

    async def reserve(self, request: ReserveRequest) -> Reservation:
        ledger_id = await self.open()
        ref = request.ref
        ensure(all(b.tag == ref.tag for b in request.budget_ids), "one tag per reservation")
        # The highest sequence of the tag acknowledged before this call began: Redis runs the
        # scripts one at a time, so this call's hold must come back above it (`_went_back`).
        seen = self._sequences
        floor = seen.get(ref.tag, 0)
        reply = await self._run_windowed(
            script("reserve"),
            self._record_keys(ref.tag, ref.reservation_id),
            {
                "ledger_id": ledger_id,
                "owner": ref.owner,
                "reserved_micros": str(request.amount_micros),
                "ttl_ms": str(request.ttl_ms),
                "expire_policy": request.expire_policy,  # a StrEnum is its value
                "retention_ms": str(request.retention_ms),
                "record_tail": wire.record_tail(request.fingerprint, request.price_version,
                                                request.model),
                "user": request.user or "",
            },
            request.budget_ids,
            request.run,
        )
        kind = reply[0]
        if kind == "ok":
            sequence, reply = int(reply[-1]), reply[:-1]
            if sequence <= floor:
                await self._went_back(ref.tag, sequence, floor, seen)
            self._saw(ref.tag, sequence)
        if kind == "ok" or kind == "replayed":
            reservation = wire.reservation(ref.reservation_id, request.amount_micros,
                                           request.ttl_ms, reply)
            self._learn_now(reservation.now_ms)
            return reservation
        if kind in ("exceeded", "busy"):
            refused = wire.refused(reply)
            raise refusal(refused.kind, refused.leg, refused.now_ms)
        if kind == "resolved":
            raise _resolved(ref.reservation_id, reply)
        if kind == "paused":
            raise _paused(str(reply[1]))
        if kind == "state_quota":
            raise state_quota(str(reply[1]), int(reply[2]))
        if kind in _LIMIT_REFUSALS:
            raise _limit_refusal(kind, reply, request.user)
        if kind == "conflict":
            raise IdempotencyConflict(
                "this reservation id was used with other parameters",
                reservation_id=ref.reservation_id,
            )
        # A wiped ledger has no budgets: 'no_budget' may mean the ledger is gone.
        await self._lost_check(ref.tag)
        raise BudgetNotFound(
            "no budget applies to this call", budget_id=request.budget_ids[-1].path
        )

    async def settle(self, ref: ReservationRef, actual_micros: int,
                     upstream: Upstream | None = None) -> Settlement:
        await self.open()  # a ledger known to be reset fails closed before it is asked
        reply = await self._t.run(
            script("settle"), self._record_keys(ref.tag, ref.reservation_id),
            wire.arguments(wire.SETTLE_ARGS, owner=ref.owner, actual_micros=str(actual_micros),
                           upstream=upstream or "", now_ms=self._now_arg()),
        )
        kind = reply[0]
        if kind == "ok" or kind == "replayed":
            return wire.settlement(reply, actual_micros)
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
        await self._not_found(ref.reservation_id, ref.tag)

    async def release(self, ref: ReservationRef) -> Release:
        await self.open()
        reply = await self._t.run(
            script("release"), self._record_keys(ref.tag, ref.reservation_id),
            wire.arguments(wire.RELEASE_ARGS, owner=ref.owner, now_ms=self._now_arg()),
        )
        kind = reply[0]
        if kind == "ok" or kind == "replayed":
            return wire.release(reply)
        if kind == "settled":
            raise ReservationResolved(
                "this reservation was settled; it cannot be released",
                reservation_id=ref.reservation_id,
            )
        await self._not_found(ref.reservation_id, ref.tag)

    async def book(self, request: ReserveRequest, actual_micros: int, admitted_at_ms: int) -> bool:
        ledger_id = await self.open()
        ref = request.ref
        reply = await self._run_windowed(
            script("book"),
            (keys.meta(ref.tag), keys.reservation(ref.tag, ref.reservation_id)),
            {
                "ledger_id": ledger_id,
                "admitted_at_ms": str(admitted_at_ms),
                "owner": ref.owner,
                "reserved_micros": str(request.amount_micros),
                "actual_micros": str(actual_micros),
                "record_tail": wire.record_tail(request.fingerprint, request.price_version,
                                                request.model),
                "user": request.user or "",
            },
            request.budget_ids, request.run, now_ms=admitted_at_ms,
        )
        if reply[0] == "ok":
            return bool(reply[1] == 0)
        await self._lost_check(ref.tag)
        raise BudgetNotFound("no budget applies to this journal entry")

    async def _read(self, tag: str, reservation_id: str) -> wire.StoredRecord | None:
        await self.open()
        reply = await self._t.run(
            script("read"), self._record_keys(tag, reservation_id)[:2],
            wire.arguments(wire.READ_ARGS, now_ms=self._now_arg()),
        )
        return wire.StoredRecord.unpacked(str(reply[1])) if reply[0] == "found" else None

    async def reservation(self, ref: ReservationRef) -> ReservationView | None:
        found = await self._read(ref.tag, ref.reservation_id)
        if found is None:
            await self._lost_check(ref.tag)
        if found is None or found.owner != ref.owner:
            return None
        return found.view(ref.reservation_id, full=False)

    async def inspect(self, tag: str, reservation_id: str) -> ReservationView | None:
        found = await self._read(tag, reservation_id)
        if found is None:
            await self._lost_check(tag)
            return None
        return found.view(reservation_id, full=True)

    async def correct(
        self, tag: str, reservation_id: str, actual_micros: int, correction: Correction
    ) -> Settlement:
        await self.open()
        reply = await self._t.run(
            script("correct"), self._record_keys(tag, reservation_id),
            wire.arguments(wire.CORRECT_ARGS, actual_micros=str(actual_micros),
                           corrected_by=correction.corrected_by,
                           correction_reason=wire.escaped(correction.reason),
                           now_ms=self._now_arg()),
        )
        kind = reply[0]
        if kind == "ok" or kind == "replayed":
            return wire.settlement(reply, actual_micros, Event.CORRECT)
        if kind == "resolved":
            raise _resolved(reservation_id, reply)
        if kind == "conflict":
            raise IdempotencyConflict(
                "this reservation was corrected before to another amount",
                reservation_id=reservation_id,
            )
        await self._not_found(reservation_id, tag)

    async def tag_of(self, digest: str) -> str | None:
        await self.open()
        found = await self._t.execute("HGET", keys.TAG_MAP_KEY, digest)
        return None if found is None else str(found)

    async def _lost_check(self, tag: str) -> None:
        """A reservation or budget that is not found may be one a wiped ledger (or shard) lost:
        then the answer is ledger_reset, never "not found" (settle, release, correction and the
        reads check no ledger id in their scripts; a wiped ledger has no budgets)."""
        if await self._identity_lost():
            raise self._refusal()
        if await self._org_lost(tag):
            raise _ledger_reset(tag)

    async def _not_found(self, reservation_id: str, tag: str) -> NoReturn:
        await self._lost_check(tag)
        raise ReservationNotFound("no such reservation", reservation_id=reservation_id)

    async def expire(self, tag: str, batch_max: int) -> int:
        ledger_id = await self.open()
        reply = await self._t.run(
            script("expire"), (keys.meta(tag), keys.open_leases(tag)),
            wire.arguments(wire.EXPIRE_ARGS, ledger_id=ledger_id, batch_max=str(batch_max),
                           now_ms=self._now_arg()),
        )
        if reply[0] == "ok":
            return int(reply[1])
        if await self._identity_lost():
            raise self._refusal()
        return 0

    # -- budgets -----------------------------------------------------------------------

    async def put_budget(self, budget: BudgetDef) -> None:
        ledger_id = await self.open()
        bid = budget.budget_id
        if await self._org_lost(bid.tag):
            raise _ledger_reset(bid.tag)  # putting it again would refill what the shard lost
        await self._map_tag(bid.tag)
        args = [ledger_id, budget.timezone, str(budget.ledger_allowance_micros)]
        for lim in budget.limits:
            args += [lim.period.value, str(lim.ceiling_micros)]
        if budget.rate is not None:
            args += ["rate", wire.rate_field(budget.rate)]
        if budget.per_user is not None:
            args += ["per_user", wire.per_user_field(budget.per_user)]
        if budget.clamp:
            args += [wire.CLAMP_DEFINITION_FIELD, "1"]
        reply = await self._t.run(
            script("put_budget"), (keys.meta(bid.tag), keys.definition(bid.tag, bid.path)), args
        )
        if reply[0] != "ok":
            self._reset = True
            raise _ledger_reset()
        # After the stamp: an organisation named here has data under this ledger id to lose.
        await self._t.execute("HSET", keys.ORGS_KEY, bid.tag, ledger_id)
        await self._t.execute("ZADD", keys.BUDGETS_KEY, "0", bid.path)
        await self._put_alerts(budget)
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
        found = dict(zip(wire.DEFINITION_FIELDS, await self._t.execute(
            "HMGET", keys.definition(budget_id.tag, budget_id.path), *wire.DEFINITION_FIELDS),
            strict=True))
        tz = found["timezone"]
        if tz is None:
            if await self._org_lost(budget_id.tag):
                raise _ledger_reset(budget_id.tag)
            return None
        limits = tuple(Limit(p, int(c)) for p, field in wire.CEILING_DEFINITION_FIELDS.items()
                       if (c := found[field]) is not None)
        thresholds, velocity, paused_at, clamp = await self._t.execute(
            "HMGET", keys.definition(budget_id.tag, budget_id.path),
            *wire.ALERT_DEFINITION_FIELDS, wire.CLAMP_DEFINITION_FIELD)
        paused = found["paused"] is not None
        return BudgetDef.from_ledger(budget_id, limits, str(tz),
                                     int(found["outage_allowance_micros"]),
                                     alerts.config_from_ledger(thresholds, velocity),
                                     int(paused_at or 0) if paused else None,
                                     wire.rate_of(found["rate"]),
                                     wire.per_user_of(found["per_user"]), clamp == "1")

    async def status(
        self, budget_ids: tuple[BudgetId, ...], run: RunLimit | None = None,
        user: str | None = None,
    ) -> tuple[LegStatus, ...]:
        ledger_id = await self.open()
        if not budget_ids:
            return ()
        tag = budget_ids[0].tag
        ensure(all(b.tag == tag for b in budget_ids), "one tag per status read")
        reply = await self._run_windowed(
            script("status"), (keys.meta(tag),),
            {"ledger_id": ledger_id, "user": user or ""}, budget_ids, run,
        )
        if reply[0] == "ok":
            now_ms, legs = wire.status(reply)
            self._learn_now(now_ms)
            return legs
        if await self._identity_lost():
            raise self._refusal()
        return ()

    # -- output lengths ------------------------------------------------------------------

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

    # -- API keys ------------------------------------------------------------------------

    async def put_key(self, record: KeyRecord) -> None:
        await self.open()
        # Listed first: an entry whose key is not there lists nothing, while a key made and not
        # listed would be one no operator could find.
        await self._t.execute("ZADD", keys.KEYS_KEY, "0",
                              f"{record.budget_id.path} {record.key_id}")
        made = await self.put_key_record(
            record.key_id, record.key_hash, record.budget_id.path,
            "" if record.run_ceiling_micros is None else str(record.run_ceiling_micros),
            ",".join(sorted(record.roles)))
        ensure(made in ("made", "exists"), f"the key id {record.key_id} was new ({made})")

    async def put_key_record(
        self, key_id: str, key_hash: str, budget_id: str, run_ceiling_micros: str, roles: str,
        *, previous_key_hash: str = "", previous_valid_ms: int = 0, created_ms: str = "",
        rotated_at_ms: str = "", last_used_ms: str = "",
    ) -> str:
        """lua/key_put.lua: a key's record, made unless its id holds one (or a revoked one's);
        the script's answer. A key's own put, a restore's, and the move of a key of the layout
        before records were by id into one."""
        reply = await self._t.run(
            script("key_put"), (keys.api_key_record(key_id),),
            [key_id, key_hash, budget_id, run_ceiling_micros, roles, previous_key_hash,
             str(previous_valid_ms), created_ms, rotated_at_ms, last_used_ms,
             *filter(None, [self._now_arg()])])
        return str(reply[0])

    async def get_key(self, key_hash: str, key_id: str | None = None) -> KeyRecord | None:
        await self.open()
        entry = None
        if key_id is None:
            # A secret made before secrets carried their key id: the entry under its hash names
            # the key (and, for a key no rotation moved into a record yet, is the key).
            entry = await self._t.execute("HMGET", keys.api_key(key_hash), *HASH_ONLY_KEY_FIELDS)
            if entry[0] is None:
                await self._no_key()
                return None
            key_id = str(entry[0])
        reply = await self._t.run(
            script("key_check"), (keys.api_key_record(key_id),),
            [key_hash, str(KEY_LAST_USED_RESOLUTION_MS), *filter(None, [self._now_arg()])])
        if reply[0] == "ok":
            return KeyRecord(str(reply[1]), key_hash, BudgetId(str(reply[2])),
                             int(reply[3]) if reply[3] else None, _roles(str(reply[4])))
        if reply[0] == "refused":
            return None
        if entry is not None and entry[1] is None:
            return await self._hash_only_key(key_id, key_hash, entry)
        await self._no_key()
        return None

    async def _no_key(self) -> None:
        """For a key not found: LedgerUnavailable (ledger_reset) if the ledger itself is gone."""
        if await self._identity_lost():
            raise self._refusal()

    async def _hash_only_key(self, key_id: str, key_hash: str, entry: Sequence[Any]
                             ) -> KeyRecord | None:
        """A key of the layout before records were by id, which no rotation moved into a record
        yet: the entry under the secret's hash is the key, if the key's pointers name the secret.
        One they do not name was left by a rotation of that layout that did not finish (it
        wrote one command at a time, the old secret's expiry last), and is taken no more."""
        current = await self._t.execute("GET", keys.api_key_id(key_id))
        if current is not None and current != key_hash and await self._t.execute(
                "GET", keys.api_key_previous(key_id)) != key_hash:
            return None
        _, _, budget_id, run, run_before_names, roles, last_used = entry
        # An entry put before fields had Python names keeps its run ceiling under 'run'.
        run = run_before_names if run is None else run
        now_ms = self._now_estimate()
        if not last_used or now_ms - int(last_used) >= KEY_LAST_USED_RESOLUTION_MS:
            await self._t.execute("HSET", keys.api_key(key_hash), "last_used_ms", str(now_ms))
        return KeyRecord(key_id, key_hash, BudgetId(str(budget_id)), int(run) if run else None,
                         ROLES_OF_KEYS_BEFORE_ROLES if roles is None else _roles(str(roles)))

    async def rotate_key(self, key_id: str, new_hash: str, grace_ms: int) -> bool:
        await self.open()
        reply = await self._rotate(key_id, new_hash, grace_ms)
        if reply[0] == "absent" and await self._move_hash_only_key(key_id):
            reply = await self._rotate(key_id, new_hash, grace_ms)
        if reply[0] == "rotated" and reply[2]:
            # The entry a secret made before secrets carried their id was found by, if it had
            # one: the record takes that secret no more.
            await self._t.execute("DEL", keys.api_key(str(reply[2])))
        return reply[0] in ("rotated", "exists")

    async def _rotate(self, key_id: str, new_hash: str, grace_ms: int) -> list[Any]:
        return list(await self._t.run(
            script("key_rotate"), (keys.api_key_record(key_id),),
            [new_hash, str(grace_ms), *filter(None, [self._now_arg()])]))

    async def _move_hash_only_key(self, key_id: str) -> bool:
        """Move a key of the layout before records were by id into its record (lua/key_put.lua),
        its previous secret with what is left of its grace; False if there is no such key. The
        record is written first, and decides from then on: the old entries are marked to lead a
        secret of that layout to it and no more ('index_only'), and the pointers go last, so a
        revoke that runs in between still finds every entry through them. A key revoked
        meanwhile stays revoked (key_put.lua refuses its id)."""
        current = await self._t.execute("GET", keys.api_key_id(key_id))
        if current is None:
            return False
        entry = await self._t.execute("HMGET", keys.api_key(str(current)), *HASH_ONLY_KEY_FIELDS,
                                      "created_ms", "rotated_at_ms")
        if entry[0] != key_id or entry[1] is not None:
            return False
        _, _, budget_id, run, run_before_names, roles, last_used, created, rotated = entry
        run = run_before_names if run is None else run
        # Listed, if it was made before the ledger listed keys.
        await self._t.execute("ZADD", keys.KEYS_KEY, "NX", "0", f"{budget_id} {key_id}")
        previous = await self._t.execute("GET", keys.api_key_previous(key_id))
        # -1 (no expiry) is an entry a rotation of that layout did not finish: no grace left.
        previous_valid_ms = 0 if previous is None else max(0, int(await self._t.execute(
            "PTTL", keys.api_key(str(previous)))))
        made = await self.put_key_record(
            key_id, str(current), str(budget_id), str(run or ""),
            ",".join(sorted(ROLES_OF_KEYS_BEFORE_ROLES)) if roles is None else str(roles),
            previous_key_hash=str(previous) if previous_valid_ms else "",
            previous_valid_ms=previous_valid_ms, created_ms=str(created or ""),
            rotated_at_ms=str(rotated or ""), last_used_ms=str(last_used or ""))
        if made == "revoked":
            return False
        await self._t.execute("HSET", keys.api_key(str(current)), "index_only", "1")
        if previous_valid_ms:
            await self._t.execute("HSET", keys.api_key(str(previous)), "index_only", "1")
        # One DEL each: the two are in different slots of a Redis Cluster.
        await self._t.execute("DEL", keys.api_key_id(key_id))
        await self._t.execute("DEL", keys.api_key_previous(key_id))
        return True

    async def delete_key(self, key_id: str) -> bool:
        await self.open()
        # A key of the layout before records were by id: its entries go first (the pointers
        # name them), then the pointers, so from here on no secret of that layout is taken,
        # whatever becomes of the rest of this revoke.
        hash_only = [str(h) for h in [await self._t.execute("GET", keys.api_key_id(key_id)),
                                      await self._t.execute("GET", keys.api_key_previous(key_id))]
                     if h is not None]
        budget_id = None
        if hash_only:
            budget_id = await self._t.execute("HGET", keys.api_key(hash_only[0]), "budget_id")
            for key_hash in hash_only:
                await self._t.execute("DEL", keys.api_key(key_hash))
            await self._t.execute("DEL", keys.api_key_id(key_id))
            await self._t.execute("DEL", keys.api_key_previous(key_id))
        reply = await self._t.run(script("key_revoke"), (keys.api_key_record(key_id),),
                                  [*filter(None, [self._now_arg()])])
        if reply[0] == "revoked":
            budget_id = reply[3]
            # The entries that led secrets made before secrets carried their id to the record.
            for key_hash in filter(None, reply[1:3]):
                await self._t.execute("DEL", keys.api_key(str(key_hash)))
        if budget_id is not None:
            await self._t.execute("ZREM", keys.KEYS_KEY, f"{budget_id} {key_id}")
        return reply[0] == "revoked" or bool(hash_only)

    # -- alerts ---------------------------------------------------------------------------

    async def _put_alerts(self, budget: BudgetDef) -> None:
        bid, config = budget.budget_id, budget.alerts
        await self._t.run(
            script("put_alerts"),
            (keys.meta(bid.tag), keys.definition(bid.tag, bid.path)),
            [bid.path, config.thresholds_ledger_form,
             config.velocity.ledger_form if config.velocity else ""])

    async def resume(self, budget_id: BudgetId) -> bool:
        """Lift a velocity alarm's pause; False if the budget was not paused."""
        await self.open()
        found = await self._t.execute(
            "HDEL", keys.definition(budget_id.tag, budget_id.path), "paused", "paused_at_ms")
        return int(found) > 0

    async def budgets_of(self, tag: str) -> list[str]:
        """The budget ids of a tag, from the ledger's one list of budgets (the catalogue, which
        put, delete and restore keep): the tag itself and the ids under it."""
        await self.open()
        # The tag's own id, then the ids under it: '[tag/' .. '[tag/\xff' holds exactly those
        # (an id never holds '\xff'), and no sibling such as 'tag-eu'.
        own = await self._t.execute("ZRANGEBYLEX", keys.BUDGETS_KEY, f"[{tag}", f"[{tag}")
        under = await self._t.execute("ZRANGEBYLEX", keys.BUDGETS_KEY, f"[{tag}/", f"[{tag}/\xff")
        return [str(b) for b in (*own, *under)]

    async def users_of(self, budget_id: BudgetId, after: str | None, count: int) -> UsersPage:
        """The budget's users set (core/stores/keys.py USERS) by ZRANGEBYLEX, then each user's
        legs from the status script, the one GET /v1/budgets/me reads: the same windows, at the
        ledger's time. Not one snapshot: the count and the page are two reads, and each user's
        legs a read of its own."""
        ensure(count >= 1, "a page of users lists something")
        await self.open()
        users_key = keys.prefix(budget_id.tag) + keys.USERS + budget_id.path
        # '(' then a member: the members after it, that one excluded (the cursor's user).
        low = "-" if after is None else f"({after}"
        found = [str(u) for u in await self._t.execute(
            "ZRANGEBYLEX", users_key, low, "+", "LIMIT", "0", str(count + 1))]
        users_count = int(await self._t.execute("ZCARD", users_key))
        in_flight = asyncio.Semaphore(USER_READS_IN_FLIGHT_MAX)

        async def spend_of(user: str) -> UserSpend:
            # Not BudgetId.user: an id read back is shown as the ledger keeps it, never refused.
            user_budget = f"{budget_id.path}/{USER_SCOPE_KIND}:{user}"
            async with in_flight:
                legs = await self.status((budget_id,), None, user)
            return UserSpend(user, user_budget,
                             tuple(leg for leg in legs if leg.budget_id == user_budget))

        page = await asyncio.gather(*(spend_of(u) for u in found[:count]))
        return UsersPage(tuple(page), users_count, len(found) > count)

    async def open_listing(self, tag: str, listed_max: int, examined_max: int) -> OpenLeases:
        """lua/open_listing.lua: one read of the tag's open leases, their records and the run
        counters they hold in."""
        ensure(listed_max >= 1 and examined_max >= 1, "an open listing lists something")
        await self.open()
        reply = await self._t.run(
            script("open_listing"), (keys.meta(tag), keys.open_leases(tag)),
            [str(listed_max), str(examined_max), *filter(None, [self._now_arg()])])
        now_ms, open_count, overdue_count, overdue, within, runs = reply
        return OpenLeases(tag, int(now_ms), int(open_count), int(overdue_count),
                          _holds(overdue), _holds(within), _runs(runs))

    async def ledger_time_ms(self) -> int:
        if self._clock:
            return self._clock()
        seconds, micros = await self._t.execute("TIME")
        return int(seconds) * 1000 + int(micros) // 1000

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

    # -- reconciliation --------------------------------------------------------------------

    async def _budget_tags(self) -> list[str]:
        await self.open()
        return sorted({str(t) for t in await self._t.execute("HVALS", keys.TAG_MAP_KEY)})

    async def gateway_spend_by_day(self, upstream: Upstream, first_day: date, last_day: date
                                   ) -> dict[date, int]:
        first, last = day_index(first_day), day_index(last_day)
        if last - first + 1 > DAILY_SPEND_DAYS_MAX:
            raise InvalidRequest(
                f"at most {DAILY_SPEND_DAYS_MAX} days at a time: the ledger keeps a day's spend "
                "that long", field="from")
        days = list(range(first, last + 1))
        total = dict.fromkeys(days, 0)
        for tag in await self._budget_tags() if days else []:
            found = await self._t.execute(
                "MGET", *(keys.daily_spend(tag, upstream.value, d) for d in days))
            for d, value in zip(days, found, strict=True):
                if value is not None:
                    total[d] += int(value)
        return {day_of_index(d): micros for d, micros in total.items() if micros}

    async def emit_drift_alert(self, event: DriftEvent) -> bool:
        reply = await self._t.run(
            script("drift_alert"), (keys.meta(keys.LEDGER_EVENTS_TAG),),
            wire.arguments(wire.DRIFT_ARGS, provider=event.provider.value,
                           day=event.day.isoformat(), ledger_micros=str(event.ledger_micros),
                           provider_micros=str(event.provider_micros), now_ms=self._now_arg()),
        )
        return int(reply) == 1

    async def refusal_counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for tag in await self._budget_tags():
            found = await self._t.execute("HGETALL", keys.refused(tag))
            pairs = found.items() if isinstance(found, dict) else zip(
                found[::2], found[1::2], strict=True)
            for code, count in pairs:
                total[str(code)] = total.get(str(code), 0) + int(count)
        return total

    # -- health --------------------------------------------------------------------------

    async def probe(self, instance_id: str) -> Probe:
        reasons: list[str] = []
        try:
            ledger_id = await self.open()
            started = time.perf_counter()
            found, version = await self._stamp()
            latency_ms = round((time.perf_counter() - started) * 1000, 3)
            if not _readable(version):
                self._format_refused = str(version)
            if found != ledger_id or not _readable(version):
                self._reset = True
                raise self._refusal()
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
            durability = await self._t.durability()
            await self._sequences_checked(durability.server_id)
        except CeilingError as exc:
            reason = exc.reason if isinstance(exc, LedgerUnavailable) else "ledger_unreachable"
            reachable = reason not in ("ledger_unreachable", "ledger_auth")
            return Probe(
                self.backend, self.shared, reachable, None,
                self._ledger_id, None, (reason,), None,
            )
        reasons.extend(durability.reasons())
        if durability.replicas is not None and durability.replicas < self._replicas_required:
            reasons.append(NOT_REPLICATED)
        return Probe(self.backend, self.shared, True, latency_ms, ledger_id, durability.durable,
                     tuple(reasons), seen)

    async def _sequences_checked(self, server_id: str | None) -> None:
        """A probe's look for a rollback no call has met yet: the sequences of the tags this
        instance reserved in most recently (SEQUENCES_PROBED_MAX), read back. A read that
        began after a reserve was answered sees that reserve's sequence or a later one; less is
        a ledger that lost it. Raises the refusal if this or another instance found one.

        Skipped while the server is the one the last probe met (INFO run_id and replication id
        unchanged: no restart, no promotion, so nothing went back); where INFO does not tell,
        every probe looks."""
        if self._rolled_back is not None:
            raise _rolled_back(self._rolled_back)
        unchanged = server_id is not None and server_id == self._server_id
        self._server_id = server_id
        if unchanged:
            return
        seen = self._sequences
        tags = list(seen)[-SEQUENCES_PROBED_MAX:]
        found = await asyncio.gather(
            *(self._t.execute("HGET", keys.meta(tag), "seq") for tag in tags))
        for tag, sequence in zip(tags, found, strict=True):
            if int(sequence or 0) < seen[tag]:
                await self._went_back(tag, int(sequence or 0), seen[tag], seen)
        if self._rolled_back is not None:
            raise _rolled_back(self._rolled_back)

    async def close(self) -> None:
        await self._t.close()
