"""Offline comparison of fusion methods on the memories an `eval/run` left behind.

For every question of the three sets it fetches, once, the user's 100 nearest memories
(with cosine) and every memory matching a query term (with its length and which terms
it holds), then scores each fusion method in Python, so trying a method costs seconds
instead of a full eval run. Splits: LoCoMo conversations 26+30 against 41-43, and the
paraphrase set's users alternately, to see whether a gain holds on data not looked at.
The product path (`eval/run`) stays the reference; this is for choosing what to try.

    eval/run --reuse            # leaves the sets' memories in var/eval
    .venv/bin/python -m eval.fusion_lab
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable

from bench.common import ROOT, bench_database
from eval.harness import LOCOMO_DIR

K1, B, DEPTH = 1.2, 0.75, 100
TUNE_CONVERSATIONS = ("26", "30")


def _collect() -> dict[str, list[dict]]:
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection

    from core.scope import MemoryScope
    from memories.engine import engine_embed_query
    from memories.engine.retrieval import _tsquery

    table = settings.MEMORY_COLLECTION

    def user_id(name: str) -> str:
        return MemoryScope.for_user(get_user_model().objects.get(username=name)).engine_user_id

    def candidates(owner: str, question: str) -> dict:
        literal = "[" + ",".join(f"{x:.7g}" for x in engine_embed_query(question)) + "]"
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT id, -(vector <#> %s::vector) FROM {table} WHERE payload->>'user_id' = %s AND NOT trashed"  # noqa: S608
                " ORDER BY vector <#> %s::vector LIMIT %s",
                [literal, owner, literal, DEPTH],
            )
            vec = [(str(i), float(s)) for i, s in cursor.fetchall()]
            cursor.execute("SELECT tsvector_to_array(to_tsvector('english', %s))", [question])
            lexemes = (cursor.fetchone()[0] or [])[:32]
            terms, docs = {}, {}
            if lexemes:
                matches = ", ".join("(fts @@ %s::tsquery)::int" for _ in lexemes)
                cursor.execute(
                    f"SELECT id, length(fts), {matches} FROM {table} WHERE payload->>'user_id' = %s AND NOT trashed",  # noqa: S608
                    [*(_tsquery(x) for x in lexemes), owner],
                )
                rows = cursor.fetchall()
                terms = {
                    "n": len(rows),
                    "avgdl": max(sum(r[1] for r in rows) / max(len(rows), 1), 1),
                    "df": [sum(r[2 + i] for r in rows) for i in range(len(lexemes))],
                }
                docs = {str(r[0]): (r[1], [i for i in range(len(lexemes)) if r[2 + i]]) for r in rows if any(r[2:])}
        return {"vec": vec, "docs": docs, "terms": terms}

    def by_text(owner: str) -> dict[str, str]:
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT payload->>'data', id FROM {table} WHERE payload->>'user_id' = %s AND NOT trashed",  # noqa: S608
                [owner],
            )
            return {text: str(i) for text, i in cursor.fetchall()}

    sets: dict[str, list[dict]] = {"locomo": [], "golden": [], "paraphrase": []}
    for path in sorted(LOCOMO_DIR.glob("*.json")):
        conversation = json.loads(path.read_text())
        owner = user_id(f"eval-locomo-{path.stem}")
        dia = json.loads((settings.DATA_DIR / f"locomo-{path.stem}.json").read_text())["ids"]
        for qa in conversation["qa"]:
            if qa.get("category") in (1, 2, 3, 4) and qa.get("evidence"):
                item = candidates(owner, str(qa["question"]))
                item.update(split=path.stem in TUNE_CONVERSATIONS, evidence=set(qa["evidence"]), dia=dia)
                sets["locomo"].append(item)
        print(f"  collected locomo {path.stem}", file=sys.stderr)
    others = (("golden", "golden.jsonl", None), ("paraphrase", "golden_paraphrase.jsonl", "eval-paraphrase-"))
    for name, file, prefix in others:
        rows = [json.loads(line) for line in (ROOT / "eval" / file).read_text().splitlines() if line.strip()]
        users = sorted({row.get("user", "") for row in rows if row.get("query")})
        for n, user in enumerate(users):
            owner = user_id(f"{prefix}{user}" if prefix else "eval-golden")
            texts = by_text(owner)
            for row in rows:
                if row.get("query") and row.get("user", "") == user:
                    item = candidates(owner, row["query"])
                    item.update(split=n % 2 == 0, evidence={texts[row["memory"]]}, dia=None)
                    sets[name].append(item)
        print(f"  collected {name}", file=sys.stderr)
    return sets


# --- fusion methods: item -> ranked memory ids ------------------------------------------
def _idf(item: dict) -> list[float]:
    t = item["terms"]
    return [math.log(1 + (t["n"] - df + 0.5) / (df + 0.5)) for df in t["df"]]


def bm25(item: dict) -> dict[str, float]:
    if not item["terms"]:
        return {}
    idf, avgdl = _idf(item), item["terms"]["avgdl"]
    norm = {d: (K1 + 1) / (1 + K1 * (1 - B + B * dl / avgdl)) for d, (dl, _) in item["docs"].items()}
    return {d: sum(idf[i] for i in matched) * norm[d] for d, (_, matched) in item["docs"].items()}


def coverage(item: dict) -> dict[str, float]:
    if not item["terms"]:
        return {}
    idf = _idf(item)
    return {d: sum(idf[i] for i in matched) / sum(idf) for d, (_, matched) in item["docs"].items()}


def _top(scores: dict[str, float], n: int = DEPTH) -> list[str]:
    return [d for d, _ in sorted(scores.items(), key=lambda p: (-p[1], p[0]))[:n]]


def rrf(item: dict, *, k: int, lexical_weight: float, lexical_scale: float = 1.0) -> list[str]:
    scores: dict[str, float] = {}
    for rank, (d, _) in enumerate(item["vec"], 1):
        scores[d] = scores.get(d, 0.0) + 1.0 / (k + rank)
    for rank, d in enumerate(_top(bm25(item)), 1):
        scores[d] = scores.get(d, 0.0) + lexical_weight * lexical_scale / (k + rank)
    return _top(scores, 10)


def combine(item: dict, lexical: dict[str, float], fn: Callable[[float, float], float]) -> list[str]:
    vec = dict(item["vec"])
    floor = min(vec.values(), default=0.0)  # a memory outside the vector's top 100 is at most this close
    return _top({d: fn(vec.get(d, floor), lexical.get(d, 0.0)) for d in set(vec) | set(lexical)}, 10)


def gated(item: dict, unrelated: float, related: float) -> list[str]:
    """cosine + coverage x the product's `coverage_gate` of the memory's cosine."""
    from memories.engine.retrieval import coverage_gate

    return combine(item, coverage(item), lambda c, v: c + v * coverage_gate(c, unrelated=unrelated, related=related))


def bm25_over_max(item: dict) -> dict[str, float]:
    if not item["terms"]:
        return {}
    most = sum(_idf(item)) * (K1 + 1) / (1 + K1)
    return {d: s / most for d, s in bm25(item).items()}


METHODS: dict[str, Callable[[dict], list[str]]] = {
    "vector only": lambda it: [d for d, _ in it["vec"]][:10],
    "BM25 only": lambda it: _top(bm25(it), 10),
    "RRF k=10, lexical weight 2 (previous default)": lambda it: rrf(it, k=10, lexical_weight=2.0),
    "RRF k=10, lexical weight 2 x top coverage": lambda it: rrf(
        it, k=10, lexical_weight=2.0, lexical_scale=max(coverage(it).values(), default=0.0)
    ),
    "RRF k=60, lexical weight 2 x top coverage": lambda it: rrf(
        it, k=60, lexical_weight=2.0, lexical_scale=max(coverage(it).values(), default=0.0)
    ),
    "cosine x (1 + coverage)": lambda it: combine(it, coverage(it), lambda c, v: c * (1 + v)),
    "cosine x (1 + 2 coverage)": lambda it: combine(it, coverage(it), lambda c, v: c * (1 + 2 * v)),
    "cosine + coverage^2": lambda it: combine(it, coverage(it), lambda c, v: c + v * v),
    "cosine + 0.5 BM25/max": lambda it: combine(it, bm25_over_max(it), lambda c, v: c + 0.5 * v),
    "cosine + BM25/max": lambda it: combine(it, bm25_over_max(it), lambda c, v: c + v),
    "cosine + 0.5 coverage": lambda it: combine(it, coverage(it), lambda c, v: c + 0.5 * v),
    "cosine + 0.75 coverage": lambda it: combine(it, coverage(it), lambda c, v: c + 0.75 * v),
    "cosine + coverage (previous default)": lambda it: combine(it, coverage(it), lambda c, v: c + v),
    "cosine + coverage x gate(cosine 0 -> 0.1)": lambda it: gated(it, 0.0, 0.1),
    "cosine + coverage x gate(cosine 0 -> 0.2)": lambda it: gated(it, 0.0, 0.2),
    "cosine + coverage x gate(cosine 0.05 -> 0.25) (default)": lambda it: gated(it, 0.05, 0.25),
    "cosine + coverage x gate(cosine 0.1 -> 0.3)": lambda it: gated(it, 0.1, 0.3),
    "cosine + coverage x gate(cosine 0.15 -> 0.3)": lambda it: gated(it, 0.15, 0.3),
    "cosine + coverage x gate(cosine 0.1 -> 0.4)": lambda it: gated(it, 0.1, 0.4),
    "cosine + coverage x gate(cosine 0.25 -> 0.45)": lambda it: gated(it, 0.25, 0.45),
}


def _recall(items: list[dict], method: Callable[[dict], list[str]]) -> tuple[float, float, float]:
    if not items:
        return (0.0, 0.0, 0.0)
    r5 = h5 = r10 = 0.0
    for item in items:
        found = [item["dia"].get(d, []) if item["dia"] else [d] for d in method(item)]
        top5 = {x for f in found[:5] for x in f} & item["evidence"]
        top10 = {x for f in found[:10] for x in f} & item["evidence"]
        r5 += len(top5) / len(item["evidence"])
        h5 += bool(top5)
        r10 += len(top10) / len(item["evidence"])
    n = len(items)
    return (round(r5 / n, 3), round(h5 / n, 3), round(r10 / n, 3))


def main() -> int:
    os.environ.setdefault("MEMSITE_DATA_DIR", str(ROOT / "var" / "eval"))
    with bench_database():
        sets = _collect()
    print("| method | LoCoMo dev r@5 / h@5 / r@10 | LoCoMo 26+30 | LoCoMo 41-43 | paraphrase r@5 / h@5 / r@10"
          " | paraphrase A | paraphrase B | golden r@5 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, method in METHODS.items():
        loc, par = sets["locomo"], sets["paraphrase"]
        cells = [
            " / ".join(map(str, _recall(loc, method))),
            _recall([i for i in loc if i["split"]], method)[0],
            _recall([i for i in loc if not i["split"]], method)[0],
            " / ".join(map(str, _recall(par, method))),
            _recall([i for i in par if i["split"]], method)[0],
            _recall([i for i in par if not i["split"]], method)[0],
            _recall(sets["golden"], method)[0],
        ]
        print(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
