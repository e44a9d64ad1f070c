"""Skill retrieval for the prompt's skill slot: bag-of-words TF-IDF cosine, pure Python, no model.

Each skill's document is ``when_to_use + procedure``; the query is usually the current observation or task text.
Scores tie (often at zero for a short query) and ties go to the skill with the higher ``stats['support']``, then
to the name, so the choice is deterministic.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from typing import Sequence

from skills.bank import Skill

_TOKEN_RE = re.compile(r"[a-z0-9]+")
_SCORE_DECIMALS = 9  # scores equal to this precision count as ties


def tokenize(text: str) -> list[str]:
    return _TOKEN_RE.findall(text.lower())


def _idf(documents: list[Counter[str]]) -> dict[str, float]:
    """Smoothed idf: log((1 + N) / (1 + df)) + 1, so a term in every document still counts a little."""
    n = len(documents)
    document_frequency: Counter[str] = Counter()
    for counts in documents:
        document_frequency.update(counts.keys())
    return {term: math.log((1 + n) / (1 + df)) + 1.0 for term, df in document_frequency.items()}


def _unit_vector(counts: Counter[str], idf: dict[str, float]) -> dict[str, float]:
    weights = {term: count * idf[term] for term, count in counts.items() if term in idf}
    norm = math.sqrt(sum(w * w for w in weights.values()))
    return {term: w / norm for term, w in weights.items()} if norm > 0 else {}


def score_skills(skills: Sequence[Skill], query: str) -> list[float]:
    """TF-IDF cosine similarity in [0, 1] of ``query`` to each skill's when_to_use + procedure."""
    documents = [Counter(tokenize(f"{s.when_to_use}\n{s.procedure}")) for s in skills]
    idf = _idf(documents)
    query_vector = _unit_vector(Counter(tokenize(query)), idf)
    scores = []
    for counts in documents:
        vector = _unit_vector(counts, idf)
        scores.append(sum(w * vector.get(term, 0.0) for term, w in query_vector.items()))
    return scores


def _support(skill: Skill) -> float:
    value = skill.stats.get("support", 0.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def select_skills(skills: Sequence[Skill], query: str, k: int = 1, min_score: float = 0.0) -> list[Skill]:
    """The ``k`` skills most similar to ``query``, best first; skills scoring below ``min_score`` are left out.

    With the default ``min_score=0.0`` every skill is eligible, so a query that shares no word with any skill
    still gets the best-supported skills; pass a small positive ``min_score`` to require some overlap.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not skills or k == 0:
        return []
    scores = score_skills(skills, query)
    ranked = sorted(zip(scores, skills), key=lambda pair: (-round(pair[0], _SCORE_DECIMALS), -_support(pair[1]),
                                                            pair[1].name))
    return [skill for score, skill in ranked if score >= min_score][:k]


def render_skills(skills: Sequence[Skill]) -> str:
    """Compact text for the prompt's skill slot, one line per skill: ``Skill: right right down``.

    A skill with a macro shows its actions; one without shows the first line of its procedure (<= 80 chars).
    """
    lines = []
    for skill in skills:
        if skill.macro:
            body = " ".join(skill.macro)
        else:
            first = next((line.strip() for line in skill.procedure.splitlines() if line.strip()), skill.name)
            body = first.lstrip("#-* ").strip()[:80]
        lines.append(f"Skill: {body}")
    return "\n".join(lines)
