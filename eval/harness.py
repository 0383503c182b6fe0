"""Retrieval evaluation through the product path (remember, then search_memory).

Three sets: LoCoMo dev (../shared/eval/locomo_dev, protocol in ../shared/eval/README.md),
the project's golden set (eval/golden.jsonl: exact identifiers and short paraphrases, one
user) and the paraphrase set (eval/golden_paraphrase.jsonl: 240 personal facts of 24
made-up users, each stored with the set's 96 distractors that share words but not
meaning, and queried in other words). Prints recall@5, hit@5, recall@10, MRR and search p50/p95; with --gate, fails
when recall@5 on any set falls more than 2 points below eval/baseline.json.

    eval/run [--gate] [--write-baseline] [--sets locomo golden paraphrase]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.common import ROOT, bench_database, percentiles

# The workspace keeps the LoCoMo data beside the checkout; MEMSITE_LOCOMO_DIR points
# elsewhere (a clone in another directory).
LOCOMO_DIR = Path(os.environ.get("MEMSITE_LOCOMO_DIR") or ROOT.parent / "shared" / "eval" / "locomo_dev")
GOLDEN = ROOT / "eval" / "golden.jsonl"
PARAPHRASE = ROOT / "eval" / "golden_paraphrase.jsonl"
BASELINE = ROOT / "eval" / "baseline.json"
GATE_TOLERANCE = 0.02
TOP_K = 10


def _user(username: str, *, keep: bool = False):
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from core.scope import CallContext, MemoryScope
    from memories.services import memory_clear_all

    user, _ = get_user_model().objects.get_or_create(username=username)
    scope = MemoryScope.for_user(user, client_app="eval")
    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}  # the eval is not an abuser
    if not keep:
        memory_clear_all(scope, confirm=True, call=CallContext(channel="internal"))
    return scope


def _stored(scope, conversation_id: str, turns: list, remember) -> dict[str, set[str]]:
    """memory id -> dia ids. With --reuse, a previous run's memories (same turns) are kept:
    handy when tuning search, never used by the CI gate."""
    from django.conf import settings

    from memories.selectors import memory_count

    cache = settings.DATA_DIR / f"locomo-{conversation_id}.json"
    if REUSE and cache.exists():
        saved = json.loads(cache.read_text())
        if saved["turns"] == len(turns) and memory_count(scope) == len(saved["ids"]):
            return {k: set(v) for k, v in saved["ids"].items()}
    dia_ids: dict[str, set[str]] = {}
    for turn, date in turns:
        memory_id = remember(turn, date)
        dia_ids.setdefault(memory_id, set()).add(turn["dia_id"])
    cache.write_text(json.dumps({"turns": len(turns), "ids": {k: sorted(v) for k, v in dia_ids.items()}}))
    return dia_ids


def _remember(scope, text: str, metadata: dict) -> str:
    from core.scope import CallContext
    from memories.services import memory_remember

    return memory_remember(scope, memory=text, metadata=metadata, call=CallContext(channel="internal")).id


def _search(scope, query: str, latencies: list[float]) -> list[str]:
    from core.scope import CallContext
    from memories.services import memory_search

    started = time.perf_counter()
    found = memory_search(scope, query=query, top_k=TOP_K, call=CallContext(channel="internal"))
    latencies.append((time.perf_counter() - started) * 1000)
    return [m.id for m in found]


class Scores:
    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float, float]] = []  # recall@5, hit@5, recall@10, rr
        self.latencies: list[float] = []

    def add(self, ranked_sets: list[set[str]], evidence: set[str]) -> None:
        def covered(k: int) -> set[str]:
            return set().union(*ranked_sets[:k]) & evidence if ranked_sets else set()

        rank = next((i for i, found in enumerate(ranked_sets, 1) if found & evidence), None)
        self.rows.append(
            (
                len(covered(5)) / len(evidence),
                1.0 if covered(5) else 0.0,
                len(covered(10)) / len(evidence),
                1.0 / rank if rank else 0.0,
            )
        )

    def summary(self) -> dict:
        n = len(self.rows)
        mean = [round(sum(r[i] for r in self.rows) / n, 4) for i in range(4)]
        latency = percentiles(self.latencies)
        return {
            "questions": n,
            "recall@5": mean[0],
            "hit@5": mean[1],
            "recall@10": mean[2],
            "mrr": mean[3],
            "search_p50_ms": latency["p50_ms"],
            "search_p95_ms": latency["p95_ms"],
        }


def _turns(conversation: dict):
    for key, turns in conversation.items():
        if key.startswith("session_") and isinstance(turns, list):
            date = conversation.get(f"{key}_date_time", "")
            for turn in turns:
                yield turn, date


def run_locomo() -> dict:
    scores = Scores()
    for path in sorted(LOCOMO_DIR.glob("*.json")):
        conversation = json.loads(path.read_text())
        scope = _user(f"eval-locomo-{path.stem}", keep=REUSE)

        def remember(turn, date, scope=scope):
            text = f"{turn['speaker']}: {turn['text']}"
            if turn.get("blip_caption"):
                text += f" [shares a photo: {turn['blip_caption']}]"
            return _remember(scope, text, {"dia_id": turn["dia_id"], "session_date": date})

        dia_ids = _stored(scope, path.stem, list(_turns(conversation)), remember)
        for qa in conversation["qa"]:
            if qa.get("category") not in (1, 2, 3, 4) or not qa.get("evidence"):
                continue
            ranked = _search(scope, str(qa["question"]), scores.latencies)
            scores.add([dia_ids.get(m, set()) for m in ranked], set(qa["evidence"]))
        print(f"  locomo {path.stem}: {len(scores.rows)} questions so far", file=sys.stderr)
    return scores.summary()


def run_golden() -> dict:
    scores = Scores()
    pairs = [json.loads(line) for line in GOLDEN.read_text().splitlines() if line.strip()]
    scope = _user("eval-golden")
    ids = [_remember(scope, pair["memory"], {"kind": pair["kind"]}) for pair in pairs]
    for memory_id, pair in zip(ids, pairs, strict=True):
        ranked = _search(scope, pair["query"], scores.latencies)
        scores.add([{m} for m in ranked], {memory_id})
    return scores.summary()


def run_paraphrase() -> dict:
    """One user per made-up person: their facts plus every distractor of the set (rows
    without a query: statements that share words with some query but answer none), so
    each search picks one fact among ~110 memories. Every fact is searched with its
    paraphrase."""
    scores = Scores()
    rows = [json.loads(line) for line in PARAPHRASE.read_text().splitlines() if line.strip()]
    distractors = [row for row in rows if not row.get("query")]
    by_user: dict[str, list[dict]] = {}
    for row in rows:
        if row.get("query"):
            by_user.setdefault(row["user"], []).append(row)
    for user, facts in by_user.items():
        scope = _user(f"eval-paraphrase-{user}")
        ids = [_remember(scope, row["memory"], {"kind": row["kind"]}) for row in facts]
        for row in distractors:
            _remember(scope, row["memory"], {"kind": row["kind"]})
        for memory_id, row in zip(ids, facts, strict=True):
            ranked = _search(scope, row["query"], scores.latencies)
            scores.add([{m} for m in ranked], {memory_id})
    print(f"  paraphrase: {len(scores.rows)} questions, {len(by_user)} users", file=sys.stderr)
    return scores.summary()


SETS = {"locomo": run_locomo, "golden": run_golden, "paraphrase": run_paraphrase}
REUSE = False


def gate(results: dict, baseline: dict) -> list[str]:
    failures = []
    for name, figures in results.items():
        floor = baseline.get(name, {}).get("recall@5")
        if floor is not None and figures["recall@5"] < floor - GATE_TOLERANCE:
            failures.append(f"{name} recall@5 {figures['recall@5']:.4f} < baseline {floor:.4f} - {GATE_TOLERANCE}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", choices=sorted(SETS), default=sorted(SETS))
    parser.add_argument("--gate", action="store_true", help="fail if recall@5 drops below the baseline")
    parser.add_argument("--write-baseline", action="store_true")
    parser.add_argument("--reuse", action="store_true", help="keep LoCoMo memories from the last run (tuning)")
    args = parser.parse_args()
    global REUSE
    REUSE = args.reuse and not args.gate
    if "locomo" in args.sets and not LOCOMO_DIR.is_dir():
        print(f"LoCoMo data not found at {LOCOMO_DIR} (set MEMSITE_LOCOMO_DIR)", file=sys.stderr)
        return 2

    os.environ.setdefault("MEMSITE_DATA_DIR", str(ROOT / "var" / "eval"))
    with bench_database():
        results = {name: SETS[name]() for name in args.sets}
    print(json.dumps(results, indent=2))
    if args.write_baseline:
        BASELINE.write_text(json.dumps({k: {"recall@5": v["recall@5"]} for k, v in results.items()}, indent=2) + "\n")
        print(f"wrote {BASELINE.relative_to(ROOT)}")
    if args.gate:
        failures = gate(results, json.loads(BASELINE.read_text()))
        for failure in failures:
            print(f"EVAL GATE FAILED: {failure}", file=sys.stderr)
        if failures:
            return 1
        print("eval gate passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
