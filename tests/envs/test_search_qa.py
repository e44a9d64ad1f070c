"""SearchQA: the generated corpus, BM25 retrieval, answer scoring, actions, tools, splits and the expert."""
from __future__ import annotations

import json
from importlib import resources

import pytest

from envs import ENVS, make_scenarios
from envs.scenarios import expert_trajectory
from envs.search_corpus import entity_split, generate, main, to_jsonl
from envs.search_qa import (ANSWER_TOOL, SEARCH_TOOL, SearchQA, exact_match, load_documents, load_questions,
                            normalize_answer, parse_action, search_index, token_f1)

QUESTIONS = load_questions()
BY_ID = {q["id"]: q for q in QUESTIONS}


def first_question(prefix: str = "", **fields) -> dict:
    """The first question starting with ``prefix`` whose fields equal ``fields``."""
    return next(q for q in QUESTIONS if q["question"].startswith(prefix) and all(q[k] == v for k, v in fields.items()))


def shipped(name: str) -> str:
    return resources.files("envs").joinpath("data", name).read_text(encoding="ascii")


# ----------------------------------------------------------------------------------------- corpus
def test_generator_is_deterministic_and_shipped_files_equal_a_fresh_generation():
    docs, questions = generate()
    assert (docs, questions) == generate()
    assert shipped("search_qa_corpus.jsonl") == to_jsonl(docs)
    assert shipped("search_qa_questions.jsonl") == to_jsonl(questions)
    assert generate(seed=1)[0] != docs


def test_cli_writes_both_files(tmp_path):
    main(["--out", str(tmp_path / "corpus.jsonl")])
    assert (tmp_path / "corpus.jsonl").read_text() == shipped("search_qa_corpus.jsonl")
    assert (tmp_path / "search_qa_questions.jsonl").read_text() == shipped("search_qa_questions.jsonl")


def test_corpus_shape_and_question_fields():
    docs = load_documents()
    assert 300 <= len(docs) <= 1000
    assert all(set(d) == {"id", "title", "text"} for d in docs)
    assert len({d["id"] for d in docs}) == len(docs) and len({d["title"] for d in docs}) == len(docs)
    assert all(2 <= d["text"].count(". ") + 1 <= 4 for d in docs)
    doc_ids = {d["id"] for d in docs}
    assert {q["kind"] for q in QUESTIONS} == {"single", "bridge", "comparison"}
    for q in QUESTIONS:
        assert q["hops"] == len(q["support"]) == len(q["queries"]) == (1 if q["kind"] == "single" else 2)
        assert set(q["support"]) <= doc_ids and q["answer"]
    assert len({q["question"] for q in QUESTIONS}) == len(QUESTIONS)


def test_bridge_answers_are_not_in_the_first_document():
    """A bridge question needs its second document: the first one never states the answer."""
    text = {d["id"]: normalize_answer(d["text"]) for d in load_documents()}
    bridges = [q for q in QUESTIONS if q["kind"] == "bridge"]
    assert len(bridges) >= 500
    for q in bridges:
        assert normalize_answer(q["answer"]) not in text[q["support"][0]], q
        assert normalize_answer(q["answer"]) in text[q["support"][1]], q


def test_hand_checked_facts():
    q = BY_ID["q0601"]
    assert q["question"] == "In what year was the founder of Halailar born?"
    assert (q["answer"], q["support"], q["queries"]) == ("1864", ["o000", "p019"],
                                                         ["Halailar founded", "Ysolde Haklind born"])
    docs = {d["id"]: d for d in load_documents()}
    assert "Halailar was founded by Ysolde Haklind in 1915." in docs["o000"]["text"]
    assert "Ysolde Haklind was born in Dedaindby in 1864." in docs["p019"]["text"]


