"""`llmfuzz merge`: one summary and report from a campaign's shards (fuzz.campaign.merge)."""
from __future__ import annotations

import json
import sys

from fuzz.errors import EXIT_FAIL, EXIT_OK, BadInput


def cmd_merge(args) -> int:
    """Print the merged summary (text or --json), write --html; exit 1 when a shard found a
    failure, 0 otherwise, 2 on bad input."""
    if bool(args.db) != bool(args.db_into):
        raise BadInput("merge: --db SRC... and --db-into DIR go together (the databases to unite, and where)")
    if args.db:
        from fuzz.profiles import union_databases

        try:
            added = union_databases(args.db, args.db_into)
        except ValueError as e:
            raise BadInput(f"merge: {e}") from None
        sys.stderr.write(f"llmfuzz merge: {added} example(s) from {len(args.db)} database(s) added to {args.db_into}\n")
    if not args.summaries:
        if args.db:
            return EXIT_OK
        raise BadInput("merge: give the shards' summary JSON files (or --db SRC... --db-into DIR)")
    from fuzz.campaign.merge import check_shards, load, merge_reference

    docs = load(args.summaries)
    n, missing = check_shards(docs)
    if missing:
        sys.stderr.write(f"llmfuzz merge: {len(missing)} of {n} shards missing: {', '.join(missing)}\n")
    if docs[0].get("target") == "vllm":
        from fuzz.campaign.merge_vllm import merge_vllm, vllm_text

        doc = merge_vllm(docs, missing)
        text, failures = vllm_text(doc), len(doc["failures"])
    else:
        from fuzz.campaign.findings import run_json, run_text

        summary, shrink = merge_reference(docs, missing)
        doc, text, failures = run_json(summary, shrink), run_text(summary, shrink), len(summary.failures)
    if args.html:
        from fuzz.report.render import write_report

        write_report(doc, None, args.html, args.title)
    print(json.dumps(doc, indent=1) if args.json else text)
    return EXIT_FAIL if failures else EXIT_OK


def add_merge_parser(sub) -> None:
    m = sub.add_parser("merge", help="one summary and report from the --json summaries of a campaign's shards "
                       "(`run --shard K/N`)")
    m.add_argument("summaries", nargs="*", help="the shards' `llmfuzz run --shard K/N --json` output files")
    m.add_argument("--html", default=None, help="write the merged HTML report here")
    m.add_argument("--title", default="llmfuzz merged shards")
    m.add_argument("--json", action="store_true", help="print the merged summary as JSON")
    m.add_argument("--db", nargs="+", default=[], help="the shards' example databases (directories) to unite")
    m.add_argument("--db-into", default=None, help="the database the union goes into (made if missing; what it "
                   "holds is kept): next night's $LLMFUZZ_DB")
    m.set_defaults(fn=cmd_merge)
