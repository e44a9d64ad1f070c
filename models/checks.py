"""Value checks for the frozen config dataclasses (called from their ``__post_init__``).

One rule table, so every config says "must be > 0" the same way and the params loader can name the exact key:
a failed check raises ``ConfigValueError`` carrying the field name. ``check_config`` also rejects NaN and infinite
values in every float field (YAML reads ``.nan`` and ``.inf``; no knob of ours means anything at infinity).

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Demo:
    ...     epochs: int = 1
    ...     def __post_init__(self): check_config(self, epochs="positive")
    >>> Demo(0)
    Traceback (most recent call last):
    ...
    models.checks.ConfigValueError: epochs = 0: must be > 0
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: v > 0, "> 0"),
    "non_negative": (lambda v: v >= 0, ">= 0"),
    "probability": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "open_probability": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "fraction": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
}
"""Rule name -> (predicate, what it requires, as the error says it)."""


class ConfigValueError(ValueError):
    """A config field holds a value outside its range; ``field`` names it (the loader prefixes the section)."""

    def __init__(self, field: str, value: Any, requirement: str) -> None:
        self.field, self.value, self.requirement = field, value, requirement
        super().__init__(f"{field} = {value!r}: must be {requirement}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_config(config: Any, **rules: str) -> None:
    """Every float field of the dataclass ``config`` is finite, and each field named in ``rules`` satisfies its rule
    (a key of RULES). ``None`` values are skipped (an optional knob left unset)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigValueError(f.name, value, "a finite number")
    for name, rule in rules.items():
        value = getattr(config, name)
        if value is None:
            continue
        predicate, requirement = RULES[rule]
        if not _is_number(value) or not predicate(value):
            raise ConfigValueError(name, value, requirement)


def check_choice(config: Any, name: str, choices: tuple[str, ...] | list[str]) -> None:
    """``config.<name>`` is one of ``choices``."""
    value = getattr(config, name)
    if value not in choices:
        raise ConfigValueError(name, value, f"one of {list(choices)}")
