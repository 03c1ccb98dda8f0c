"""`llmfuzz merge` of a vLLM campaign's shards (`run --target vllm --shard K/N --json`): one
summary in the form of one machine's (fuzz.targets.vllm.summary.summary_json).

Each shard visited its own configs of one plan, so per-config rows are put together (a
config two shards visited adds up), engine starts, examples and time add up, the pairs
exercised are counted again over every shard's configs that ran a passing example, the
known-crash lines of every shard are kept (one per reproducer), and failures are one per
signature: the smallest reproducer, the others listed (`others`).
"""
from __future__ import annotations

from types import SimpleNamespace

from fuzz.campaign.merge import one_per_bug
from fuzz.targets.vllm.summary import _pairs_exercised, reach


def _add_cell(into: dict, row: dict) -> dict:
    if not into:
        return dict(row)
    out = dict(into)
    for k, v in row.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "examples_per_s":
            out[k] = (into.get(k) or 0) + v
        elif isinstance(v, list):
            out[k] = list(into.get(k) or []) + v
        elif v and not into.get(k):
            out[k] = v
    out["examples_per_s"] = round(out["examples"] / out["seconds"], 3) if out.get("seconds") else None
    return out


def merge_vllm(docs: list[dict], missing: list[str]) -> dict:
    """The merged summary of vLLM shards' summaries (in any order)."""
    docs = sorted(docs, key=lambda d: int(d["shard"].split("/")[0]))
    first = docs[0]
    per_cell: dict[str, dict] = {}
    for d in docs:
        for name, row in d["per_cell"].items():
            per_cell[name] = _add_cell(per_cell.get(name, {}), row)
    failures = one_per_bug([f for d in docs for f in d["failures"]], lambda f: (f["property"], f.get("signature")))
    crashes: dict[str, dict] = {}
    for d in docs:
        for k in d.get("known_crashes") or []:
            crashes.setdefault(k.get("reproducer"), k)
    planned = [n for d in docs for n in d.get("planned_configs", [])]
    ran = {n for n, c in per_cell.items() if c.get("examples") or c.get("engine_starts")}
    seconds = max(d.get("seconds") or 0.0 for d in docs)
    startup = sum(d.get("startup_s_total") or 0.0 for d in docs)
    cells = {n: SimpleNamespace(examples=c["examples"], failures=len(c.get("failures") or []),
                                known=c.get("known") or []) for n, c in per_cell.items()}
    return {
        "target": "vllm", "vllm_version": first.get("vllm_version"),
        "vllm_versions": sorted({str(d.get("vllm_version")) for d in docs}),
        "budget_s": first.get("budget_s"), "seed": first.get("seed"), "seconds": seconds,
        "oracles": sorted({o for d in docs for o in d.get("oracles") or []}), "planned_configs": planned,
        "examples": sum(d.get("examples", 0) for d in docs), "failures": failures,
        "known": [k for d in docs for k in d.get("known") or []],
        "unsupported": {k: v for d in docs for k, v in (d.get("unsupported") or {}).items()},
        "per_cell": per_cell, "interrupted": any(d.get("interrupted") for d in docs),
        "write_errors": sum(d.get("write_errors", 0) for d in docs), "plan": first.get("plan"),
        "engine_starts": [s for d in docs for s in d.get("engine_starts") or []],
        "startup_s_total": round(startup, 1),
        "startup_fraction": round(startup / (seconds * len(docs)), 3) if seconds else None,
        "configs_visited": sum(d.get("configs_visited", 0) for d in docs),
        "duplicate_signatures": [x for d in docs for x in d.get("duplicate_signatures") or []],
        "known_signatures": sorted({k for d in docs for k in d.get("known_signatures") or []}),
        "unchecked_for_time": sum(d.get("unchecked_for_time", 0) for d in docs),
        "pairs_exercised": _pairs_exercised(cells, first.get("plan")),
        "pairs_excluded": (first.get("plan") or {}).get("pairs_excluded", {}),
        "known_crashes": list(crashes.values()), "configs_not_reached": [n for n in planned if n not in ran],
        "shards": [{"shard": d["shard"], "configs": d.get("planned_configs", []), "examples": d.get("examples", 0),
                    "seconds": d.get("seconds")} for d in docs] + [{"shard": m, "status": "missing"} for m in missing],
    }


def vllm_text(doc: dict) -> str:
    """The merged summary as `llmfuzz run --target vllm` prints one machine's."""
    rows = [f"vLLM {doc['vllm_version']}, {len(doc['shards'])} shards, {doc['examples']} examples, "
            f"oracles: {', '.join(doc['oracles'])}",
            f"{'cell':<44}{'examples':>9}{'ex/s':>7}{'starts':>7}{'start s':>8}{'fail':>5}{'known':>6}  note"]
    for name, c in doc["per_cell"].items():
        rate = f"{c['examples_per_s']:.2f}" if c.get("examples_per_s") else "-"
        rows.append(f"{name:<44}{c['examples']:>9}{rate:>7}{c.get('engine_starts', 0):>7}"
                    f"{c.get('startup_s', 0.0):>8.1f}{len(c.get('failures') or []):>5}{len(c.get('known') or []):>6}  "
                    + " · ".join(x for x in (reach(c), c.get("stopped", "")) if x))
    rows += [f"not reached: {n}" for n in doc["configs_not_reached"]]
    pairs = doc.get("pairs_exercised")
    if pairs:
        rows.append(f"pairs exercised: {pairs['covered']} (plan covers {pairs['of_planned']})")
    for k in doc["known_crashes"]:
        rows.append(f"known crash {k['reproducer']}: {k['state']}" + (f" ({k['detail']})" if k.get("detail") else "")
                    + f"  [{k['signature']}]")
    for f in doc["failures"]:
        rows.append(f"\nFAILED {f['property']} on {f['config']}: {str(f['message'])[:300]}\n  case: {f['case']}\n"
                    f"  Reproduce with: llmfuzz replay {f['path']}"
                    + (f"\n  also found as: {', '.join(f['others'])}" if f.get("others") else ""))
    rows += [f"shard {s['shard']} missing" for s in doc["shards"] if s.get("status") == "missing"]
    return "\n".join(rows)
