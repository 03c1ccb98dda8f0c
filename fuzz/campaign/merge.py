"""`llmfuzz merge SUMMARY.json...`: the summaries of a campaign's shards (`run --shard K/N
--json`, fuzz.campaign.shard) as one summary and report.

Reference-engine shards carry their Summary in full (`shard_report`): it is merged as the
workers of `run --jobs` are (fuzz.campaign.jobs_worker.merge_reports: per-cell counts and the
target's measurements add up, so the reach over the config limits is the campaign's), then
the findings are de-duplicated by failure (`one_per_bug`). vLLM shards are merged from their
JSON (fuzz.campaign.merge_vllm). Shards must be of one campaign: one N, one seed, no shard
twice; the missing ones are named in the merged summary and on stderr.
"""
from __future__ import annotations

import json

from fuzz.errors import BadInput


def load(paths: list[str]) -> list[dict]:
    """The shards' summaries, each checked to be one (a one-line BadInput naming the file)."""
    docs = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as e:
            raise BadInput(f"merge: {path}: cannot read ({e.strerror})") from None
        except ValueError as e:
            raise BadInput(f"merge: {path}: not valid JSON ({e})") from None
        if not isinstance(doc, dict) or "shard" not in doc:
            raise BadInput(f"merge: {path}: not the summary of a shard (`llmfuzz run --shard K/N --json` writes one)")
        if doc.get("target") != "vllm" and "shard_report" not in doc:
            raise BadInput(f"merge: {path}: shard {doc['shard']} has no shard_report (written by an older llmfuzz?)")
        docs.append({**doc, "_path": path})
    return docs


def check_shards(docs: list[dict]) -> tuple[int, list[str]]:
    """(N, the shards of N not given): one campaign's shards, each once, else a BadInput."""
    from fuzz.campaign.shard import parse_shard

    shards = [parse_shard(d["shard"]) for d in docs]
    counts = {s.count for s in shards}
    if len(counts) > 1:
        raise BadInput(f"merge: shards of campaigns split differently ({', '.join(sorted(map(str, shards)))})")
    if len({d.get("target", "reference") for d in docs}) > 1:
        raise BadInput("merge: summaries of different targets (reference and vllm)")
    seeds = {d.get("seed", (d.get("shard_report") or {}).get("seed")) for d in docs}
    if len(seeds) > 1:
        raise BadInput(f"merge: shards of campaigns with different seeds ({', '.join(map(str, sorted(seeds)))})")
    seen: dict[int, str] = {}
    for s, d in zip(shards, docs):
        if s.index in seen:
            raise BadInput(f"merge: shard {s} given twice ({seen[s.index]}, {d['_path']})")
        seen[s.index] = d["_path"]
    n = counts.pop()
    return n, [f"{k}/{n}" for k in range(1, n + 1) if k not in seen]


def _size_key(f) -> tuple:
    """Smaller first: fewer requests, fewer prompt tokens, then found sooner."""
    size = (f.size if hasattr(f, "size") else f.get("size")) or {}
    found = f.seconds_to_find if hasattr(f, "seconds_to_find") else None
    return (size.get("requests") or 1 << 30, size.get("tokens") or 1 << 30, found or 0.0)


def one_per_bug(failures: list, key) -> list:
    """One failure per bug (`key`: what makes two the same one), the smallest, in the order
    each bug was first met; the others' reproducers are listed on it (`others`)."""
    groups: dict = {}
    for f in failures:
        groups.setdefault(key(f), []).append(f)
    out = []
    for group in groups.values():
        best = min(group, key=_size_key)
        others = [p for g in group if g is not best for p in [_path(g), *_others(g)] if p]
        _set_others(best, _others(best) + others)
        out.append(best)
    return out


def _path(f):
    return f.path if hasattr(f, "path") else f.get("path")


def _others(f) -> list:
    return list(f.others if hasattr(f, "others") else f.get("others") or [])


def _set_others(f, others: list) -> None:
    if hasattr(f, "others"):
        f.others = others
    elif others:
        f["others"] = others


def merge_reference(docs: list[dict], missing: list[str]):
    """The Summary of reference-engine shards and their shrink phases' report."""
    from fuzz.campaign.jobs_worker import merge_reports

    docs = sorted(docs, key=lambda d: int(d["shard"].split("/")[0]))
    reports = [(d["shard"], d["shard_report"], d["shard_report"]["report"]) for d in docs]
    first = docs[0]["shard_report"]
    s, shrink = merge_reports(reports, budget_s=first.get("budget_s") or 0.0, seed=first.get("seed") or 0)
    # Same failure (fuzz.verdict.properties.same_failure): property, oracle, crash signature.
    s.failures = one_per_bug(s.failures, lambda f: (f.property, f.oracle, f.meta.get("signature")))
    s.seconds = max((r["seconds"] for _, _, r in reports), default=0.0)
    s.shards = [{"shard": w["worker"], **{k: w[k] for k in ("layouts", "stream", "examples", "seconds")}}
                for w in s.workers] + [{"shard": m, "status": "missing"} for m in missing]
    s.workers, s.jobs = [], 1
    return s, shrink
