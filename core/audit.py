"""An entry of the audit stream of admin changes (core/operations.py), as the stream keeps it
(four text fields) and as JSON (what GET /v1/admin/audit lists and a ledger export carries):

    {"id": "1764900000000-0", "at_ms": 1764900000000, "who": "<operator fingerprint>",
     "what": "budget.put", "target": "org:acme", "detail": {...}}

The id is the stream's: the ledger's time in ms when it was appended, then a sequence number.
"""

from __future__ import annotations

import json
import re
from typing import Any

from core.errors import InvalidRequest

STREAM_ID = re.compile(r"\d{1,16}-\d{1,16}")
_TEXT_FIELDS = ("who", "what", "target")


def stream_position(entry_id: str) -> tuple[int, int]:
    """An entry's place in the stream (ids compare by their two numbers, not as text)."""
    ms, _, sequence = entry_id.partition("-")
    return int(ms), int(sequence)


def audit_fields(who: str, what: str, target: str, detail: dict[str, Any]) -> dict[str, str]:
    """An entry as the stream keeps it: the detail in one canonical JSON form."""
    return {"who": who, "what": what, "target": target,
            "detail": json.dumps(detail, sort_keys=True, separators=(",", ":"))}


def audit_json(entry_id: str, fields: dict[str, str]) -> dict[str, Any]:
    return {"id": entry_id, "at_ms": int(entry_id.split("-")[0]), "who": fields.get("who"),
            "what": fields.get("what"), "target": fields.get("target"),
            "detail": json.loads(fields.get("detail") or "{}")}


def audit_entry_of_json(raw: object) -> tuple[str, dict[str, str]]:
    """(id, fields) of an entry `audit_json` gave (InvalidRequest, field 'audit', otherwise)."""
    if not isinstance(raw, dict) or set(raw) != {"id", "at_ms", *_TEXT_FIELDS, "detail"} \
            or not isinstance(raw["id"], str) or not STREAM_ID.fullmatch(raw["id"]) \
            or raw["at_ms"] != int(raw["id"].split("-")[0]) \
            or not all(isinstance(raw[f], str) for f in _TEXT_FIELDS) \
            or not isinstance(raw["detail"], dict):
        raise InvalidRequest("not an audit entry", field="audit")
    return raw["id"], audit_fields(raw["who"], raw["what"], raw["target"], raw["detail"])
