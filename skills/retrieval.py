"""Skill retrieval for the prompt's skill slot: state-grounded embedding scores, MMR, optional UCB, a floor.

docs/algorithms.md section 9 [R: SGDR, D2Skill, SkillRL]. A skill's text is ``when_to_use + "\\n" + procedure``::

    relevance_i = alpha * cos(e_i, e_task) + (1 - alpha) * cos(e_i, e_state)
    score_i     = relevance_i + c * sqrt(ln(1 + N) / (1 + n_i))            (UCB, Auer et al. 2002; c = 0 turns it off)

Skills with ``relevance_i`` below the floor are dropped (the UCB term never lifts an irrelevant skill over it); the
top ``max(3k, 20)`` by score are candidates, and maximal marginal relevance (Carbonell & Goldstein 1998) picks k:
``argmax_i lambda * score_i - (1 - lambda) * max_{j chosen} cos(e_i, e_j)``. ``mode`` says whether a rollout
re-retrieves every step (``per_step``) or keeps the first step's skills for the episode (``per_episode``).

``select_skills`` / ``score_skills`` keep the original TF-IDF behaviour (no stop words, ties by support then name);
they run on the same ``TfidfEmbedder``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal, Mapping, Sequence

import numpy as np

from skills.bank import Skill
from skills.embeddings import Embedder, TfidfEmbedder, default_embedder, tokenize

__all__ = [
    "RetrievalConfig", "SkillRetriever", "grounded_relevance", "mmr_select", "render_skills", "score_skills",
    "select_skills", "skill_line", "skill_text", "tokenize", "ucb_bonus",
]

_SCORE_DECIMALS = 9  # scores equal to this precision count as ties
MIN_CANDIDATES = 20


def skill_text(skill: Skill) -> str:
    """What retrieval embeds for a skill: its trigger, then its procedure."""
    return f"{skill.when_to_use}\n{skill.procedure}"


@dataclass(frozen=True)
class RetrievalConfig:
    """params.yaml ``skills.retrieval``: which skills fill a prompt's skill slot (`SkillRetriever`)."""

    alpha: float = 0.5
    """Weight of the task cosine; 1 - alpha weighs the state cosine (section 9 suggests 0.4-0.5)."""
    k: int = 3
    """Skills to return at most."""
    mmr_lambda: float = 0.7
    """MMR trade-off: 1 ranks by score alone, lower values penalise similarity to skills already chosen."""
    ucb_c: float = 0.0
    """UCB exploration weight; 0 turns it off, 0.05 is the value section 9 suggests when it is on."""
    floor: float | None = None
    """Least relevance kept; None takes the embedder's (0.3 for MiniLM, 0.1 for TF-IDF)."""
    mode: Literal["per_step", "per_episode"] = "per_step"
    """Re-retrieve on every step, or once at the start of an episode (see ``SkillRetriever.retrieve_for_step``)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")
        if not 0.0 <= self.mmr_lambda <= 1.0:
            raise ValueError(f"mmr_lambda must be in [0, 1], got {self.mmr_lambda}")
        if self.ucb_c < 0:
            raise ValueError(f"ucb_c must be >= 0 (0 turns UCB off), got {self.ucb_c}")
        if self.mode not in ("per_step", "per_episode"):
            raise ValueError(f"mode must be 'per_step' or 'per_episode', got {self.mode!r}")


# ------------------------------------------------------------------------------------------- pure scoring

def grounded_relevance(skill_vectors: np.ndarray, task_vector: np.ndarray, state_vector: np.ndarray | None,
                       alpha: float) -> np.ndarray:
    """``alpha * cos(e_i, e_task) + (1 - alpha) * cos(e_i, e_state)`` for unit rows; task alone when no state.

    skill_vectors [S, D], task_vector [D], state_vector [D] or None -> [S].
    """
    task_cos = skill_vectors @ task_vector  # [S]
    if state_vector is None:
        return task_cos
    state_cos = skill_vectors @ state_vector  # [S]
    return alpha * task_cos + (1.0 - alpha) * state_cos  # [S]


def ucb_bonus(uses: np.ndarray, c: float) -> np.ndarray:
    """``c * sqrt(ln(1 + N) / (1 + n_i))`` with N = sum of uses; uses [S] -> [S]. Zero for every skill while N = 0."""
    uses = np.asarray(uses, dtype=float)  # [S]
    total = uses.sum()
    return c * np.sqrt(math.log1p(total) / (1.0 + uses))  # [S]


def mmr_select(scores: np.ndarray, vectors: np.ndarray, k: int, mmr_lambda: float) -> list[int]:
    """Indices picked greedily by ``lambda * score_i - (1 - lambda) * max_{j chosen} cos(e_i, e_j)``.

    scores [C], vectors [C, D] unit rows. The first pick is the best score; ties go to the lower index, so pass
    candidates in the order you want ties broken.
    """
    chosen: list[int] = []
    remaining = list(range(len(scores)))
    similarity = vectors @ vectors.T  # [C, C]
    while remaining and len(chosen) < k:
        if chosen:
            redundancy = similarity[np.ix_(remaining, chosen)].max(axis=1)  # [R]
        else:
            redundancy = np.zeros(len(remaining))  # [R]
        values = mmr_lambda * scores[remaining] - (1.0 - mmr_lambda) * redundancy  # [R]
        pick = remaining[int(np.argmax(values))]
        chosen.append(pick)
        remaining.remove(pick)
    return chosen


def _uses(skill: Skill, counts: Mapping[str, int] | None) -> float:
    value = counts.get(skill.name, 0) if counts is not None else skill.stats.get("uses", 0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


# ------------------------------------------------------------------------------------------- retriever

class SkillRetriever:
    """Retrieves up to k skills for a (task, state) pair; skill embeddings are computed once, at construction.

    ``embedder=None`` takes ``default_embedder`` (MiniLM, or TF-IDF fitted on the skill texts, cached).
    """

    def __init__(self, skills: Sequence[Skill], embedder: Embedder | None = None, *, alpha: float = 0.5, k: int = 3,
                 mmr_lambda: float = 0.7, ucb_c: float = 0.0, floor: float | None = None,
                 mode: Literal["per_step", "per_episode"] = "per_step") -> None:
        self.config = RetrievalConfig(alpha=alpha, k=k, mmr_lambda=mmr_lambda, ucb_c=ucb_c, floor=floor, mode=mode)
        self.skills = list(skills)
        texts = [skill_text(skill) for skill in self.skills]
        self.embedder: Embedder = embedder if embedder is not None else default_embedder(texts)
        self.floor = floor if floor is not None else self.embedder.default_floor
        self.skill_vectors = np.asarray(self.embedder.embed(texts), dtype=float)  # [S, D]

    @classmethod
    def from_config(cls, skills: Sequence[Skill], config: RetrievalConfig,
                    embedder: Embedder | None = None) -> SkillRetriever:
        return cls(skills, embedder, **asdict(config))

    def retrieve(self, task: str, state: str, counts: Mapping[str, int] | None = None) -> list[tuple[Skill, float]]:
        """Up to k ``(skill, score)`` pairs, in MMR order; score = relevance + UCB bonus.

        ``counts`` maps skill names to uses; without it each skill's ``stats["uses"]`` is read (missing = 0).
        A blank ``state`` leaves the state term out (score on the task alone).
        """
        config = self.config
        if not self.skills or config.k == 0:
            return []
        queries = [task, state] if state.strip() else [task]
        query_vectors = np.asarray(self.embedder.embed(queries), dtype=float)  # [1 or 2, D]
        state_vector = query_vectors[1] if len(queries) == 2 else None
        relevance = grounded_relevance(self.skill_vectors, query_vectors[0], state_vector, config.alpha)  # [S]
        uses = np.array([_uses(skill, counts) for skill in self.skills])  # [S]
        scores = relevance + (ucb_bonus(uses, config.ucb_c) if config.ucb_c > 0 else 0.0)  # [S]
        eligible = [i for i in range(len(self.skills)) if relevance[i] >= self.floor]
        # best score first; ties by name so the result does not depend on the bank's order
        eligible.sort(key=lambda i: (-round(float(scores[i]), _SCORE_DECIMALS), self.skills[i].name))
        candidates = eligible[:max(3 * config.k, MIN_CANDIDATES)]
        if not candidates:
            return []
        picked = mmr_select(scores[candidates], self.skill_vectors[candidates], config.k, config.mmr_lambda)
        return [(self.skills[candidates[p]], float(scores[candidates[p]])) for p in picked]

    def retrieve_for_step(self, step: int, task: str, state: str,
                          previous: list[tuple[Skill, float]] | None = None,
                          counts: Mapping[str, int] | None = None) -> list[tuple[Skill, float]]:
        """``retrieve`` on every step in ``per_step`` mode; in ``per_episode`` mode only at step 0 (or when no
        ``previous`` result is given), returning ``previous`` unchanged afterwards."""
        if self.config.mode == "per_episode" and step > 0 and previous is not None:
            return previous
        return self.retrieve(task, state, counts)


# ------------------------------------------------------------------------------------------- original API

def _support(skill: Skill) -> float:
    value = skill.stats.get("support", 0.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def score_skills(skills: Sequence[Skill], query: str) -> list[float]:
    """TF-IDF cosine similarity in [0, 1] of ``query`` to each skill's when_to_use + procedure.

    The idf comes from the skills; query words no skill uses are ignored (the original pure-Python scoring).
    """
    if not skills:
        return []
    embedder = TfidfEmbedder([skill_text(s) for s in skills], stop_words=(), count_unknown_words=False)
    vectors = embedder.embed([skill_text(s) for s in skills] + [query])  # [S + 1, V + 1]
    return [float(x) for x in vectors[:-1] @ vectors[-1]]


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
    return "\n".join(f"Skill: {skill_line(skill)}" for skill in skills)


def skill_line(skill: Skill) -> str:
    """What a prompt shows of one skill: its macro's actions, else the first line of its procedure (<= 80 chars)."""
    if skill.macro:
        return " ".join(skill.macro)
    first = next((line.strip() for line in skill.procedure.splitlines() if line.strip()), skill.name)
    return first.lstrip("#-* ").strip()[:80]