# ----------------------------------------------------------------------------------------- retrieval
def test_expert_queries_retrieve_every_gold_document_in_the_top_3():
    index = search_index()
    for q in QUESTIONS:
        for doc_id, query in zip(q["support"], q["queries"]):
            assert doc_id in [index.docs[i]["id"] for i in index.search(query, 3)], (q["id"], query)


def test_expert_observations_show_the_bridge_entity_and_the_answer():
    env = SearchQA()
    for q in QUESTIONS[::3]:
        env.reset(options={"question_id": q["id"]})
        observations = []
        while (action := env.expert_action()).startswith("search["):
            observations.append(env.step(action)[0])
        assert 1 <= len(observations) <= q["hops"]
        index = search_index()
        for doc_id, query in zip(q["support"], q["queries"]):  # each gold document's evidence was shown
            assert index.best_sentence(index.position[doc_id], query) in "\n".join(observations), q
        if q["kind"] != "comparison":
            assert normalize_answer(q["answer"]) in normalize_answer(observations[-1]), q
        if q["kind"] == "bridge":
            bridge_title = next(d["title"] for d in load_documents() if d["id"] == q["support"][1])
            assert bridge_title in observations[0], q


def test_search_observation_is_short_snippets():
    env = SearchQA()
    env.reset(options={"question_id": "q0601"})
    obs, reward, terminated, truncated, info = env.step("search[Halailar founded]")
    lines = obs.split("\n")
    assert lines[0] == "Halailar was founded by Ysolde Haklind in 1915."
    assert len(lines) == 3 and all(len(line) <= 120 for line in lines)
    assert (reward, terminated, truncated, info["action_valid"]) == (0.0, False, False, True)
    assert "o000" in info["retrieved"] and len(info["retrieved"]) == 3
    short = SearchQA(snippet_chars=30, top_k=1)
    short.reset(options={"question_id": "q0601"})
    assert short.step("search[Halailar founded]")[0] == "Halailar was founded by Yso..."
    full = SearchQA(verbosity="full", top_k=1)
    full.reset(options={"question_id": "q0601"})
    assert full.step("search[Halailar founded]")[0] == (
        "Halailar: Halailar is an aviation company. Halailar was founded by Ysolde Haklind in 1915. "
        "Halailar is headquartered in Mairurby.")


# ----------------------------------------------------------------------------------------- scoring
def test_squad_normalisation_em_and_f1_by_hand():
    assert normalize_answer("The Eiffel  Tower!") == "eiffel tower"
    assert exact_match("The Eiffel Tower", "eiffel tower") == 1.0
    assert exact_match("Eiffel", "eiffel tower") == 0.0
    assert token_f1("Eiffel Tower Paris", "the Eiffel Tower") == pytest.approx(0.8)  # P=2/3, R=1
    assert token_f1("Paris", "Eiffel Tower") == 0.0
    assert token_f1("the", "") == 1.0 and token_f1("x", "the") == 0.0


