"""The ``[n]`` citation markers an answer carries, parsed."""

from __future__ import annotations

import re

_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_NUMBER_LIST = re.compile(r"^\s*\d+(\s*[,;]\s*\d+)*\s*$")


def parse_citations(text: str, n_docs: int) -> tuple[list[int], list[int]]:
    """Bracketed citations such as ``[2]``, ``[1][3]`` or ``[1, 3]``.

    Returns ``(valid, invalid)``: distinct numbers in order of first appearance; valid ones
    refer to documents ``1..n_docs``, the rest (``[0]``, ``[n_docs + 1]``) are invalid.
    Brackets holding anything but numbers (``[a]``, ``[1-3]``) are not citations.
    """
    valid: list[int] = []
    invalid: list[int] = []
    for inner in _BRACKET.findall(text):
        if not _NUMBER_LIST.match(inner):
            continue
        for part in re.split(r"[,;]", inner):
            number = int(part)
            bucket = valid if 1 <= number <= n_docs else invalid
            if number not in bucket:
                bucket.append(number)
    return valid, invalid
