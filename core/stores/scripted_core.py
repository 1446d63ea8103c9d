"""The base of ScriptedStore (core/stores/scripted.py): what every protocol it implements runs
on, from the transport to the ledger's identity, time zones, durability and probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, Protocol

from core.budgets import BudgetId, Period, window_at
from core.errors import CeilingError, InvariantBroken, LedgerUnavailable, ensure
from core.ledger import Probe, RunLimit
from core.limits import INT_EXACT_MAX, TZ_CACHE_MAX, WINDOW_RETRIES_MAX
from core.stores import keys, wire
from core.stores.durability import NOT_REPLICATED, ROLLED_BACK, Durability
from core.stores.scripted_replies import ScriptedReplies
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
# The backends whose transports call the library's functions (FCALL), where other versions'
# libraries pile up (core/stores/scripts.py prune_libraries): the cluster's transport runs each
# operation as a script of its own, and the memory store's Redis is its process's alone.
LIBRARY_BACKENDS = frozenset({"redis", "upstash"})


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


def ledger_reset(tag: str | None = None) -> LedgerUnavailable:
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
    """The refusal of a ledger of format `version` ('': not stamped)."""
    if not version or (version.isdigit() and int(version) < wire.LEDGER_FORMAT_VERSION):
        found = f"version {version}" if version else "not stamped"
        return LedgerUnavailable(
            f"the ledger is of an earlier format ({found}; this instance reads version "
            f"{wire.LEDGER_FORMAT_VERSION}); enforcement is refused until an operator migrates "
            "it (`ceiling ledger migrate`)",
            reason="ledger_reset",
        )
    return LedgerUnavailable(
        f"the ledger was written by another format version ({version}; this instance reads "
        f"version {wire.LEDGER_FORMAT_VERSION}); enforcement is refused until it is served by "
        "a version of spend-ceiling that reads it",
        reason="ledger_reset",
    )


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _readable(version: Any) -> bool:
    """Whether this version's scripts read a ledger stamped with format `version` (None: no
    stamp). They read their own format only: `ceiling ledger migrate` (core/stores/migrate.py)
    brings an earlier one to it."""
    return version is not None and str(version) == str(wire.LEDGER_FORMAT_VERSION)


class ScriptedCore:
    """What every protocol of ScriptedStore runs on: the transport, the ledger's identity and
    time, the scripts that need period windows, durability and the health probe."""

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
        # cannot read that format (`_readable`; '' for none), and that ledger's id; None for a
        # reset of any other kind.
        self._format_refused: str | None = None
        self._format_refused_id: str | None = None
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

    # -- identity and time ---------------------------------------------------------------------

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
                self._reset = True
                self._refuse_format(found, version)
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
        return ledger_reset()

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
        if (self._format_refused is not None and found is not None
                and str(found) == self._format_refused_id and _readable(version)):
            # The ledger refused for its format, migrated since (`ceiling ledger migrate`): the
            # same ledger, now in this version's format.
            self._ledger_id, self._reset, self._format_refused = str(found), False, None
            return True
        if found is None or found != adopted or found == self._ledger_id:
            return False
        if not _readable(version):
            self._refuse_format(found, version)
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
            self._refuse_format(found, version)
        if found != self._ledger_id or not _readable(version):
            self._reset = True
        return self._reset

    def _refuse_format(self, found: Any, version: Any) -> None:
        self._format_refused, self._format_refused_id = _text(version) or "", _text(found)

    def now_arg(self) -> str:
        """now_ms for a script: '' (Redis TIME) unless a test injected a clock."""
        return self._now_arg()

    def now_estimate(self) -> int:
        """The ledger's time as this instance last learnt it, in ms."""
        return self._now_estimate()

    def use_ledger(self, ledger_id: str) -> None:
        """Enforce against `ledger_id` from now on: the one a restore made here just stamped."""
        self._ledger_id, self._reset, self._sequences = ledger_id, False, {}

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

    async def ledger_time_ms(self) -> int:
        if self._clock:
            return self._clock()
        seconds, micros = await self._t.execute("TIME")
        return int(seconds) * 1000 + int(micros) // 1000

    # -- scripts that need period windows ------------------------------------------------------

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
                 "status": wire.STATUS_ARGS, "book_unseen": wire.BOOK_UNSEEN_ARGS}[op.name]
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

    # -- health --------------------------------------------------------------------------------

    async def probe(self, instance_id: str) -> Probe:
        reasons: list[str] = []
        try:
            ledger_id = await self.open()
            started = time.perf_counter()
            found, version = await self._stamp()
            latency_ms = round((time.perf_counter() - started) * 1000, 3)
            if not _readable(version):
                self._refuse_format(found, version)
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
