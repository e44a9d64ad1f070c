"""Multi-hop question answering over a local corpus with a BM25 search tool.

The corpus and questions are the generated fictional world of ``envs/search_corpus.py``, shipped as package data
(``envs/data/search_qa_corpus.jsonl``, ``envs/data/search_qa_questions.jsonl``). An episode is one question::

    Question: In which city was the founder of Quarlex born?

Actions (case-insensitive verb, one per step):

- ``search[<query>]``: BM25 (``bm25s``) over the corpus; the observation is up to ``top_k`` results, one line each:
  the document's sentence that shares the most words with the query (ties: the earlier sentence), prefixed by the
  title unless the sentence already names it, cut to ``snippet_chars``. ``verbosity="full"`` shows whole documents.
- ``answer[<text>]``: ends the episode. Reward is SQuAD-style exact match (lowercase, no punctuation, no articles,
  collapsed whitespace) with ``reward="em"`` (default), token F1 with ``reward="f1"``; ``won`` is exact match.

Anything else (no brackets, another verb, an empty query or answer, or a search while tools are disabled) is an
invalid action: reward ``-invalid_penalty``, the step still counts. ``max_steps`` steps without an answer truncate
with reward 0. With ``tools_enabled=False`` the episode is closed-book: only ``answer[...]`` is valid.

Tool view (see envs/base.py): ``info["tool_call"]`` is the OpenAI function call of the step's action, a ``search``
call ``{"query": q}`` or an ``answer`` call ``{"answer": a}`` (None for an invalid action); ``info["tool_success"]``
is whether a search returned at least one document (True for an answer, None for an invalid action). ``tools``
holds both function schemas (an instance with tools disabled lists only ``answer``).

Splits: a question's split is that of the entities it names (``entity_split`` in search_corpus: sha1 of the entity
id, 20% held out). So no held-out question names an entity that a train question names. What leaks: all
documents are searchable in both splits, and a held-out entity can be the bridge or answer of a train question
("the founder of <train company>" may be a held-out person), so closed-book memorisation of train answers can
help on held-out questions.

Scenario key (``scenario_key``): the question, its gold answer (it sets the reward) and whether tools are on.

The BM25 index is built once per process, on first use (``search_index()``, cached). Pure module: package data
only, no Prefect, MLflow, DVC or file paths.
"""
from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from functools import lru_cache
from importlib import resources

import numpy as np

from envs.base import check_reset_options, register_env
from envs.search_corpus import sentences

RESET_OPTIONS: tuple[str, ...] = ("split", "question_id", "hops", "tools_enabled")
SPLITS: tuple[str, ...] = ("train", "heldout")
REWARDS: tuple[str, ...] = ("em", "f1")
VERBOSITIES: tuple[str, ...] = ("short", "full")
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "BM25 search over the encyclopedia; returns the top documents as snippets.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "search words"}},
                   "required": ["query"]}}}
ANSWER_TOOL = {"type": "function", "function": {
    "name": "answer", "description": "Give the final answer to the question; ends the episode.",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string", "description": "a short answer"}},
                   "required": ["answer"]}}}
_ACTION = re.compile(r"^\s*(search|answer)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)
_TOKEN = re.compile(r"(?u)\b\w\w+\b")  # bm25s's default token pattern


# ----------------------------------------------------------------------------------------- data and index
def _read_jsonl(name: str) -> tuple[dict, ...]:
    resource = resources.files("envs").joinpath("data", name)
    if not resource.is_file():
        raise FileNotFoundError(f"search_qa: package data envs/data/{name} is missing: regenerate it with "
                                f"`python -m envs.search_corpus --out envs/data/search_qa_corpus.jsonl`")
    return tuple(json.loads(line) for line in resource.read_text(encoding="ascii").splitlines() if line)


@lru_cache(maxsize=1)
def load_documents() -> tuple[dict, ...]:
    """The shipped corpus: ``{"id", "title", "text"}`` per document."""
    return _read_jsonl("search_qa_corpus.jsonl")


@lru_cache(maxsize=1)
def load_questions() -> tuple[dict, ...]:
    """The shipped questions (fields documented in envs/search_corpus.py), in id order."""
    return _read_jsonl("search_qa_questions.jsonl")


class SearchIndex:
    """BM25 over ``docs`` (title + text, English stopwords, no stemming) with query-dependent snippets."""

    def __init__(self, docs: tuple[dict, ...]) -> None:
        import bm25s  # with scipy: seconds, so on first use rather than on `import envs`
        from bm25s.tokenization import Tokenizer

        self.docs = docs
        self.position = {d["id"]: i for i, d in enumerate(docs)}  # doc id -> index
        self.stopwords = set(bm25s.stopwords.STOPWORDS_EN)
        self.tokenizer = Tokenizer(stopwords="en")
        corpus_ids = self.tokenizer.tokenize([f"{d['title']} {d['text']}" for d in docs], update_vocab=True,
                                             show_progress=False)
        self.retriever = bm25s.BM25()
        self.retriever.index(corpus_ids, show_progress=False)
        self.sentences = [sentences(d["text"]) for d in docs]

    def terms(self, text: str) -> set[str]:
        """The text's index terms: lowercased words of 2+ characters, stopwords dropped."""
        return {t for t in _TOKEN.findall(text.lower()) if t not in self.stopwords}

    def search(self, query: str, top_k: int) -> list[int]:
        """Indices of the best ``top_k`` documents with a positive score (unknown words match nothing)."""
        query_ids = self.tokenizer.tokenize([query], update_vocab="never", show_progress=False)
        k = min(top_k, len(self.docs))
        hits, scores = self.retriever.retrieve(query_ids, k=k, show_progress=False, n_threads=1)  # [1, k] each
        return [int(i) for i, s in zip(hits[0], scores[0]) if s > 0]

    def best_sentence(self, doc_index: int, query: str) -> str:
        """The document's sentence sharing the most query terms (the earliest one on a tie)."""
        query_terms = self.terms(query)
        overlaps = [len(query_terms & self.terms(s)) for s in self.sentences[doc_index]]
        return self.sentences[doc_index][int(np.argmax(overlaps))]


@lru_cache(maxsize=1)
def search_index() -> SearchIndex:
    """The process-wide index over the shipped corpus, built on first use."""
    return SearchIndex(load_documents())


# ----------------------------------------------------------------------------------------- text helpers
def parse_action(action: object) -> tuple[str, str] | None:
    """``("search"|"answer", argument)`` of an action string; None when it is not a well-formed action."""
    match = _ACTION.match(action) if isinstance(action, str) else None
    if match is None or not match.group(2).strip():
        return None
    return match.group(1).lower(), match.group(2).strip()


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 of the normalised answers (1.0 if both are empty, 0.0 if only one is)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - 3, 0)].rstrip() + "..."


