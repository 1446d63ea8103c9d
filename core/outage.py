"""The outage allowance: what an instance may admit while the shared ledger is unreachable.

Fail closed is the rule. A budget may opt out of it with `outage_allowance_micros`: while the
ledger cannot be reached, each instance admits calls against that allowance, using the budget
definitions it last read, and keeps a journal of what it admitted. When the ledger answers again
the journal is booked into it (lua/book.lua), so nothing is lost.

A budget whose outage_policy is `open` has an allowance no spend reaches
(core/budgets.py OUTAGE_OPEN_ALLOWANCE_MICROS): it admits without limit during an outage, still
journaled and booked afterwards, and still bounded by JOURNAL_ENTRIES_MAX per instance, past
which it fails closed. Health lists the budgets this instance knows as `open`.

A model's rules are the ledger's, and an outage does not open them: the allowance admits a call
that names a model only if every allow-list on its path (as this instance last read them, at
most MODEL_RULES_READ_MS before) names the model and no budget on the path has per_model limits
for it, which only the ledger can hold; a path whose rules it has not read admits no call that
names a model. A call by amount is admitted as the ledger admits it (docs/models.md).

The price: every instance has its own allowance, so during an outage spend can exceed the
ceiling by up to allowance x instances.

The journal lives in the instance's memory. An instance that dies before the ledger comes back
loses what it admitted (at most JOURNAL_ENTRIES_MAX calls, and no more money than the
allowances it admitted them against): the ledger never learns of that spend, and the provider's
bill is then the only record of it (`ceiling reconcile ... --book-into`). Where the platform
keeps a disk across a restart, CEILING_OUTAGE_JOURNAL_DIR keeps the journal there as well
(JournalFile): one append-only file per instance, written before a call it admits goes on, and
read by the next instance that starts with the same directory, which books it. A process crash
loses nothing of it (each line reaches the operating system before the call is answered); a
machine crash may lose the lines it had not written to disk (no fsync: an outage admits calls
at the rate they come). A serverless platform's disk goes with its instance: leave it unset
there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from core.budgets import OUTAGE_OPEN_ALLOWANCE_MICROS, BudgetDef, BudgetId
from core.errors import CeilingError, LedgerUnavailable
from core.ledger import (
    OUTAGE_WINDOW_KEY,
    ExpirePolicy,
    Ledger,
    LegStatus,
    Release,
    Reservation,
    ReservationRef,
    ReservationState,
    ReserveRequest,
    RunLimit,
    Settlement,
    Upstream,
    resolved_replay,
)
from core.lifecycle import ABSENT, Effects, Event, effects

# Budget paths whose allowances an instance remembers; bounded because paths come from keys.
KNOWN_PATHS_MAX = 50_000
# Paths whose model rules an instance remembers for its allowance (ModelRules): only paths with
# an allowance on every budget, each some 300 names at most (MODELS_ALLOW_MAX + PER_MODEL_MAX);
# bounded because paths come from keys. Past it they are forgotten, and read again on a call.
MODEL_RULES_PATHS_MAX = 10_000
# How often a path's model rules are read again while the ledger answers: a definition changes
# rarely, and the read is one more round trip per budget on the path.
MODEL_RULES_READ_MS = 10_000
# Journal entries one instance keeps; past this it fails closed even within its allowance,
# because an unbounded journal is unbounded memory.
JOURNAL_ENTRIES_MAX = 100_000


@dataclass(frozen=True)
class ModelRules:
    """A path's model rules as last read: the models every allow-list on it names (None: no
    allow-list), and the models a budget on it has per_model limits for."""

    read_at_ms: int
    allowed: frozenset[str] | None
    limited: frozenset[str]

    @classmethod
    def of(cls, read_at_ms: int, definitions: Sequence[BudgetDef | None]) -> ModelRules:
        allowed: frozenset[str] | None = None
        limited: set[str] = set()
        for definition in definitions:
            if definition is None:
                continue
            if definition.models_allow is not None:
                names = frozenset(definition.models_allow)
                allowed = names if allowed is None else allowed & names
            limited.update(m.model for m in definition.per_model)
        return cls(read_at_ms, allowed, frozenset(limited))

    def admits(self, model: str) -> bool:
        """Whether the ledger could not refuse `model` (a call's one name, '' for an amount)
        for a model rule of the path, nor hold it by one."""
        return not model or (
            (self.allowed is None or model in self.allowed) and model not in self.limited)


@dataclass
class JournalEntry:
    """A call admitted during the outage, and the step that resolved it (core/lifecycle.py)."""

    request: ReserveRequest
    admitted_at_ms: int
    state: ReservationState = ReservationState.OPEN
    resolved: Effects | None = None
    # The step that resolved it, as the journal file records it (JournalFile).
    event: str = ""
    actual_micros: int = 0


def _wall_clock_ms() -> int:
    return int(time.time() * 1000)


# A journal file, by the instance that writes it: 'outage-<instance id>.jsonl'.
JOURNAL_FILE_PREFIX = "outage-"
JOURNAL_FILE_SUFFIX = ".jsonl"


def _request_json(request: ReserveRequest) -> dict[str, Any]:
    return {"tag": request.ref.tag, "id": request.ref.reservation_id, "owner": request.ref.owner,
            "budget_ids": [b.path for b in request.budget_ids],
            "amount_micros": request.amount_micros, "ttl_ms": request.ttl_ms,
            "fingerprint": request.fingerprint, "price_version": request.price_version,
            "model": request.model, "expire_policy": request.expire_policy.value,
            "run": [request.run.budget_id.path, request.run.ceiling_micros] if request.run
            else None, "retention_ms": request.retention_ms, "user": request.user,
            "canonical_model": request.canonical_model,
            "bill": None if request.bill is None else request.bill.value}


def _request_of(doc: dict[str, Any]) -> ReserveRequest:
    run = doc["run"]
    return ReserveRequest(
        ref=ReservationRef(doc["tag"], doc["id"], doc["owner"]),
        budget_ids=tuple(BudgetId(p) for p in doc["budget_ids"]),
        amount_micros=int(doc["amount_micros"]), ttl_ms=int(doc["ttl_ms"]),
        fingerprint=doc["fingerprint"], price_version=doc["price_version"], model=doc["model"],
        expire_policy=ExpirePolicy(doc["expire_policy"]),
        run=RunLimit(BudgetId(run[0]), int(run[1])) if run else None,
        retention_ms=int(doc["retention_ms"]), user=doc["user"],
        # A journal written before budgets named models: its calls are booked as amounts.
        canonical_model=doc.get("canonical_model", ""),
        # A journal written before reservations named their bill names none.
        bill=Upstream(doc["bill"]) if doc.get("bill") else None)


class JournalFile:
    """The outage journal of one instance on disk: a line per step (admitted, resolved,
    booked), appended before the step is answered; emptied once every entry is booked. The
    instance holds an exclusive lock on its file for as long as it lives, which is how another
    instance tells a dead instance's file (`orphans`) from a live one's."""

    def __init__(self, directory: Path, instance_id: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{JOURNAL_FILE_PREFIX}{instance_id}{JOURNAL_FILE_SUFFIX}"
        self._file: IO[str] = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def empty(self) -> None:
        self._file.truncate(0)

    def close(self) -> None:
        """Stop writing, and let the lock go: the file is then another instance's to take."""
        self._file.close()

    def orphans(self) -> Iterator[dict[str, Any]]:
        """The lines of every other journal file in the directory whose instance is gone,
        each file deleted once read (its entries are this instance's to book from then on)."""
        for path in sorted(self.path.parent.glob(f"{JOURNAL_FILE_PREFIX}*{JOURNAL_FILE_SUFFIX}")):
            if path == self.path:
                continue
            with open(path, encoding="utf-8") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # its instance is alive
                lines = f.read().splitlines()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            for text in lines:
                with contextlib.suppress(ValueError):  # a line a crash cut short
                    yield json.loads(text)


class OutageAllowance:
    def __init__(self, clock: Callable[[], int] = _wall_clock_ms) -> None:
        self._clock = clock
        self._allowances: dict[tuple[str, ...], dict[str, int]] = {}
        self._model_rules: dict[tuple[str, ...], ModelRules] = {}
        # What each budget has admitted against its allowance: holds and spend alike.
        self._admitted: dict[str, int] = {}
        self._journal: dict[tuple[str, str], JournalEntry] = {}
        self._file: JournalFile | None = None

    def keep_in(self, directory: Path, instance_id: str) -> int:
        """Keep the journal in `directory` too (CEILING_OUTAGE_JOURNAL_DIR), and take over the
        entries of instances that died with theirs unbooked; returns how many were taken."""
        file = JournalFile(directory, instance_id)
        taken: dict[tuple[str, str], JournalEntry] = {}
        for line in file.orphans():
            key = (str(line["tag"]), str(line["id"]))
            if line["step"] == "admitted":
                taken[key] = JournalEntry(_request_of(line["request"]), int(line["at_ms"]))
            elif line["step"] == "resolved" and key in taken:
                entry = taken[key]
                self._resolve(entry, Event(line["event"]), int(line["actual_micros"]))
            elif line["step"] == "booked":
                taken.pop(key, None)
        self._file = file
        for key, entry in taken.items():
            self._journal[key] = entry
            self._write_entry(entry)
        return len(taken)

    def _write_entry(self, entry: JournalEntry) -> None:
        if self._file is None:
            return
        request = entry.request
        self._file.write({"step": "admitted", "tag": request.ref.tag,
                          "id": request.ref.reservation_id, "at_ms": entry.admitted_at_ms,
                          "request": _request_json(request)})
        if entry.resolved is not None:
            self._file.write({"step": "resolved", "tag": request.ref.tag,
                              "id": request.ref.reservation_id, "event": entry.event,
                              "actual_micros": entry.actual_micros})

    @property
    def journal_size(self) -> int:
        return len(self._journal)

    def open_budgets(self, count_max: int) -> list[str]:
        """Budgets whose outage policy is `open`, as this instance last read them: the ones that
        would admit without limit if the ledger went away now (health lists them)."""
        found = sorted({b for allowances in self._allowances.values()
                        for b, a in allowances.items() if a >= OUTAGE_OPEN_ALLOWANCE_MICROS})
        return found[:count_max]

    def learn(self, budget_ids: tuple[BudgetId, ...], legs: tuple[LegStatus, ...]) -> bool:
        """Remember which budgets applied to this path and their allowances, as last read;
        whether the path's model rules are due to be read (model_rules_due), told here from
        the path this made, as a reserve asks right after."""
        path = tuple(b.path for b in budget_ids)
        if path not in self._allowances and len(self._allowances) >= KNOWN_PATHS_MAX:
            self._allowances.clear()
        # A run budget has no allowance of its own: during an outage the allowances of the
        # budgets above it bound the run's spend.
        allowances = self._allowances[path] = {
            leg.budget_id: leg.outage_allowance_micros for leg in legs if leg.budget_id in path
        }
        return self._rules_due(path, allowances)

    def model_rules_due(self, budget_ids: tuple[BudgetId, ...]) -> bool:
        """Whether the path's model rules are to be read (learn_model_rules): it has an
        allowance on every budget, and its rules were not read in MODEL_RULES_READ_MS."""
        path = tuple(b.path for b in budget_ids)
        return self._rules_due(path, self._allowances.get(path))

    def _rules_due(self, path: tuple[str, ...], allowances: dict[str, int] | None) -> bool:
        # min > 0: every budget on the path has an allowance.
        if not allowances or min(allowances.values()) <= 0:
            return False
        rules = self._model_rules.get(path)
        return rules is None or self._clock() - rules.read_at_ms >= MODEL_RULES_READ_MS

    def learn_model_rules(self, budget_ids: tuple[BudgetId, ...],
                          definitions: Sequence[BudgetDef | None]) -> None:
        """Remember the path's model rules from its budgets' definitions, as just read."""
        path = tuple(b.path for b in budget_ids)
        if path not in self._model_rules and len(self._model_rules) >= MODEL_RULES_PATHS_MAX:
            self._model_rules.clear()
        self._model_rules[path] = ModelRules.of(self._clock(), definitions)

    def _book(self, request: ReserveRequest, fx: Effects) -> None:
        """A step's effects on the allowances of the budgets its call was admitted under."""
        delta = fx.reserved_delta + fx.committed_delta
        for budget_id in self._allowances.get(tuple(b.path for b in request.budget_ids), {}):
            self._admitted[budget_id] = self._admitted.get(budget_id, 0) + delta

    def admit(self, request: ReserveRequest, cause: LedgerUnavailable) -> Reservation:
        """Admit against the allowances, or re-raise `cause`: fail closed."""
        allowances = self._allowances.get(tuple(b.path for b in request.budget_ids))
        amount = request.amount_micros
        if (
            not allowances
            or len(self._journal) >= JOURNAL_ENTRIES_MAX
            or any(self._admitted.get(b, 0) + amount > a for b, a in allowances.items())
        ):
            raise cause
        rules = self._model_rules.get(tuple(b.path for b in request.budget_ids))
        if request.canonical_model and (rules is None or not rules.admits(
                request.canonical_model)):
            raise cause
        key = (request.ref.tag, request.ref.reservation_id)
        now_ms = self._clock()
        known = self._journal.get(key)
        if known is not None and known.resolved is not None:
            # A replay of a call this instance already resolved: what became of it, as the
            # ledger answers a replay of a resolved reservation.
            raise resolved_replay(
                request.ref.reservation_id, known.state, known.resolved.outcome, amount,
                known.resolved.charged_micros,
            )
        if known is None:
            self._book(request, effects(Event.RESERVE, ABSENT, request.expire_policy, amount))
            known = self._journal[key] = JournalEntry(request, now_ms)
            self._write_entry(known)
        legs = tuple(
            LegStatus(b, OUTAGE_WINDOW_KEY, a, 0, self._admitted[b], 0, None, a)
            for b, a in allowances.items()
        )
        return Reservation(
            request.ref.reservation_id, amount, known.admitted_at_ms + request.ttl_ms, now_ms,
            known.admitted_at_ms != now_ms, legs,
        )

    def _entry(self, ref: ReservationRef) -> JournalEntry | None:
        entry = self._journal.get((ref.tag, ref.reservation_id))
        return None if entry is None or entry.request.ref.owner != ref.owner else entry

    def _resolve(self, entry: JournalEntry, event: Event, actual_micros: int) -> Effects:
        request = entry.request
        fx = effects(event, entry.state, request.expire_policy, request.amount_micros,
                     actual_micros)
        self._book(request, fx)
        entry.state, entry.resolved = fx.to, fx
        entry.event, entry.actual_micros = event.value, actual_micros
        if self._file is not None:
            self._file.write({"step": "resolved", "tag": request.ref.tag,
                              "id": request.ref.reservation_id, "event": event.value,
                              "actual_micros": actual_micros})
        return fx

    def settle(self, ref: ReservationRef, actual_micros: int) -> Settlement | None:
        """Settle a call admitted during the outage, locally; None if it was not (or was
        released, which the ledger answers for)."""
        entry = self._entry(ref)
        if entry is None or entry.state is ReservationState.RELEASED:
            return None
        replayed = entry.resolved is not None
        fx = entry.resolved or self._resolve(entry, Event.SETTLE, actual_micros)
        return Settlement(fx.charged_micros, fx.released_micros, fx.overshoot_micros, fx.late,
                          replayed)

    def release(self, ref: ReservationRef) -> Release | None:
        entry = self._entry(ref)
        if entry is None or entry.state is ReservationState.SETTLED:
            return None
        replayed = entry.resolved is not None
        fx = entry.resolved or self._resolve(entry, Event.RELEASE, 0)
        return Release(fx.released_micros, replayed)

    async def flush(self, store: Ledger) -> int:
        """Book every finished journal entry into the ledger; return how many were booked.

        An entry still open is booked once its lease has run out at what the ledger's 'charge'
        expiry charges, whatever its policy: the worker may have been billed, and nothing here
        can learn otherwise.
        """
        booked = 0
        now_ms = self._clock()
        for key, entry in list(self._journal.items()):
            if entry.state is ReservationState.RELEASED:
                del self._journal[key]
                self._booked(key)
                continue
            request = entry.request
            if entry.resolved is not None:
                actual = entry.resolved.charged_micros
            elif now_ms >= entry.admitted_at_ms + request.ttl_ms:
                actual = effects(Event.EXPIRE, entry.state, ExpirePolicy.CHARGE,
                                 request.amount_micros).charged_micros
            else:
                continue
            try:
                await store.book(request, actual, entry.admitted_at_ms)
            except CeilingError:
                return booked  # still unreachable, or refused: keep the entry, try again later
            del self._journal[key]
            self._booked(key)
            booked += 1
        if not self._journal:
            self._admitted.clear()
            if self._file is not None:
                self._file.empty()
        return booked

    def _booked(self, key: tuple[str, str]) -> None:
        if self._file is not None:
            self._file.write({"step": "booked", "tag": key[0], "id": key[1]})
