"""Idempotency keys: the only maker of the digests that name a caller's call and tell two
requests apart.

A caller that resends a request under the same Idempotency-Key must reach the same reservation
(core/service.py) and the same kept answer (core/replies.py), and a different request under that
key must be told apart from a resend. Both are digests made here, once, so the reservation and
the reply of one call can never be named by two recipes.
"""

from __future__ import annotations

import hashlib
import json
import re

from core.errors import InvalidRequest
from core.limits import RESERVATION_ID_LEN_MAX

# Printable ASCII without spaces: what HTTP carries in a header unchanged.
_IDEMPOTENCY_KEY = re.compile(rf"[\x21-\x7e]{{1,{RESERVATION_ID_LEN_MAX}}}")
# 128 bits of a SHA-256: as unique as a uuid4, in the 32 hex digits a reservation id ends with.
DIGEST_HEX = 32


def checked_key(idempotency_key: str) -> str:
    if not _IDEMPOTENCY_KEY.fullmatch(idempotency_key):
        raise InvalidRequest(
            f"Idempotency-Key must be 1 to {RESERVATION_ID_LEN_MAX} printable ASCII characters",
            field="Idempotency-Key",
        )
    return idempotency_key


def key_digest(namespace: str, idempotency_key: str) -> str:
    """The digest of an Idempotency-Key in the namespace of whoever sent it (a reservation's
    owner, an API key's id), so two callers that pick the same key never meet."""
    return hashlib.sha256(f"{namespace}\n{checked_key(idempotency_key)}".encode()).hexdigest()[
        :DIGEST_HEX
    ]


def fingerprint(*parts: object) -> str:
    """A digest of everything that makes two requests the same call; objects that JSON cannot
    hold count by their repr (dataclasses of the request, such as its media)."""
    canonical = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:DIGEST_HEX]
