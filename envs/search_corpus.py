"""Deterministic generator of the search_qa world: fictional entities, their documents, and questions about them.

The world (fixed seed ``WORLD_SEED``): countries, rivers, cities, universities, people, companies and books with
functional facts (a person has one birthplace, a company one founder, ...). Each entity gets one short
encyclopedia-style document (``{"id", "title", "text"}``); every fact is stated only in its subject's document, in
a sentence that repeats the subject's full name, so a bridge question really needs two documents.

Questions (``{"id", "question", "answer", "kind", "hops", "support", "queries", "entities", "split"}``):
``single`` (1 hop, "Where was Alma Verin born?"), ``bridge`` (2 hops, "In which city was the founder of Quarlex
born?") and ``comparison`` (2 hops, "Who was born first, A or B?"). ``support`` lists the gold documents in chain
order and ``queries`` a search query per supporting document that BM25 ranks it for (the expert's queries).
``entities`` are the question's topic entities (the ones it names); ``split`` is theirs: an entity is held out when
its sha1 falls in the last ``HELDOUT_FRACTION`` of the hash space, and comparisons pair entities of one split.

Regenerate the shipped files (a test checks they equal a fresh generation)::

    python -m envs.search_corpus --out envs/data/search_qa_corpus.jsonl
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
from pathlib import Path

WORLD_SEED = 20240607
HELDOUT_FRACTION = 0.2
COUNTS = {"country": 8, "river": 16, "city": 48, "university": 16, "person": 200, "company": 80, "book": 80}
QUESTION_CAPS = {"single": 600, "bridge": 600, "comparison": 150}

FIRST_NAMES = ("Alma", "Tobin", "Ilsa", "Maren", "Oskar", "Petra", "Edda", "Lucan", "Nessa", "Corin", "Talia",
               "Bram", "Sela", "Orrin", "Vida", "Jorun", "Kasia", "Dorian", "Runa", "Felix", "Mira", "Anselm",
               "Liv", "Teodor", "Ysolde", "Hale", "Greta", "Emrys", "Ines", "Caspar")
OCCUPATIONS = ("painter", "chemist", "architect", "sculptor", "engineer", "historian", "composer", "botanist",
               "surgeon", "poet", "cartographer", "astronomer", "linguist", "economist", "photographer", "novelist")
INDUSTRIES = ("shipping", "textile", "software", "mining", "brewing", "publishing", "aviation", "insurance",
              "glassware", "robotics", "pharmaceutical", "furniture")
ADJECTIVES = ("Silent", "Amber", "Hollow", "Distant", "Crimson", "Quiet", "Broken", "Golden", "Winter", "Hidden",
              "Paper", "Salt", "Iron", "Velvet", "Copper", "Pale", "Burning", "Last", "Glass", "Restless")
NOUNS = ("Orchard", "Harbor", "Lantern", "Meadow", "Compass", "Garden", "Tower", "Mirror", "Season", "Bridge",
         "Archive", "Island", "Letter", "Forest", "Clockmaker", "Shore", "Engine", "Voyage", "Kingdom", "Window")
UNIVERSITY_KINDS = ("University", "College", "Institute", "Academy")
_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "qu", "r", "s", "st", "t",
           "tr", "v", "z", "th", "sh", "kl")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou", "ae")
_CODAS = ("", "", "n", "r", "l", "s", "th", "x", "m", "nd", "rk", "sk")
_SUFFIXES = {"country": ("ia", "and", "ora", "esh"), "river": ("a", "en", "ine", "os"),
             "city": ("", "holm", "by", "mere", "ton", "grad"), "university": ("", "ley", "wick"),
             "person": ("", "en", "ov", "ard"), "company": ("ex", "ion", "ar", "co", "ium"),
             "sea": ("ic", "ian")}
_AWKWARD = re.compile(r"quu|[aeiou]{3}|(.)\1\1")  # hard-to-read letter runs
_TEMPLATE_WORDS = ("sea", "river", "city", "country", "capital", "borders", "flows", "km", "long", "lies", "founded",
                   "located", "established", "works", "born", "studied", "company", "headquartered", "novel",
                   "published", "takes", "place", "story")


def entity_split(entity_id: str) -> str:
    """``"heldout"`` for the entities whose sha1 lands in the last HELDOUT_FRACTION of the hash space."""
    bucket = int(hashlib.sha1(entity_id.encode("ascii")).hexdigest()[:8], 16) / 16**8
    return "heldout" if bucket >= 1.0 - HELDOUT_FRACTION else "train"


class _Namer:
    """Invents pronounceable names whose lowercased tokens are unique in the whole corpus (clean BM25 signal)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        reserved = FIRST_NAMES + OCCUPATIONS + INDUSTRIES + ADJECTIVES + NOUNS + UNIVERSITY_KINDS + _TEMPLATE_WORDS
        self.used = {w.lower() for w in reserved}

    def __call__(self, kind: str) -> str:
        while True:
            n_syll = self.rng.choice((2, 2, 2, 3))
            stem = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(n_syll))
            word = (stem + self.rng.choice(_CODAS) + self.rng.choice(_SUFFIXES[kind])).capitalize()
            if 4 <= len(word) <= 10 and word.lower() not in self.used and not _AWKWARD.search(word.lower()):
                self.used.add(word.lower())
                return word


