"""Mining candidate skills from successful trajectories: frequent contiguous action sub-sequences.

Support of a sub-sequence = fraction of successful trajectories that contain it (each counted once). Sequences
below ``min_support`` are dropped; a sequence inside a longer kept one with the same support is redundant (every
trajectory holding it holds the longer one) and dropped too. The rest rank by support x length, so a long
recurring routine beats a short common one, and the top_k become ``Skill``s with their action sequence as macro.
"""
from __future__ import annotations

import hashlib
import math
import re
from collections import defaultdict

from skills.bank import Skill

MAX_PROVENANCE = 20
DIRECTION_WORDS = frozenset({"left", "right", "up", "down", "north", "south", "east", "west",
                             "forward", "backward", "back"})


def _slug(action: str) -> str:
    return re.sub(r"[^a-z0-9_]+", "-", action.lower()).strip("-") or "x"


def skill_name_for(sequence: tuple[str, ...], *, with_hash: bool = False) -> str:
    """``seq-right-right-down``; long sequences, or actions that are not already lowercase slugs (``go north``),
    get a short hash of the sequence so the name stays valid and distinct."""
    slug = "seq-" + "-".join(_slug(a) for a in sequence)
    if not with_hash and len(slug) <= 64 and all(_slug(a) == a for a in sequence):
        return slug
    digest = hashlib.sha1("\x1f".join(sequence).encode("utf-8")).hexdigest()[:8]
    return f"{slug[:55].rstrip('-_')}-{digest}"


def describe_sequence(sequence: tuple[str, ...]) -> str:
    """Short human procedure, e.g. ``Move right, then right, then down.``"""
    if all(a.lower() in DIRECTION_WORDS for a in sequence):
        return "Move " + ", then ".join(sequence) + "."
    return "Do " + ", then ".join(f"`{a}`" for a in sequence) + "."


def mine_frequent_subsequences(
    action_sequences: list[tuple[str, list[str]]],
    *,
    min_length: int = 2,
    max_length: int = 4,
    min_support: float = 0.2,
    top_k: int = 5,
) -> list[Skill]:
    """Top-k frequent contiguous action sub-sequences of successful trajectories, as Skills.

    ``action_sequences``: (trajectory id, actions) of SUCCESSFUL trajectories only; ids must be unique. Empty
    actions ("" = an invalid action) break sequences: no mined sequence spans one. Deterministic: the result does
    not depend on the order of the input.
    """
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got min_length={min_length}, max_length={max_length}")
    if not 0.0 < min_support <= 1.0:
        raise ValueError(f"min_support must be in (0, 1], got {min_support}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    ids = [tid for tid, _ in action_sequences]
    if len(set(ids)) != len(ids):
        raise ValueError("mine_frequent_subsequences: duplicate trajectory ids in action_sequences")
    total = len(action_sequences)
    if total == 0 or top_k == 0:
        return []

    supporters: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for tid, actions in action_sequences:
        actions = tuple(actions)
        for length in range(min_length, max_length + 1):
            for start in range(len(actions) - length + 1):
                window = actions[start:start + length]
                if all(window):
                    supporters[window].add(tid)  # a set: counted once per trajectory

    min_count = math.ceil(min_support * total - 1e-9)
    kept = {seq: tids for seq, tids in supporters.items() if len(tids) >= min_count}
    # a sequence inside a longer kept one with equal support is inside a one-longer kept one with equal support
    # (any window of the longer one that extends it by one action), so checking those extensions suffices
    redundant = {part for seq, tids in kept.items() if len(seq) > min_length
                 for part in (seq[:-1], seq[1:]) if len(kept[part]) == len(tids)}
    closed = {seq: tids for seq, tids in kept.items() if seq not in redundant}
    # support x length, then support, then length, then the sequence itself: a total, input-independent order
    ranked = sorted(closed.items(), key=lambda item: (-len(item[1]) * len(item[0]), -len(item[1]),
                                                      -len(item[0]), item[0]))

    skills: list[Skill] = []
    for sequence, tids in ranked[:top_k]:
        support = len(tids) / total
        name = skill_name_for(sequence)
        if any(s.name == name for s in skills):  # ("a-b", "c") and ("a", "b-c") share a slug
            name = skill_name_for(sequence, with_hash=True)
        skills.append(Skill(
            name=name,
            when_to_use=(f"When the next moves are likely {' '.join(sequence)}: successful episodes used this "
                         f"sequence ({support:.0%} of them)."),
            procedure=describe_sequence(sequence),
            provenance=tuple(sorted(tids)[:MAX_PROVENANCE]),
            stats={"support": round(support, 6), "count": len(tids), "length": len(sequence)},
            macro=sequence,
        ))
    return skills