def test_answer_rewards_em_by_default_and_f1_on_request():
    q = first_question("Who founded ", kind="single")
    first_name, last_name = q["answer"].split(" ")  # a person: F1 of the last name alone is 2 * 1 * 0.5 / 1.5
    for reward_kind, expected in (("em", 0.0), ("f1", pytest.approx(2 / 3))):
        env = SearchQA(reward=reward_kind)
        env.reset(options={"question_id": q["id"]})
        obs, reward, terminated, truncated, info = env.step(f"answer[ {last_name.lower()} ]")
        assert (reward, terminated, truncated, info["won"], obs) == (expected, True, False, False, "Incorrect.")
        assert info["em"] == 0.0 and info["f1"] == pytest.approx(2 / 3)
    env = SearchQA()
    env.reset(options={"question_id": q["id"]})
    obs, reward, _, _, info = env.step(f"ANSWER[The {first_name}, {last_name.upper()}.]")
    assert (obs, reward, info["won"], info["em"], info["f1"]) == ("Correct.", 1.0, True, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("answer[again]")


# ----------------------------------------------------------------------------------------- actions
@pytest.mark.parametrize("action", ["Halailar founded", "lookup[Halailar]", "search[]", "search[   ]", "answer[]",
                                    "search[x] and more", "", None])
def test_invalid_actions_count_and_never_raise(action):
    env = SearchQA(invalid_penalty=0.5)
    _, info0 = env.reset(seed=3)
    obs, reward, terminated, truncated, info = env.step(action)
    assert (reward, terminated, truncated, info["action_valid"]) == (-0.5, False, False, False)
    assert (info["tool_call"], info["tool_success"], info["steps"]) == (None, None, 1)
    assert obs == "Invalid action. Use search[query] or answer[text]."
    assert info["anchor"] == info0["anchor"]


def test_parse_action():
    assert parse_action(" Search [ river Ossen ] ") == ("search", "river Ossen")
    assert parse_action("answer[a[b]]") == ("answer", "a[b]")
    assert parse_action("search(x)") is None and parse_action(42) is None


def test_truncation_without_an_answer_gives_zero():
    env = SearchQA(max_steps=2)
    env.reset(seed=0)
    assert env.step("search[Halailar]")[2:4] == (False, False)
    obs, reward, terminated, truncated, info = env.step("bogus")
    assert (reward, terminated, truncated, info["won"], info["em"]) == (0.0, False, True, False, None)
    assert env.expert_action() is None


def test_tool_calls_in_openai_format():
    assert [t["function"]["name"] for t in SearchQA.tools] == ["search", "answer"]
    assert SearchQA.tools == (SEARCH_TOOL, ANSWER_TOOL)
    env = SearchQA()
    _, info = env.reset(seed=0)
    assert info["tool_call"] is None and info["tool_success"] is None
    _, _, _, _, info = env.step("search[Halailar founded]")
    assert info["tool_call"]["type"] == "function" and info["tool_call"]["function"]["name"] == "search"
    assert json.loads(info["tool_call"]["function"]["arguments"]) == {"query": "Halailar founded"}
    assert info["tool_success"] is True
    obs, _, _, _, info = env.step("search[zzzzq qqqqz]")  # words the corpus does not have
    assert (obs, info["tool_success"], info["action_valid"]) == ("No results.", False, True)
    _, _, _, _, info = env.step('answer[say "hi"]')
    assert json.loads(info["tool_call"]["function"]["arguments"]) == {"answer": 'say "hi"'}
    assert info["tool_call"]["function"]["name"] == "answer" and info["tool_success"] is True


def test_closed_book_mode_allows_only_answers():
    for env, options in ((SearchQA(tools_enabled=False), {}), (SearchQA(), {"tools_enabled": False})):
        env.reset(seed=4, options=options)
        assert env.tools == (ANSWER_TOOL,) and "no search" in env.task_description()
        obs, _, terminated, _, info = env.step("search[anything]")
        assert (info["action_valid"], terminated, info["tool_call"]) == (False, False, None)
        assert obs == "Invalid action. Use answer[text] (search is disabled)."
        action = env.expert_action()
        assert action.startswith("answer[")
        _, reward, terminated, _, info = env.step(action)
        assert (reward, terminated, info["won"], info["steps"]) == (1.0, True, True, 2)


# ----------------------------------------------------------------------------------------- splits and reset
def test_splits_partition_questions_by_their_entities():
    train = [q for q in QUESTIONS if q["split"] == "train"]
    heldout = [q for q in QUESTIONS if q["split"] == "heldout"]
    assert len(train) + len(heldout) == len(QUESTIONS) and 150 <= len(heldout) <= 400
    assert not {e for q in train for e in q["entities"]} & {e for q in heldout for e in q["entities"]}
    assert all(entity_split(e) == q["split"] for q in QUESTIONS for e in q["entities"])
    for kind in ("single", "bridge", "comparison"):
        assert any(q["kind"] == kind for q in heldout)
    env = SearchQA()
    for seed in range(40):
        _, info = env.reset(seed=seed, options={"split": "heldout", "hops": 2})
        assert BY_ID[info["question_id"]]["split"] == "heldout" and info["hops"] == 2
        _, info = env.reset(seed=seed)  # default split: train
        assert BY_ID[info["question_id"]]["split"] == "train"


def test_seeded_question_choice_and_anchor():
    env = SearchQA()
    picks = {env.reset(seed=s)[1]["question_id"] for s in range(30)}
    assert len(picks) > 25 and env.reset(seed=7) == env.reset(seed=7)
    obs, info = env.reset(options={"question_id": "q0601"})
    assert obs == "Question: In what year was the founder of Halailar born?"
    assert info["anchor"] == "q0601||open"
    _, _, _, _, first = env.step("search[Halailar founded]")
    _, _, _, _, again = env.step("search[Halailar founded]")  # same results: same state, same anchor
    assert first["anchor"] == again["anchor"] == "q0601|" + ",".join(first["retrieved"]) + "|open"
    _, _, _, _, done = env.step("answer[1864]")
    assert done["anchor"].endswith("|answered")


def test_bad_options_and_kwargs_say_what_is_valid():
    env = SearchQA()
    with pytest.raises(ValueError, match="valid options"):
        env.reset(seed=0, options={"hop": 1})
    with pytest.raises(ValueError, match="valid splits"):
        env.reset(seed=0, options={"split": "test"})
    with pytest.raises(ValueError, match="hops must be"):
        env.reset(seed=0, options={"hops": 3})
    with pytest.raises(ValueError, match="valid ids"):
        env.reset(options={"question_id": "q9999"})
    heldout_id = first_question(split="heldout")["id"]
    with pytest.raises(ValueError, match="drop the split option"):
        env.reset(options={"question_id": heldout_id, "split": "train"})
    with pytest.raises(ValueError, match="reward must be one of"):
        SearchQA(reward="accuracy")
    with pytest.raises(ValueError, match="top_k >= 1"):
        SearchQA(top_k=0)
    with pytest.raises(RuntimeError, match="reset"):
        SearchQA().step("search[x]")


# ----------------------------------------------------------------------------------------- expert
def test_expert_wins_every_scenario_of_both_splits():
    assert ENVS["search_qa"] is SearchQA and SearchQA.split_aware
    for split in ("train", "heldout"):
        for scenario in make_scenarios("search_qa", split, 60, seed=0):
            steps = expert_trajectory(scenario)  # raises unless won
            question = BY_ID[SearchQA().reset(seed=scenario.seed, options=dict(scenario.options))[1]["question_id"]]
            assert question["split"] == split and 2 <= len(steps) <= question["hops"] + 1
            assert steps[-1][2] == f"answer[{question['answer']}]"


def test_expert_answers_when_only_one_step_is_left():
    env = SearchQA(max_steps=3)
    env.reset(options={"question_id": "q0601"})
    env.step("search[something unrelated]")
    env.step("search[Halailar founded]")
    assert env.expert_action() == "answer[1864]"
    assert env.step(env.expert_action())[4]["won"]


def test_expert_skips_a_search_whose_evidence_was_already_shown():
    env = SearchQA()
    env.reset(options={"question_id": "q1326"})  # The Golden Compass (1926) vs The Golden Kingdom (1914)
    assert env.expert_action() == "search[The Golden Compass published]"
    obs = env.step(env.expert_action())[0]
    assert "The Golden Kingdom was published in 1914." in obs.split("\n")
    assert env.expert_action() == "answer[The Golden Kingdom]"
    env.reset(options={"question_id": "q1326"})
    obs, _, _, _, info = env.step("search[Golden Compass]")  # retrieves the gold b066, shows another sentence
    assert "b066" in info["retrieved"] and "published" not in obs
    assert env.expert_action() == "search[The Golden Compass published]"
