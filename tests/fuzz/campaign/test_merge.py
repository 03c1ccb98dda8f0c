"""`llmfuzz merge` (fuzz.campaign.merge, fuzz.campaign.merge_vllm, fuzz.cli.merge): shards'
summaries as one: per-cell counts and reach add up, a failure two shards found is one finding
(the smallest reproducer, the other listed), the HTML report is written; vLLM shards' configs,
pairs exercised and known crashes are put together; shards of different campaigns are refused."""
from __future__ import annotations

import json

import pytest

from fuzz.campaign.findings import run_json
from fuzz.campaign.shard import Shard
from fuzz.campaign.summary import CellStats, Failure, Summary
from fuzz.cli.main import main


def shard_doc(k: int, n: int, layout: str, stream: int, streams: int, failure_requests: int, **cell) -> dict:
    """What `run --shard k/n --json` prints for a shard that ran `layout` and found one logits
    failure of `failure_requests` requests."""
    s = Summary(budget_s=10.0, seed=3)
    s.shard = Shard(k, n, {"layouts": [layout], "stream": stream, "streams": streams})
    s.examples, s.seconds = cell.get("examples", 10), 10.0
    s.cells[(layout, "eager")] = CellStats(examples=s.examples, seconds=10.0, failures=1, notes=cell.get("notes", {}))
    s.failures.append(Failure("logits", "mismatch", f"{failure_requests} requests", f"r{k}/logits/{k}.json", 2.0,
                              oracle="reference", cell=layout, meta={"signature": None, "counted_in": [layout, "eager"]},
                              seconds_to_find=float(k), size={"requests": failure_requests, "tokens": 9,
                                                             "layout": layout, "mode": "eager"}))
    return json.loads(json.dumps(run_json(s, None)))


def write(tmp_path, docs) -> list[str]:
    paths = []
    for i, d in enumerate(docs):
        p = tmp_path / f"s{i}.json"
        p.write_text(json.dumps(d))
        paths.append(str(p))
    return paths


def test_merge_adds_up_cells_and_keeps_the_smallest_of_one_failure(tmp_path, capsys) -> None:
    notes = {"cases": 10, "requests": 20, "limit: max_num_seqs": 5}
    docs = [shard_doc(1, 2, "tp1pp1", 0, 2, 3, notes=notes), shard_doc(2, 2, "tp1pp1", 1, 2, 2, examples=30,
                                                                      notes={**notes, "cases": 30})]
    assert docs[0]["shard"] == "1/2" and docs[0]["shard_report"]["stream"] == 0
    html = tmp_path / "merged.html"
    assert main(["merge", *write(tmp_path, docs), "--json", "--html", str(html)]) == 1  # a failure found
    doc = json.loads(capsys.readouterr().out)
    assert doc["examples"] == 40 and doc["per_cell"]["tp1pp1/eager"]["examples"] == 40
    assert doc["per_cell"]["tp1pp1/eager"]["limits"] == {"max_num_seqs": 0.25}  # (5 + 5) of 40 Cases
    assert doc["failures"] == 1 and doc["reproducers"] == ["r2/logits/2.json"]  # 2 requests: the smaller
    assert doc["failure_details"][0]["others"] == ["r1/logits/1.json"]
    assert [s["shard"] for s in doc["shards"]] == ["1/2", "2/2"]
    page = html.read_text()
    assert "r2/logits/2.json" in page and "also found as" in page and "r1/logits/1.json" in page
    assert "<h2>Shards</h2>" in page


def test_merge_text_names_missing_shards_and_distinct_failures_stay(tmp_path, capsys) -> None:
    a, b = shard_doc(1, 3, "tp1pp1", 0, 1, 2), shard_doc(3, 3, "tp1pp2", 0, 1, 2)
    b["shard_report"]["report"]["failures"][0]["property"] = "crash"
    assert main(["merge", *write(tmp_path, [a, b])]) == 1
    out, err = capsys.readouterr()
    assert "1 of 3 shards missing: 2/3" in err
    assert out.count("FAILED ") == 2 and "2/3 missing" in out and "also found as" not in out


