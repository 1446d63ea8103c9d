"""The API keys of ScriptedStore (core/stores/scripted.py): the KeyStore protocol."""

from __future__ import annotations

from core.budgets import BudgetId
from core.errors import ensure
from core.ledger import KeyRecord, Role
from core.stores import keys
from core.stores.scripted_core import ScriptedCore
from core.stores.scripts import script

# A key's last use is written when the stored one is older than this: at most one write a minute
# per key and instance, on the key check the key-trust window (core/service.py KEY_TRUST_MS)
# already makes rare, never on the reserve script. Operators read "last used" to find idle keys,
# which a minute's resolution answers.
KEY_LAST_USED_RESOLUTION_MS = 60_000


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
        the script's answer. A key's own put, and a restore's."""
        reply = await self._t.run(
            script("key_put"), (keys.api_key_record(key_id),),
            [key_id, key_hash, budget_id, run_ceiling_micros, roles, previous_key_hash,
             str(previous_valid_ms), created_ms, rotated_at_ms, last_used_ms,
             *filter(None, [self._now_arg()])])
        return str(reply[0])

    async def get_key(self, key_hash: str, key_id: str | None = None) -> KeyRecord | None:
        await self.open()
        if key_id is None:
            # A secret that does not carry its key id (minted before secrets did, and still in
            # its holder's hands): the entry under its hash names the key whose record decides.
            found = await self._t.execute("HGET", keys.api_key(key_hash), "key_id")
            if found is None:
                await self._no_key()
                return None
            key_id = str(found)
        reply = await self._t.run(
            script("key_check"), (keys.api_key_record(key_id),),
            [key_hash, str(KEY_LAST_USED_RESOLUTION_MS), *filter(None, [self._now_arg()])])
        if reply[0] == "ok":
            return KeyRecord(str(reply[1]), key_hash, BudgetId(str(reply[2])),
                             int(reply[3]) if reply[3] else None, _roles(str(reply[4])))
        if reply[0] == "absent":
            await self._no_key()
        return None

    async def _no_key(self) -> None:
        """For a key not found: LedgerUnavailable (ledger_reset) if the ledger itself is gone."""
        if await self._identity_lost():
            raise self._refusal()

    async def rotate_key(self, key_id: str, new_hash: str, grace_ms: int) -> bool:
        await self.open()
        reply = await self._t.run(
            script("key_rotate"), (keys.api_key_record(key_id),),
            [new_hash, str(grace_ms), *filter(None, [self._now_arg()])])
        if reply[0] == "rotated" and reply[2]:
            # The entry the secret dropped now was found by, if it did not carry its key id.
            await self._t.execute("DEL", keys.api_key(str(reply[2])))
        return reply[0] in ("rotated", "exists")

    async def delete_key(self, key_id: str) -> bool:
        await self.open()
        reply = await self._t.run(script("key_revoke"), (keys.api_key_record(key_id),),
                                  [*filter(None, [self._now_arg()])])
        if reply[0] != "revoked":
            return False
        # The entries that led secrets without their key id to the record (one DEL each: on a
        # Redis Cluster each is in a slot of its own).
        for key_hash in filter(None, reply[1:3]):
            await self._t.execute("DEL", keys.api_key(str(key_hash)))
        await self._t.execute("ZREM", keys.KEYS_KEY, f"{reply[3]} {key_id}")
        return True