def _build_world(rng: random.Random) -> dict[str, list[dict]]:
    """Entities with their facts: kind -> list of dicts (each with ``id`` and ``name``)."""
    name = _Namer(rng)
    seas = [f"{name('sea')} Sea" for _ in range(4)]
    w: dict[str, list[dict]] = {k: [] for k in COUNTS}
    for i in range(COUNTS["country"]):
        w["country"].append({"id": f"k{i:03d}", "name": name("country"), "sea": rng.choice(seas)})
    for i in range(COUNTS["river"]):  # two rivers per country
        w["river"].append({"id": f"r{i:03d}", "name": name("river"), "country": w["country"][i % COUNTS["country"]],
                           "sea": rng.choice(seas), "km": rng.randrange(80, 2400)})
    for i in range(COUNTS["city"]):  # six cities per country, each on one of its country's rivers
        country = w["country"][i % COUNTS["country"]]
        rivers = [r for r in w["river"] if r["country"] is country]
        w["city"].append({"id": f"c{i:03d}", "name": name("city"), "country": country, "river": rng.choice(rivers),
                          "year": rng.randrange(800, 1700)})
    for country in w["country"]:
        country["capital"] = rng.choice([c for c in w["city"] if c["country"] is country])
    for i in range(COUNTS["university"]):
        w["university"].append({"id": f"u{i:03d}", "name": f"{name('university')} {rng.choice(UNIVERSITY_KINDS)}",
                                "city": rng.choice(w["city"]), "year": rng.randrange(1500, 1950)})
    for i in range(COUNTS["person"]):
        w["person"].append({"id": f"p{i:03d}", "name": f"{rng.choice(FIRST_NAMES)} {name('person')}",
                            "city": rng.choice(w["city"]), "year": rng.randrange(1850, 1990),
                            "job": rng.choice(OCCUPATIONS), "university": rng.choice(w["university"])})
    for i in range(COUNTS["company"]):
        founder = rng.choice(w["person"])
        w["company"].append({"id": f"o{i:03d}", "name": name("company"), "founder": founder,
                             "industry": rng.choice(INDUSTRIES), "city": rng.choice(w["city"]),
                             "year": min(2020, founder["year"] + rng.randrange(20, 60))})
    titles = [f"The {a} {n}" for a in ADJECTIVES for n in NOUNS]
    rng.shuffle(titles)
    for i in range(COUNTS["book"]):
        author = rng.choice(w["person"])
        w["book"].append({"id": f"b{i:03d}", "name": titles[i], "author": author, "city": rng.choice(w["city"]),
                          "year": min(2020, author["year"] + rng.randrange(20, 70))})
    return w


def _a(word: str) -> str:
    """``word`` with its indefinite article ("an engineer", "a painter")."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def _documents(w: dict[str, list[dict]]) -> list[dict]:
    """One document per entity; each fact sentence starts with the subject's full name."""
    texts = {
        "country": lambda e: (f"{e['name']} is a country. The capital of {e['name']} is {e['capital']['name']}. "
                              f"{e['name']} borders the {e['sea']}."),
        "river": lambda e: (f"The {e['name']} is a river in {e['country']['name']}. The {e['name']} is {e['km']} km "
                            f"long. The {e['name']} flows into the {e['sea']}."),
        "city": lambda e: (f"{e['name']} is a city in {e['country']['name']}. {e['name']} lies on the "
                           f"{e['river']['name']}. {e['name']} was founded in {e['year']}."),
        "university": lambda e: (f"{e['name']} is located in {e['city']['name']}. {e['name']} was established in "
                                 f"{e['year']}."),
        "person": lambda e: (f"{e['name']} works as {_a(e['job'])}. {e['name']} was born in {e['city']['name']} in "
                             f"{e['year']}. {e['name']} studied at {e['university']['name']}."),
        "company": lambda e: (f"{e['name']} is {_a(e['industry'])} company. {e['name']} was founded by "
                              f"{e['founder']['name']} in {e['year']}. {e['name']} is headquartered in "
                              f"{e['city']['name']}."),
        "book": lambda e: (f"{e['name']} is a novel by {e['author']['name']}. {e['name']} was published in "
                           f"{e['year']}. The story of {e['name']} takes place in {e['city']['name']}."),
    }
    return [{"id": e["id"], "title": e["name"], "text": texts[kind](e)} for kind in COUNTS for e in w[kind]]


