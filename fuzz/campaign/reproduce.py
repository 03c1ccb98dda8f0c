"""Reproducers: a failing Case as one versioned JSON file, written atomically, replayed anywhere.

Layout: `<out>/<property>/<id>.json`, id = a hash of the Case, so the same failure found
twice lands in the same file. Loading never executes anything (JSON only).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass

from fuzz.cases.case import Case, CaseFormatError
from fuzz.contention.coprocs import active

# The newest reproducer format this llmfuzz reads. 2: a `history` of earlier Cases a replay runs
# first (fuzz.campaign.history); a reproducer without one is still written as format 1, so any
# llmfuzz reads it, and one with one is refused by an llmfuzz that would replay the Case alone.
REPRO_FORMAT = 2
REPRO_FORMAT_PLAIN = 1
LLMFUZZ_VERSION = "0.1.0"


@dataclass(slots=True)
class Reproducer:
    case: Case
    property: str
    message: str
    error_ratio: float | None = None
    path: str | None = None
    meta: dict | None = None
    history: tuple = ()  # Cases a replay runs first, on the same fresh engine (format 2)


def case_id(case: Case) -> str:
    return hashlib.sha256(case.to_json().encode()).hexdigest()[:12]


def write_reproducer(out_dir: str, case: Case, prop: str, message: str,
                     error_ratio: float | None = None, oracle: str | None = None,
                     second_opinion: str | None = None, meta: dict | None = None) -> str:
    """Write atomically (temp file + fsync + rename): a kill mid-write never leaves a
    truncated reproducer behind. `oracle` names what the failing run was compared against;
    `second_opinion` is the transformers oracle's verdict on the same Case; `meta`, extra
    top-level fields a target adds (vLLM: its version, LLM arguments, crash signature)."""
    import torch

    d = os.path.join(out_dir, prop)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{case_id(case)}.json")
    ratio = None if error_ratio is None or error_ratio != error_ratio else error_ratio
    doc = {
        "format": REPRO_FORMAT if meta and meta.get("history") else REPRO_FORMAT_PLAIN,
        "llmfuzz_version": LLMFUZZ_VERSION, "torch_version": torch.__version__,
        "device": case.config.device, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "property": prop, "message": message, "oracle": oracle, "second_opinion": second_opinion,
        "error_ratio": ratio if ratio is None or ratio != float("inf") else "inf",
        "case": case.to_dict(),
    }
    if meta:
        doc.update({k: v for k, v in meta.items() if k not in doc})
    if "contention" not in doc and active() is not None:  # the load it failed under: replay restores it
        doc["contention"] = active()
    if case.target != "reference":
        doc["replay"] = f"llmfuzz replay {path}"
    write_json_atomic(path, doc)
    return path


def write_json_atomic(path: str, doc: dict) -> None:
    """`doc` as JSON at `path`, all or nothing: written beside it, synced, then renamed over
    it, so a reader (or a campaign killed meanwhile) never sees half a file."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; reproducers are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def update_reproducer(path: str, **fields) -> None:
    """Add top-level `fields` to the reproducer at `path`, atomically (what was learned of it
    after it was written: its replay rate)."""
    with open(path) as f:
        doc = json.load(f)
    doc.update(fields)
    write_json_atomic(path, doc)


