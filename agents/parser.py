"""Action parsing: response text -> (action, valid). Pure; never raises on any text."""
from __future__ import annotations

import re
from typing import Sequence

_EDGE_PUNCTUATION = re.compile(r"^[\W_]+|[\W_]+$")


def _words(text: str) -> list[str]:
    """Whitespace-separated words, lowercased, with punctuation stripped from both ends of each."""
    return [w for w in (_EDGE_PUNCTUATION.sub("", raw.lower()) for raw in text.split()) if w]


def parse_action(text: str, admissible: Sequence[str]) -> tuple[str, bool]:
    """The admissible action the response starts with, and whether there is one.

    The response's first word (lowercased, punctuation stripped: ``" Left."`` -> ``left``) must equal an admissible
    action; what follows it is ignored. An admissible action of several words (``"go north"``) matches the response's
    first words the same way; the longest match wins. Returns the admissible string as given, or ``("", False)``.
    """
    words = _words(text) if isinstance(text, str) else []
    best = ""
    best_len = 0
    for action in admissible:
        action_words = _words(action)
        n = len(action_words)
        if n > best_len and words[:n] == action_words:
            best, best_len = action, n
    return (best, True) if best_len else ("", False)