def _q(question: str, answer: object, kind: str, hops: list[tuple[dict, str]], entities: list[dict]) -> dict:
    """A question record; ``hops`` pairs each supporting entity with the expert's query for its document."""
    return {"question": question, "answer": str(answer), "kind": kind, "hops": len(hops),
            "support": [e["id"] for e, _ in hops], "queries": [q for _, q in hops],
            "entities": [e["id"] for e in entities], "split": entity_split(entities[0]["id"])}


def _single_questions(w: dict[str, list[dict]]) -> list[dict]:
    out = []
    for e in w["person"]:
        n = e["name"]
        out += [_q(f"Where was {n} born?", e["city"]["name"], "single", [(e, f"{n} born")], [e]),
                _q(f"In what year was {n} born?", e["year"], "single", [(e, f"{n} born")], [e]),
                _q(f"What is the occupation of {n}?", e["job"], "single", [(e, f"{n} works")], [e]),
                _q(f"Where did {n} study?", e["university"]["name"], "single", [(e, f"{n} studied")], [e])]
    for e in w["company"]:
        n = e["name"]
        out += [_q(f"Who founded {n}?", e["founder"]["name"], "single", [(e, f"{n} founded")], [e]),
                _q(f"In what year was {n} founded?", e["year"], "single", [(e, f"{n} founded")], [e]),
                _q(f"Where is {n} headquartered?", e["city"]["name"], "single", [(e, f"{n} headquartered")], [e])]
    for e in w["book"]:
        n = e["name"]
        out += [_q(f"Who wrote {n}?", e["author"]["name"], "single", [(e, f"{n} novel")], [e]),
                _q(f"In what year was {n} published?", e["year"], "single", [(e, f"{n} published")], [e]),
                _q(f"Where does {n} take place?", e["city"]["name"], "single", [(e, f"{n} takes place")], [e])]
    for e in w["city"]:
        n = e["name"]
        out += [_q(f"In which country is {n}?", e["country"]["name"], "single", [(e, f"{n} city")], [e]),
                _q(f"On which river does {n} lie?", e["river"]["name"], "single", [(e, f"{n} lies")], [e])]
    for e in w["river"]:
        n = e["name"]
        out += [_q(f"Into which sea does the {n} flow?", e["sea"], "single", [(e, f"{n} flows")], [e]),
                _q(f"How many km long is the {n}?", e["km"], "single", [(e, f"{n} km long")], [e])]
    for e in w["country"]:
        out.append(_q(f"What is the capital of {e['name']}?", e["capital"]["name"], "single",
                      [(e, f"{e['name']} capital")], [e]))
    for e in w["university"]:
        out.append(_q(f"In which city is {e['name']}?", e["city"]["name"], "single", [(e, f"{e['name']} located")],
                      [e]))
    return out