def load_reproducer(path: str) -> Reproducer:
    """Parse a reproducer; any problem is a CaseFormatError with one line naming it."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise CaseFormatError(f"{path}: cannot read ({e.strerror})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CaseFormatError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                              "truncated?") from None
    if not isinstance(doc, dict):
        raise CaseFormatError(f"{path}: expected a JSON object")
    fmt = doc.get("format")
    if not isinstance(fmt, int):
        raise CaseFormatError(f"{path}: 'format' missing or not an integer")
    if fmt > REPRO_FORMAT:
        raise CaseFormatError(f"{path}: reproducer format {fmt} is newer than this llmfuzz "
                              f"understands ({REPRO_FORMAT}); upgrade llmfuzz")
    if "case" not in doc:
        raise CaseFormatError(f"{path}: 'case' missing")
    try:
        from fuzz.campaign.history import parse_history

        case, history = _migrate(Case.from_dict(doc["case"]), doc), parse_history(doc)
    except CaseFormatError as e:
        raise CaseFormatError(f"{path}: {e}") from None
    ratio = doc.get("error_ratio")
    return Reproducer(case, str(doc.get("property", "unknown")), str(doc.get("message", "")),
                      float(ratio) if isinstance(ratio, (int, float, str)) and ratio is not None else None,
                      path, {k: v for k, v in doc.items() if k not in ("case", "history")}, history)


def _migrate(case: Case, doc: dict) -> Case:
    """vLLM reproducers written before Cases had a target (case format 1, up to llmfuzz's
    target refactor) named it beside the Case: `target` and `vllm_options` at the top level.
    They load as they are, as the Case they describe."""
    if case.target == "reference" and doc.get("target", "reference") != "reference":
        opts = doc.get("vllm_options") or {}
        if not isinstance(opts, dict):
            raise CaseFormatError("'vllm_options': expected a JSON object")
        case = dataclasses.replace(case, target=str(doc["target"]), target_options=dict(opts))
        case.validate()
    return case


# Where a message says its violation happened, not what it is: dropped before its kind is read.
_WHERE = re.compile(r"^(?:request \S+ position \d+|rank\(s\) \[[^\]]*\][^:]*|rank \d+ layer \d+ microbatch \d+"
                    r"(?: \(graph replay\))?|microbatch \d+|request \S+):\s*")
_LOGITS_KINDS = (("non-finite logits", "non-finite logits"), ("max |logits -", "logits beyond tolerance"),
                 ("greedy token", "greedy token differs"), ("generated positions", "generated lengths differ"))


def message_kind(prop: str, message: str) -> str:
    """What kind of violation `message` reports, the same across sizes, positions and oracles:
    a replay that fails with the recorded property but another kind ("non-finite logits"
    recorded, "logits beyond tolerance" now) is another bug, or a bug gone half-way. Logits:
    one of four kinds; FA invariants: the argument named (max_seqlen_k, slot_mapping, ...);
    others: the message's first words with numbers and literals blanked."""
    text = _WHERE.sub("", " ".join(message.split()))
    if prop == "logits":  # "" for a message of none of the four (hand-written): not compared
        return next((kind for words, kind in _LOGITS_KINDS if words in text), "")
    if prop == "fa_invariants":
        arg = re.search(r"\b[a-z]+(?:_[a-z0-9]+)+\b", text)
        if arg:
            return arg.group(0)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "…", text)
    text = re.sub(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", "N", text)
    return " ".join(text.split()[:6])


def replay_on(target, repro: Reproducer) -> tuple[str, Exception | None]:
    """Run the reproducer's Case on `target` once (after its history, where it has one: the
    earlier Cases, on the same engine): its `replay_verdict` and the Violation raised (None
    when it passed)."""
    from fuzz.targets.fresh import run_history
    from fuzz.verdict.properties import Violation

    run_history(target.check, repro.history)
    try:
        target.check(repro.case)
    except Violation as v:
        return replay_verdict(repro, v), v
    return replay_verdict(repro, None), None


def replay_verdict(repro: Reproducer, violation: Exception | None) -> str:
    """'passes' (nothing failed), 'reproduces' (the recorded property, and the recorded
    message's kind where one was recorded) or 'differs' (another violation)."""
    if violation is None:
        return "passes"
    prop = getattr(violation, "property", None)
    if prop != repro.property:
        return "differs"
    sig, rec_sig = getattr(violation, "signature", None), (repro.meta or {}).get("signature")
    if sig is not None or rec_sig is not None:  # a crash: its signature says which one (vLLM's)
        return "reproduces" if sig == rec_sig else "differs"
    recorded = message_kind(prop, repro.message) if repro.message else ""
    if recorded and recorded != message_kind(prop, str(violation)):
        return "differs"
    return "reproduces"


def replay_report(repro: Reproducer, violation: Exception | None) -> str:
    """cargo-fuzz style text for a replayed reproducer."""
    p = repro.path or "FILE"
    lines = [f"Failing case: {repro.case.describe()}", f"  file: {p}"]
    if repro.history:  # fuzz.campaign.history: the Case alone passes on a fresh engine
        lines += [f"  after {len(repro.history)} earlier Case(s) on the same engine (its `history`, run first): "
                  "the Case alone passed on a fresh engine"]
    if (repro.meta or {}).get("fresh_replay") == "passes":
        lines += ["  note: when written, this did not fail on a fresh engine (reproducible: false)"]
    if violation is None:
        lines += ["What was violated: nothing now; the case passes "
                  f"(recorded: {repro.property}: {repro.message})"]
    else:
        prop = getattr(violation, "property", type(violation).__name__)
        oracle = getattr(violation, "oracle", None)
        lines += [f"What was violated: {prop}" + (f" (against {oracle})" if oracle else "") + f": {violation}"]
        if replay_verdict(repro, violation) == "differs":
            lines += [f"Not what was recorded: {repro.property} ({message_kind(repro.property, repro.message)}): "
                      f"{repro.message}; now {prop} ({message_kind(prop, str(violation))})"]
        if getattr(violation, "second_opinion", None):
            lines += [f"Second opinion: {violation.second_opinion}"]
    lines += [f"Reproduce with: llmfuzz replay {p}   (or: python reproducers/replay.py {p})",
              f"Minimize with: llmfuzz minimize {p}"]
    return "\n".join(lines)
