"""The one reader of a format /1 ledger export: its body as the /2 body it means
(core/stores/export_body.py), so operators' backups made before /2 still restore, through the
same checks and the same writes as a /2 export.

A /1 body held what the ledger kept, as it kept it: per organisation its meta hash ('meta': the
reserve sequence 'seq', the list of velocity alarms, which a restore makes again from the
definitions), each budget's definition hash ('budgets': budget_id, fields), each counter's hash
('counters': budget_id, window_key, fields, ttl_ms: a counter's expiry from before counters
carried none, which a restore no longer gives them), its open reservations as packed records
('open_reservations': reservation_id, record, and reserved_micros and legs repeated from it) and
each budget's end users ('users'); and every key's record ('keys', its fields, or those of the
layout before records were by id with its current secret's 'key_hash').
"""

from __future__ import annotations

from typing import Any

from core.alerts import AlertConfig
from core.errors import CeilingError
from core.ledger import invalid_export
from core.stores import wire
from core.stores.export_body import counter_entry, key_entry, organisation, reservation_entry
from core.stores.migrate import ROLES_BEFORE_ROLES
from core.stores.scripted_catalogue import definition_of

EXPORT_FORMAT_1 = "spend-ceiling/ledger-export/1"


def body_of_format_1(body: object) -> dict[str, Any]:
    """The /2 body a /1 body means; invalid_export for one no /1 export could be. What it gives
    is checked as any /2 body is (export_body.checked)."""
    try:
        return _converted(body)
    except (CeilingError, KeyError, ValueError, TypeError, AttributeError) as exc:
        if isinstance(exc, CeilingError) and exc.details.get("field") == "export":
            raise
        raise invalid_export(f"not a format /1 body ({type(exc).__name__}: {exc})") from exc


def _refused(why: str) -> bool:
    raise invalid_export(why)


def _strings(value: object, why: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid_export(why)
    return value


def _converted(body: object) -> dict[str, Any]:
    if not isinstance(body, dict) or not isinstance(body.get("organisations"), list) \
            or not isinstance(body.get("keys"), list):
        raise invalid_export("no organisations or keys")
    orgs = []
    for org in body["organisations"]:
        definitions = {b["budget_id"]: definition_of(
            b["budget_id"], _definition(_strings(b["fields"], "a definition")))
                       for b in org.get("budgets", [])}
        counters = [counter_entry(c["budget_id"], c["window_key"],
                                  _strings(c["fields"], "a counter"))
                    for c in org.get("counters", [])]
        reservations = [reservation_entry(r["reservation_id"],
                                          wire.StoredRecord.unpacked(r["record"]))
                        for r in org.get("open_reservations", [])]
        users = {u["budget_id"]: u["users"] for u in org.get("users", [])
                 if isinstance(u["users"], list) or _refused("a budget's end users")}
        orgs.append(organisation(org["tag"], _strings(org.get("meta", {}), "meta"),
                                 definitions, counters, reservations, users))
    return {"organisations": orgs,
            "keys": [key_entry(_key_record(_strings(k, "a key"))) for k in body["keys"]]}


def _definition(fields: dict[str, str]) -> dict[str, str]:
    """A /1 definition's hash as the ledger now keeps one: one put before alerts lacks the alert
    fields, and alerts on what `ceiling ledger migrate` gives such a one."""
    return {"alert_thresholds_pct": AlertConfig().thresholds_ledger_form,
            wire.VELOCITY_DEFINITION_FIELD: "", **fields}


def _key_record(fields: dict[str, str]) -> dict[str, str]:
    """A /1 key's fields as a record (lua/key_put.lua): one of the layout before records were
    by id may lack roles (it takes the roles `ceiling ledger migrate` gives such a key) and keep
    its run ceiling under 'run'."""
    record = {name: value for name, value in fields.items() if name != "run"}
    record.setdefault("roles", ROLES_BEFORE_ROLES)
    if "run" in fields:
        record.setdefault("run_ceiling_micros", fields["run"])
    return record