def _tool_call(name: str, **arguments: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# ----------------------------------------------------------------------------------------- env
@register_env("search_qa")
class SearchQA:
    """Answer a (multi-hop) question about a fictional world, searching a BM25 index (see the module docstring).

    ``top_k`` results per search, each cut to ``snippet_chars`` (4x that with ``verbosity="full"``, which also
    names the gold answer after a wrong one); ``reward`` is ``"em"`` or ``"f1"``; ``max_steps`` counts searches,
    answers and invalid actions alike.
    """

    split_aware = True
    tools: tuple[dict, ...] = (SEARCH_TOOL, ANSWER_TOOL)

    def __init__(self, top_k: int = 3, snippet_chars: int = 120, max_steps: int = 6, reward: str = "em",
                 tools_enabled: bool = True, verbosity: str = "short", invalid_penalty: float = 0.0) -> None:
        if top_k < 1 or snippet_chars < 20 or max_steps < 1:
            raise ValueError(f"search_qa: need top_k >= 1, snippet_chars >= 20 and max_steps >= 1; got top_k="
                             f"{top_k}, snippet_chars={snippet_chars}, max_steps={max_steps}")
        if reward not in REWARDS or verbosity not in VERBOSITIES:
            raise ValueError(f"search_qa: reward must be one of {list(REWARDS)} (got {reward!r}) and verbosity one "
                             f"of {list(VERBOSITIES)} (got {verbosity!r})")
        self.top_k, self.snippet_chars, self.max_steps = int(top_k), int(snippet_chars), int(max_steps)
        self.reward, self.verbosity, self.invalid_penalty = reward, verbosity, float(invalid_penalty)
        self.default_tools_enabled = self.tools_enabled = bool(tools_enabled)
        self._set_tools()
        self._question: dict | None = None
        self._retrieved: set[str] = set()
        self._queries: list[str] = []
        self._shown: set[str] = set()  # result lines shown so far (the expert's evidence)
        self._steps = 0
        self._done = True
        self._answered = False
        self._em: float | None = None
        self._f1: float | None = None

    # ----------------------------------------------------------------------------------------- contract
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """Start on a question: ``random.Random(seed)`` picks it from the ``split`` (default ``"train"``) questions
        with ``hops`` (1, 2 or None = any) hops; ``question_id`` picks one directly (it must belong to ``split``
        when that is given). ``tools_enabled`` overrides the constructor's for this episode."""
        options = check_reset_options("search_qa", options, RESET_OPTIONS)
        self.tools_enabled = bool(options.get("tools_enabled", self.default_tools_enabled))
        self._set_tools()
        self._question = self._pick_question(seed, options)
        self._retrieved, self._queries, self._shown = set(), [], set()
        self._steps, self._done, self._answered = 0, False, False
        self._em = self._f1 = None
        return f"Question: {self._question['question']}", self._info(action_valid=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._question is None:
            raise RuntimeError("search_qa: step() before reset(); call reset(seed=...) first")
        if self._done:
            raise RuntimeError("search_qa: the episode is over; call reset() before stepping again")
        self._steps += 1
        parsed = parse_action(action)
        reward, terminated, tool_call, tool_success = 0.0, False, None, None
        if parsed is None or (parsed[0] == "search" and not self.tools_enabled):
            obs = "Invalid action. Use " + ("search[query] or answer[text]." if self.tools_enabled
                                            else "answer[text] (search is disabled).")
            reward = 0.0 - self.invalid_penalty
        elif parsed[0] == "search":
            obs, tool_success = self._search(parsed[1])
            tool_call = _tool_call("search", query=parsed[1])
        else:
            gold = self._question["answer"]
            self._em, self._f1 = exact_match(parsed[1], gold), token_f1(parsed[1], gold)
            reward = self._em if self.reward == "em" else self._f1
            self._answered, terminated = True, True
            obs = "Correct." if self._em == 1.0 else "Incorrect."
            if self.verbosity == "full":
                obs += f" The answer is {gold}."
            tool_call, tool_success = _tool_call("answer", answer=parsed[1]), True
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        info = self._info(action_valid=tool_call is not None)
        info["tool_call"], info["tool_success"] = tool_call, tool_success
        return obs, float(reward), terminated, truncated, info

    def task_description(self) -> str:
        question = self._question["question"] if self._question else "(call reset() first)"
        grammar = (f"search[query] shows the top {self.top_k} documents; answer[text] ends the episode."
                   if self.tools_enabled else "answer[text] ends the episode (no search).")
        return f"Question: {question}\nActions: {grammar}"

    def expert_action(self) -> str | None:
        """Search each gold document with its known-good query, then answer; answer at once on the last step.

        A search is skipped when the line it would show for its gold document has already been shown (an earlier
        search surfaced the same evidence), so every answer rests on evidence in the observations.
        """
        if self._question is None or self._done:
            return None
        answer = f"answer[{self._question['answer']}]"
        if not self.tools_enabled or self._steps >= self.max_steps - 1:
            return answer
        for doc_id, query in zip(self._question["support"], self._question["queries"]):
            if self._snippet(search_index().position[doc_id], query) not in self._shown and query not in self._queries:
                return f"search[{query}]"
        return answer

    def scenario_key(self) -> str:
        """Question, gold answer and tools on/off (module docstring), read right after ``reset``."""
        if self._question is None:
            raise RuntimeError("search_qa: scenario_key() before reset(); call reset(seed=...) first")
        return f"{self._question['question']}|{self._question['answer']}|tools {self.tools_enabled}"

    # ----------------------------------------------------------------------------------------- helpers
    def _set_tools(self) -> None:
        self.tools = (SEARCH_TOOL, ANSWER_TOOL) if self.tools_enabled else (ANSWER_TOOL,)

    def _pick_question(self, seed: int | None, options: dict) -> dict:
        split, hops, question_id = options.get("split", "train"), options.get("hops"), options.get("question_id")
        if split not in SPLITS:
            raise ValueError(f"search_qa: unknown split {split!r}; valid splits: {list(SPLITS)}")
        if hops not in (None, 1, 2):
            raise ValueError(f"search_qa: hops must be 1, 2 or None (any), got {hops!r}")
        questions = load_questions()
        if question_id is not None:
            found = [q for q in questions if q["id"] == question_id]
            if not found:
                raise ValueError(f"search_qa: unknown question_id {question_id!r}; valid ids are "
                                 f"{questions[0]['id']}..{questions[-1]['id']}")
            question = found[0]
            if "split" in options and question["split"] != split:
                raise ValueError(f"search_qa: question {question_id} is in split {question['split']!r}, not "
                                 f"{split!r}: drop the split option or pick a question of that split")
            if hops is not None and question["hops"] != hops:
                raise ValueError(f"search_qa: question {question_id} has {question['hops']} hops, not {hops}")
            return question
        pool = [q for q in questions if q["split"] == split and (hops is None or q["hops"] == hops)]
        return pool[random.Random(seed).randrange(len(pool))]

    def _search(self, query: str) -> tuple[str, bool]:
        index = search_index()
        hits = index.search(query, self.top_k)
        self._queries.append(query)
        self._retrieved.update(index.docs[i]["id"] for i in hits)
        if not hits:
            return "No results.", False
        lines = [self._snippet(i, query) for i in hits]
        self._shown.update(lines)
        return "\n".join(lines), True

    def _snippet(self, doc_index: int, query: str) -> str:
        """The result line of a document for a query: best sentence (short) or whole document (full)."""
        doc = search_index().docs[doc_index]
        if self.verbosity == "full":
            return _clip(f"{doc['title']}: {doc['text']}", 4 * self.snippet_chars)
        sentence = search_index().best_sentence(doc_index, query)
        return _clip(sentence if doc["title"] in sentence else f"{doc['title']}: {sentence}", self.snippet_chars)

    def _info(self, *, action_valid: bool) -> dict:
        q = self._question
        retrieved = sorted(self._retrieved)
        return {
            "anchor": f"{q['id']}|{','.join(retrieved)}|{'answered' if self._answered else 'open'}",
            "action_valid": action_valid,
            "won": self._em == 1.0,
            "tool_call": None,
            "tool_success": None,
            "question_id": q["id"],
            "hops": q["hops"],
            "kind": q["kind"],
            "retrieved": retrieved,
            "steps": self._steps,
            "em": self._em,
            "f1": self._f1,
        }
