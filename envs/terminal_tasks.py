"""Task templates of the terminal env: per seed, a small file tree, a one-line instruction, a verifier and a solution.

Ten templates (``TEMPLATES``): create_file, count_matches, rename_ext, find_word, sort_lines, replace_word,
move_by_ext, first_lines, delete_tmp, count_unique. Every split uses every template; the held-out split draws its
parameters from held-out ranges (``POOLS``): disjoint word/name/folder pools and larger item counts (6-9 instead of
3-5), so held-out tasks have file names, contents and sizes never seen in training.

A verifier reads the final sandbox (``read_text``/``list_files``, which never follow links outside it) and returns
whether the task is done. A solution is a short command list whose commands are safe to re-run from the first one
(``echo w > f``, ``mkdir -p``, ``sed s/a/b/g`` with ``a`` absent from the result, ...), which the env's expert relies
on after the agent deviates.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from envs.terminal_fs import list_files, read_text


@dataclass(frozen=True)
class Task:
    """One generated task: ``files`` maps relative paths to text (a path ending in / is an empty directory)."""

    template: str
    text: str
    files: dict[str, str]
    solution: tuple[str, ...]
    check: Callable[[str], bool]  # sandbox root -> task done


@dataclass(frozen=True)
class Pool:
    """Parameter ranges of one split."""

    words: tuple[str, ...]
    names: tuple[str, ...]
    dirs: tuple[str, ...]
    needles: tuple[str, ...]
    count: tuple[int, int]  # inclusive range of items per task (files, lines, ...)


POOLS: dict[str, Pool] = {
    "train": Pool(
        words=("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "ocean", "candle", "forest",
               "silver", "garden", "rocket", "pepper", "violet", "harbor", "falcon", "meadow", "copper"),
        names=("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"),
        dirs=("logs", "data", "docs", "notes"), needles=("needle", "treasure", "secret"), count=(3, 5)),
    "heldout": Pool(
        words=("amber", "bison", "cedar", "delta", "ember", "fjord", "glacier", "hazel", "indigo", "jasper", "kelp",
               "lagoon", "mango", "nectar", "onyx", "prairie", "quartz", "raven", "saffron", "tundra"),
        names=("mallory", "niaj", "olivia", "peggy", "rupert", "sybil", "trent", "uma", "victor", "wendy"),
        dirs=("archive", "records", "files", "store"), needles=("beacon", "compass", "lantern"), count=(6, 9)),
}
LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")


def _count(rng: random.Random, pool: Pool) -> int:
    return rng.randint(*pool.count)


def _lines(rng: random.Random, pool: Pool, n: int, width: int = 2) -> str:
    return "".join(" ".join(rng.choice(pool.words) for _ in range(width)) + "\n" for _ in range(n))


def _same_files(root: str, expected: dict[str, str], under: str) -> bool:
    """The regular files under ``under`` are exactly ``expected`` (path -> text)."""
    return (list_files(root, under) == sorted(expected)
            and all(read_text(root, rel) == text for rel, text in expected.items()))


def create_file(rng: random.Random, pool: Pool) -> Task:
    name, word = f"{rng.choice(pool.words)}.txt", rng.choice(pool.words)
    other = f"{rng.choice(pool.names)}.md"
    return Task("create_file", f"Create the file {name} containing the line {word}.",
                {other: _lines(rng, pool, 2)}, (f"echo {word} > {name}",),
                lambda root: read_text(root, name) in (word, word + "\n"))


def count_matches(rng: random.Random, pool: Pool) -> Task:
    log, level = f"{rng.choice(pool.names)}.log", rng.choice(LEVELS)
    levels = [rng.choice(LEVELS) for _ in range(3 * _count(rng, pool))]
    levels[rng.randrange(len(levels))] = level
    text = "".join(f"{lv} {rng.choice(pool.words)} {rng.choice(pool.words)}\n" for lv in levels)
    want = str(levels.count(level))
    return Task("count_matches", f"Count the lines of {log} that contain {level} and write the number to count.txt.",
                {log: text}, (f"grep -c {level} {log} > count.txt",),
                lambda root: (read_text(root, "count.txt") or "").strip() == want)


def rename_ext(rng: random.Random, pool: Pool) -> Task:
    folder = rng.choice(pool.dirs)
    stems = rng.sample(pool.words, _count(rng, pool))
    files = {f"{folder}/{s}.log": _lines(rng, pool, 2) for s in stems}
    keep = {f"{folder}/readme.md": "keep me\n"}
    want = {f"{folder}/{s}.txt": files[f"{folder}/{s}.log"] for s in stems} | keep
    return Task("rename_ext", f"Rename every .log file in {folder}/ to end in .txt instead (a.log -> a.txt).",
                files | keep, tuple(f"mv {folder}/{s}.log {folder}/{s}.txt" for s in stems),
                lambda root: _same_files(root, want, folder))


def find_word(rng: random.Random, pool: Pool) -> Task:
    folder, needle = rng.choice(pool.dirs), rng.choice(pool.needles)
    subdirs = rng.sample(pool.names, 2)
    paths = [f"{folder}/{rng.choice(subdirs)}/{w}.txt" for w in rng.sample(pool.words, _count(rng, pool))]
    files = {p: _lines(rng, pool, 3) for p in paths}
    target = rng.choice(paths)
    lines = files[target].splitlines(keepends=True)
    lines.insert(rng.randrange(len(lines) + 1), f"{rng.choice(pool.words)} {needle}\n")
    files[target] = "".join(lines)
    return Task("find_word", f"Exactly one file under {folder}/ contains the word {needle}. Copy it to found.txt.",
                files, (f"cp {target} found.txt",),
                lambda root: read_text(root, "found.txt") == files[target])


def sort_lines(rng: random.Random, pool: Pool) -> Task:
    name = f"{rng.choice(pool.words)}.txt"
    people = rng.sample(pool.names, _count(rng, pool))
    want = "".join(p + "\n" for p in sorted(people))
    return Task("sort_lines", f"Sort the lines of {name} alphabetically and write them to sorted.txt.",
                {name: "".join(p + "\n" for p in people)}, (f"sort {name} > sorted.txt",),
                lambda root: read_text(root, "sorted.txt") == want)


def replace_word(rng: random.Random, pool: Pool) -> Task:
    name = f"{rng.choice(pool.dirs)}.ini"
    while True:
        keys = rng.sample(pool.names, _count(rng, pool))
        text = "".join(f"{k} = {rng.choice(pool.words)}\n" for k in keys)
        old, new = rng.sample(sorted({line.split(" = ")[1].strip() for line in text.splitlines()}), 1)[0], \
            rng.choice(pool.words)
        want = text.replace(old, new)
        if old != new and old not in want:  # so s/old/new/g is safe to re-run
            break
    return Task("replace_word", f"Replace every {old} with {new} in {name}.", {name: text},
                (f"sed -i s/{old}/{new}/g {name}",), lambda root: read_text(root, name) == want)


def move_by_ext(rng: random.Random, pool: Pool) -> Task:
    folder = rng.choice(pool.dirs)
    stems = rng.sample(pool.words, _count(rng, pool) + 2)
    csvs = {f"{s}.csv": f"id,{s}\n1,{rng.choice(pool.words)}\n" for s in stems[2:]}
    others = {f"{s}.txt": _lines(rng, pool, 1) for s in stems[:2]}
    want = {f"{folder}/{rel}": text for rel, text in csvs.items()} | others
    return Task("move_by_ext", f"Create the folder {folder} and move every .csv file from the top folder into it.",
                csvs | others, (f"mkdir -p {folder}", f"mv *.csv {folder}/"),
                lambda root: all(read_text(root, rel) == text for rel, text in want.items())
                and not any(f.endswith(".csv") and "/" not in f for f in list_files(root)))


def first_lines(rng: random.Random, pool: Pool) -> Task:
    name = f"{rng.choice(pool.names)}.txt"
    lines = _lines(rng, pool, 2 * _count(rng, pool)).splitlines(keepends=True)
    k = rng.randint(2, len(lines) - 1)
    return Task("first_lines", f"Write the first {k} lines of {name} to top.txt.", {name: "".join(lines)},
                (f"head -n {k} {name} > top.txt",), lambda root: read_text(root, "top.txt") == "".join(lines[:k]))


def delete_tmp(rng: random.Random, pool: Pool) -> Task:
    folder = rng.choice(pool.dirs)
    subdirs = ["", *(f"{n}/" for n in rng.sample(pool.names, 2))]
    stems = rng.sample(pool.words, 2 * _count(rng, pool))
    half = len(stems) // 2
    tmps = {f"{folder}/{rng.choice(subdirs)}{s}.tmp": "scratch\n" for s in stems[:half]}
    keep = {f"{folder}/{rng.choice(subdirs)}{s}.txt": _lines(rng, pool, 1) for s in stems[half:]}
    return Task("delete_tmp", f"Delete every .tmp file anywhere under {folder}/ and keep all other files.",
                tmps | keep, (f"find {folder} -name '*.tmp' -delete",), lambda root: _same_files(root, keep, folder))


def count_unique(rng: random.Random, pool: Pool) -> Task:
    name = f"{rng.choice(pool.words)}.txt"
    choices = rng.sample(pool.names, _count(rng, pool))
    lines = choices + [rng.choice(choices) for _ in range(len(choices))]
    rng.shuffle(lines)
    want = str(len(set(lines)))
    return Task("count_unique", f"Write the number of distinct lines in {name} to unique.txt.",
                {name: "".join(x + "\n" for x in lines)}, (f"sort {name} | uniq | wc -l > unique.txt",),
                lambda root: (read_text(root, "unique.txt") or "").strip() == want)


TEMPLATES: dict[str, Callable[[random.Random, Pool], Task]] = {
    fn.__name__: fn for fn in (create_file, count_matches, rename_ext, find_word, sort_lines, replace_word,
                               move_by_ext, first_lines, delete_tmp, count_unique)
}


def make_task(seed: int | None, split: str, template: str | None = None) -> Task:
    """The task of ``seed`` in ``split`` (its template drawn from the seed unless ``template`` is given)."""
    rng = random.Random(seed)
    name = rng.choice(sorted(TEMPLATES))
    return TEMPLATES[template or name](rng, POOLS[split])
