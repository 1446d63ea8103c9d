"""The API keys of ScriptedStore (core/stores/scripted.py): the KeyStore protocol."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.budgets import BudgetId
from core.errors import ensure
from core.ledger import ROLES_OF_KEYS_BEFORE_ROLES, KeyRecord, Role
from core.stores import keys
from core.stores.scripted_core import ScriptedCore
from core.stores.scripts import script

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


def _roles(stored: str) -> frozenset[Role]:
    # A role this version does not know (a newer instance wrote it) grants nothing here.
    known = {r.value: r for r in Role}
    return frozenset(known[name] for name in stored.split(",") if name in known)


class ScriptedKeys(ScriptedCore):
    """API keys (core/ledger.py KeyStore): put, check, rotate and delete them."""

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
