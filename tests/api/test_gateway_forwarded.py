"""The provider reads the document the gateway priced, not the client's bytes (core/gateway.py
Plan.content).

Forwarding the client's own bytes when the gateway changed nothing would save one JSON encode a
call, and hand a hostile key holder a parser differential: a key given twice is resolved by each
JSON parser its own way (the last wins in Python's, the first in others, some refuse it), so the
gateway could price one output cap while the provider read another.
"""

from __future__ import annotations

import json

from core.formats import Api
from core.gateway_request import plan


def test_a_key_given_twice_reaches_the_provider_once_as_priced() -> None:
    raw = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
           b'"max_tokens": 10, "max_tokens": 100000}')
    priced = plan(Api.CHAT, raw)
    assert priced.output_tokens_max == 100_000
    sent = priced.content()
    assert sent.count(b'"max_tokens"') == 1
    assert json.loads(sent)["max_tokens"] == 100_000


def test_the_body_is_encoded_anew_even_when_nothing_changed() -> None:
    raw = b'{ "model" : "m", "messages" : [ {"role": "user", "content": "hi"} ], "max_tokens": 5 }'
    sent = plan(Api.CHAT, raw).content()
    assert sent != raw
    assert json.loads(sent) == json.loads(raw)
