"""The budgets of ScriptedStore (core/stores/scripted.py): the BudgetCatalogue protocol, and a
budget's status."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from core.alerts import config_from_ledger
from core.budgets import USER_SCOPE_KIND, BudgetDef, BudgetId, Limit
from core.errors import ensure
from core.ledger import LegStatus, RunLimit, UsersPage, UserSpend, tag_digest
from core.stores import keys, wire
from core.stores.scripted_core import ScriptedCore, ledger_reset
from core.stores.scripts import script

# A page of a budget's end users (users_of) reads each user's legs with a status script of its
# own: at most this many at once, so that a page goes out in a few pipelined writes rather than
# one round trip after another, and the calls the instance serves meanwhile are not queued
# behind all of the page's reads.
USER_READS_IN_FLIGHT_MAX = 16
# The backend whose scripts reach one hash slot each (core/stores/redis_cluster.py).
CLUSTER_BACKEND = "redis-cluster"


class ScriptedCatalogue(ScriptedCore):
    """Budgets (core/ledger.py BudgetCatalogue): define, read, resume and list them, and a
    budget's status."""

    async def put_budget(self, budget: BudgetDef) -> None:
        """One script puts the budget whole (lua/put_budget.lua): its definition, its alert
        settings and, where one script may reach the catalogue's slot, its catalogue entries.

        On a Redis Cluster the catalogue (core/stores/keys.py CATALOGUE) is in the ledger id's
        slot and the budget in its tag's, which no script spans: there the script puts the
        budget, and the organisation's entry and the budget's id follow it, each a write of a
        value that is the same every time. A put cut between the two leaves the budget whole and
        enforced, not yet listed; the caller, answered with an error, puts it again, which lists
        it. The entries never come first: an organisation named in the catalogue with no stamp
        in its meta hash reads as a shard that lost its data (scripted_core.py _org_lost)."""
        ledger_id = await self.open()
        bid = budget.budget_id
        if await self._org_lost(bid.tag):
            raise ledger_reset(bid.tag)  # putting it again would refill what the shard lost
        await self._map_tag(bid.tag)
        alerts = budget.alerts
        args = [ledger_id, bid.path, budget.timezone, str(budget.ledger_allowance_micros),
                alerts.thresholds_ledger_form,
                alerts.velocity.ledger_form if alerts.velocity else ""]
        for lim in budget.limits:
            args += [lim.period.value, str(lim.ceiling_micros)]
        models = budget.models_allow is not None or bool(budget.per_model)
        if budget.rate is not None or models:
            args += ["rate", wire.rate_field(budget.rate, models)]
        if budget.models_allow is not None:
            args += ["models_allow", wire.models_allow_field(budget.models_allow)]
        if budget.per_model:
            args += ["per_model", wire.per_model_field(budget.per_model)]
        if budget.per_user is not None:
            args += ["per_user", wire.per_user_field(budget.per_user)]
        if budget.clamp:
            args += [wire.CLAMP_DEFINITION_FIELD, "1"]
        one_slot = self._t.backend == CLUSTER_BACKEND
        catalogue = () if one_slot else (keys.ORGS_KEY, keys.BUDGETS_KEY)
        reply = await self._t.run(
            script("put_budget"),
            (keys.meta(bid.tag), keys.definition(bid.tag, bid.path), *catalogue), args)
        if reply[0] != "ok":
            self._reset = True
            raise ledger_reset()
        if one_slot:
            await self._t.execute("HSET", keys.ORGS_KEY, bid.tag, ledger_id)
            await self._t.execute("ZADD", keys.BUDGETS_KEY, "0", bid.path)
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
        found = {name: str(value) for name, value in zip(_STORED_FIELDS, await self._t.execute(
            "HMGET", keys.definition(budget_id.tag, budget_id.path), *_STORED_FIELDS),
            strict=True) if value is not None}
        if "timezone" not in found:
            if await self._org_lost(budget_id.tag):
                raise ledger_reset(budget_id.tag)
            return None
        return definition_of(budget_id.path, found)

    async def status(
        self, budget_ids: tuple[BudgetId, ...], run: RunLimit | None = None,
        user: str | None = None, model: str | None = None,
    ) -> tuple[LegStatus, ...]:
        ledger_id = await self.open()
        if not budget_ids:
            return ()
        tag = budget_ids[0].tag
        ensure(all(b.tag == tag for b in budget_ids), "one tag per status read")
        reply = await self._run_windowed(
            script("status"), (keys.meta(tag),),
            {"ledger_id": ledger_id, "user": user or "", "model": model or ""}, budget_ids, run,
        )
        if reply[0] == "ok":
            now_ms, legs = wire.status(reply)
            self._learn_now(now_ms)
            return legs
        if await self._identity_lost():
            raise self._refusal()
        return ()

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


# Every field of a definition's hash that a definition is read from (definition_of).
_STORED_FIELDS = (*wire.DEFINITION_FIELDS, *wire.ALERT_DEFINITION_FIELDS,
                  wire.CLAMP_DEFINITION_FIELD, *wire.MODEL_DEFINITION_FIELDS)


def definition_of(budget_id: str, fields: Mapping[str, str]) -> BudgetDef:
    """A definition's hash (wire.py DEFINITION_FIELDS, ALERT_DEFINITION_FIELDS, what
    definition_fields gives) as a definition: how get_budget and an export read one."""
    limits = tuple(Limit(p, int(fields[name])) for p, name in
                   wire.CEILING_DEFINITION_FIELDS.items() if name in fields)
    paused = "paused" in fields
    return BudgetDef.from_ledger(
        BudgetId(budget_id), limits, fields["timezone"], int(fields["outage_allowance_micros"]),
        config_from_ledger(fields["alert_thresholds_pct"],
                           fields[wire.VELOCITY_DEFINITION_FIELD]),
        int(fields.get("paused_at_ms") or 0) if paused else None,
        wire.rate_of(fields.get("rate")), wire.per_user_of(fields.get("per_user")),
        fields.get(wire.CLAMP_DEFINITION_FIELD) == "1",
        wire.models_allow_of(fields.get("models_allow")),
        wire.per_model_of(fields.get("per_model")))


def definition_fields(definition: BudgetDef) -> dict[str, str]:
    """A definition's hash as lua/put_budget.lua writes it (but the ledger id, which a restore
    stamps), with the pause a velocity alarm put on it: what a restore writes
    (core/stores/export_body.py)."""
    alerts = definition.alerts
    fields = {"timezone": definition.timezone,
              "outage_allowance_micros": str(definition.ledger_allowance_micros),
              "alert_thresholds_pct": alerts.thresholds_ledger_form,
              wire.VELOCITY_DEFINITION_FIELD: alerts.velocity.ledger_form
              if alerts.velocity else ""}
    for lim in definition.limits:
        fields[wire.CEILING_DEFINITION_FIELDS[lim.period]] = str(lim.ceiling_micros)
    models = definition.models_allow is not None or bool(definition.per_model)
    if definition.rate is not None or models:
        fields["rate"] = wire.rate_field(definition.rate, models)
    if definition.models_allow is not None:
        fields["models_allow"] = wire.models_allow_field(definition.models_allow)
    if definition.per_model:
        fields["per_model"] = wire.per_model_field(definition.per_model)
    if definition.per_user is not None:
        fields["per_user"] = wire.per_user_field(definition.per_user)
    if definition.clamp:
        fields[wire.CLAMP_DEFINITION_FIELD] = "1"
    if definition.paused_at_ms is not None:
        fields.update(paused="1", paused_at_ms=str(definition.paused_at_ms))
    return fields
