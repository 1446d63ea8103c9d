"""Whole numbers in text a caller sent (a query, a cookie, a header, an argument).

`str.isdigit()` also accepts digits of other scripts and superscripts ('²'), which int()
refuses, and int() refuses more than 4,300 digits: checked with it alone, such text raises
ValueError, an error outside the tree (a 500). Here it is None, which the caller refuses.
"""

from __future__ import annotations

import re

_DIGITS = re.compile(r"[0-9]+")


def whole_number(text: str, digits_max: int) -> int | None:
    """`text` as a whole number of at most `digits_max` ASCII digits, else None."""
    if len(text) > digits_max or not _DIGITS.fullmatch(text):
        return None
    return int(text)