@pytest.mark.parametrize("change,words", [
    (lambda a, b: b.update(shard="1/2"), "shard 1/2 given twice"),
    (lambda a, b: b.update(shard="2/3"), "split differently"),
    (lambda a, b: b["shard_report"].update(seed=4), "different seeds"),
    (lambda a, b: b.pop("shard"), "not the summary of a shard"),
])
def test_merge_refuses_shards_of_different_campaigns(tmp_path, capsys, change, words) -> None:
    a, b = shard_doc(1, 2, "tp1pp1", 0, 1, 2), shard_doc(2, 2, "tp1pp2", 0, 1, 2)
    change(a, b)
    assert main(["merge", *write(tmp_path, [a, b])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def vllm_doc(k: int, config: str, signature: str, requests: int, crash: dict) -> dict:
    """A vLLM shard's summary (fuzz.targets.vllm.summary.summary_json's form), trimmed to what merge reads."""
    fail = {"property": "crash", "message": "boom", "signature": signature, "config": config, "case": "c",
            "path": f"v{k}.json", "size": {"requests": requests, "tokens": 4}, "shrink_checks": 0}
    plan = {"dimensions": {"layout": ["tp1pp1", "tp1pp2"], "mode": ["eager", "compiled"]}, "pairs_covered": 4,
            "pairs_excluded": {}}
    return {"target": "vllm", "vllm_version": "0.9", "budget_s": 60, "seed": 1, "seconds": 50.0, "shard": f"{k}/2",
            "oracles": ["reference"], "planned_configs": [config], "examples": 5, "failures": [fail], "known": [],
            "unsupported": {}, "per_cell": {config: {"examples": 5, "seconds": 20.0, "examples_per_s": 0.25,
                                                     "failures": [fail], "known": [], "engine_starts": 1,
                                                     "startup_s": 30.0, "stopped": ""}},
            "interrupted": False, "write_errors": 0, "plan": plan, "engine_starts": [{"seconds": 30.0}],
            "startup_s_total": 30.0, "configs_visited": 1, "duplicate_signatures": [], "known_signatures": [],
            "unchecked_for_time": 0, "known_crashes": [crash], "configs_not_reached": []}


def test_merge_vllm_shards(tmp_path, capsys) -> None:
    crash = {"signature": "S", "reproducer": "k.json", "state": "still fails", "detail": "", "combos": []}
    docs = [vllm_doc(1, "tp1pp1-eager", "sig", 3, crash), vllm_doc(2, "tp1pp2-compiled", "sig", 1, crash)]
    html = tmp_path / "v.html"
    assert main(["merge", *write(tmp_path, docs), "--json", "--html", str(html)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert list(doc["per_cell"]) == ["tp1pp1-eager", "tp1pp2-compiled"] and doc["examples"] == 10
    assert len(doc["failures"]) == 1 and doc["failures"][0]["path"] == "v2.json"
    assert doc["failures"][0]["others"] == ["v1.json"]
    assert len(doc["known_crashes"]) == 1 and len(doc["engine_starts"]) == 2
    # Each shard's config ran passing examples: its pair (layout, mode) counts, one from each shard.
    assert doc["pairs_exercised"] == {"covered": 2, "of_planned": 4}
    docs[1]["per_cell"]["tp1pp2-compiled"]["examples"] = 1  # only its failing example: no pair of its own
    assert main(["merge", *write(tmp_path, docs), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["pairs_exercised"]["covered"] == 1
    page = html.read_text()
    assert "tp1pp2-compiled" in page and "Known crashes" in page and "also found as" in page
    assert main(["merge", *write(tmp_path, docs)]) == 1
    out = capsys.readouterr().out
    assert "known crash k.json: still fails" in out and "also found as: v1.json" in out


def test_merge_db_unites_the_shards_databases(tmp_path, capsys) -> None:
    from hypothesis.database import DirectoryBasedExampleDatabase as Db

    a, b, into = (str(tmp_path / n) for n in ("a", "b", "into"))
    Db(a).save(b"cell1", b"x")
    Db(a).save(b"cell1", b"y")
    Db(b).save(b"cell1", b"y")  # the same entry in both: once in the union
    Db(b).save(b"cell2", b"z")
    Db(into).save(b"cell3", b"kept")  # last night's, kept
    assert main(["merge", "--db", a, b, "--db-into", into]) == 0
    assert "3 example(s) from 2 database(s)" in capsys.readouterr().err
    db = Db(into)
    assert set(db.fetch(b"cell1")) == {b"x", b"y"} and set(db.fetch(b"cell2")) == {b"z"}
    assert set(db.fetch(b"cell3")) == {b"kept"}
    assert main(["merge", "--db", a, b, "--db-into", into]) == 0  # again: nothing new
    assert "0 example(s)" in capsys.readouterr().err
    assert main(["merge", "--db", str(tmp_path / "none"), "--db-into", into]) == 2
    assert main(["merge", "--db", a]) == 2  # no --db-into
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "not a directory" in err[0] and "--db-into" in err[1]