def _bridge_questions(w: dict[str, list[dict]]) -> list[dict]:
    out = []
    for e in w["company"]:
        n, f, c = e["name"], e["founder"], e["city"]
        first = (e, f"{n} founded")
        out += [_q(f"In which city was the founder of {n} born?", f["city"]["name"], "bridge",
                   [first, (f, f"{f['name']} born")], [e]),
                _q(f"In what year was the founder of {n} born?", f["year"], "bridge",
                   [first, (f, f"{f['name']} born")], [e]),
                _q(f"Where did the founder of {n} study?", f["university"]["name"], "bridge",
                   [first, (f, f"{f['name']} studied")], [e]),
                _q(f"In which country is {n} headquartered?", c["country"]["name"], "bridge",
                   [(e, f"{n} headquartered"), (c, f"{c['name']} city")], [e])]
    for e in w["book"]:
        n, a, c = e["name"], e["author"], e["city"]
        out += [_q(f"Where was the author of {n} born?", a["city"]["name"], "bridge",
                   [(e, f"{n} novel"), (a, f"{a['name']} born")], [e]),
                _q(f"What is the occupation of the author of {n}?", a["job"], "bridge",
                   [(e, f"{n} novel"), (a, f"{a['name']} works")], [e]),
                _q(f"In which country does {n} take place?", c["country"]["name"], "bridge",
                   [(e, f"{n} takes place"), (c, f"{c['name']} city")], [e])]
    for e in w["person"]:
        n, c, u = e["name"], e["city"], e["university"]
        out += [_q(f"In which country was {n} born?", c["country"]["name"], "bridge",
                   [(e, f"{n} born"), (c, f"{c['name']} city")], [e]),
                _q(f"Which river flows through the birthplace of {n}?", c["river"]["name"], "bridge",
                   [(e, f"{n} born"), (c, f"{c['name']} lies")], [e]),
                _q(f"In which city did {n} study?", u["city"]["name"], "bridge",
                   [(e, f"{n} studied"), (u, f"{u['name']} located")], [e])]
    for e in w["country"]:
        c = e["capital"]
        out.append(_q(f"On which river does the capital of {e['name']} lie?", c["river"]["name"], "bridge",
                      [(e, f"{e['name']} capital"), (c, f"{c['name']} lies")], [e]))
    return out


def _comparison_questions(w: dict[str, list[dict]], rng: random.Random) -> list[dict]:
    """Pairs of same-split entities with distinct values; the question names both."""
    specs = [("person", "Who was born first, {a} or {b}?", "year", min, "{n} born"),
             ("company", "Which company was founded first, {a} or {b}?", "year", min, "{n} founded"),
             ("book", "Which book was published first, {a} or {b}?", "year", min, "{n} published"),
             ("river", "Which river is longer, the {a} or the {b}?", "km", max, "{n} km long")]
    out = []
    for kind, text, key, pick, query in specs:
        for split in ("train", "heldout"):
            pool = [e for e in w[kind] if entity_split(e["id"]) == split]
            for _ in range(len(pool)):
                a, b = rng.sample(pool, 2)
                if a[key] == b[key]:
                    continue
                winner = pick((a, b), key=lambda e: e[key])
                out.append(_q(text.format(a=a["name"], b=b["name"]), winner["name"], "comparison",
                              [(a, query.format(n=a["name"])), (b, query.format(n=b["name"]))], [a, b]))
    return out


def generate(seed: int = WORLD_SEED) -> tuple[list[dict], list[dict]]:
    """(documents, questions) of the world built from ``seed``; the same seed always gives the same lists."""
    rng = random.Random(seed)
    world = _build_world(rng)
    docs = _documents(world)
    text = {d["id"]: d["text"] for d in docs}
    bridges = [q for q in _bridge_questions(world) if q["answer"] not in text[q["support"][0]]]  # no shortcut
    candidates = {"single": _single_questions(world), "bridge": bridges,
                  "comparison": _comparison_questions(world, rng)}
    questions = []
    for kind, cap in QUESTION_CAPS.items():
        unique = list({q["question"]: q for q in candidates[kind]}.values())
        chosen = sorted(rng.sample(range(len(unique)), min(cap, len(unique))))
        questions += [unique[i] for i in chosen]
    return docs, [{"id": f"q{i:04d}", **q} for i, q in enumerate(questions)]


def to_jsonl(records: list[dict]) -> str:
    """One sorted-key JSON object per line (the shipped files' exact bytes)."""
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=True) + "\n" for r in records)


def sentences(text: str) -> list[str]:
    """A document's sentences (the generator never puts a period inside a sentence)."""
    return [s for s in re.split(r"(?<=\.)\s+", text.strip()) if s]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the search_qa corpus and questions as JSONL.")
    parser.add_argument("--out", type=Path, required=True, help="corpus JSONL (id, title, text per line)")
    parser.add_argument("--questions-out", type=Path, default=None,
                        help="questions JSONL (default: search_qa_questions.jsonl next to --out)")
    parser.add_argument("--seed", type=int, default=WORLD_SEED, help="world seed (the shipped files use the default)")
    args = parser.parse_args(argv)
    questions_out = args.questions_out or args.out.with_name("search_qa_questions.jsonl")
    docs, questions = generate(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_jsonl(docs), encoding="ascii")
    questions_out.write_text(to_jsonl(questions), encoding="ascii")
    print(f"wrote {len(docs)} documents to {args.out} and {len(questions)} questions to {questions_out}")


if __name__ == "__main__":
    main()
