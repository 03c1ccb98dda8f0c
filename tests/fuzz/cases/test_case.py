"""Case JSON: every drawn Case round-trips; every malformed input is one CaseFormatError line.

Nothing here starts an engine: a bad Case must be rejected before any rank starts.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings, strategies as st

from engine.faults import FAULTS
from engine.schedule import Schedule
from fuzz.cases.case import CASE_FORMAT, Case, CaseFormatError, RequestSpec, Workload
from fuzz.campaign.reproduce import REPRO_FORMAT, load_reproducer, write_reproducer
from fuzz.cases.strategies import DEFAULT_LAYOUTS, FUZZ_MODEL, MODES, cases


def good_case() -> Case:
    return Case(FUZZ_MODEL.replace(layout="tp2pp2"),
                Workload((RequestSpec((1, 2, 3, 4, 5), 3), RequestSpec((7,), 1, arrival_step=2))),
                Schedule(seed=3, rank_order="random", copy_delay=0.5, prepare_ahead=1.0),
                ("pp_stale_new_token_ids",))


@st.composite
def cases_with_faults(draw) -> Case:
    case = draw(cases(layouts=DEFAULT_LAYOUTS, modes=MODES))
    faults = draw(st.lists(st.sampled_from(sorted(FAULTS)), unique=True, max_size=3))
    return dataclasses.replace(case, faults=tuple(faults))


@settings(max_examples=150)
@given(cases_with_faults())
def test_json_round_trip(case: Case) -> None:
    text = case.to_json()
    back = Case.from_json(text)
    assert back.to_json() == text
    assert back == case
    # A dict that went through json (lists, not tuples) loads to the same Case too.
    assert Case.from_dict(json.loads(text)) == case


def test_round_trip_keeps_every_field() -> None:
    case = good_case()
    back = Case.from_json(case.to_json())
    assert back == case
    assert back.schedule == case.schedule and back.faults == case.faults
    assert back.workload.requests[1].arrival_step == 2
    assert back.config.layout == "tp2pp2"


def _doc(**case_changes) -> dict:
    d = good_case().to_dict()
    for k, v in case_changes.items():
        d[k] = v
    return d


def _cfg_doc(**cfg_changes) -> dict:
    d = good_case().to_dict()
    d["config"].update(cfg_changes)
    return d


def _req_doc(**req_changes) -> dict:
    d = good_case().to_dict()
    d["workload"][0].update(req_changes)
    return d


_FULL = good_case().to_json()
_NO_FORMAT = {k: v for k, v in good_case().to_dict().items() if k != "format"}

# (id, JSON text, words the one-line message must contain)
MALFORMED = [
    ("not_json", "this is not json", "not valid JSON"),
    ("truncated", _FULL[: len(_FULL) // 2], "not valid JSON"),
    ("empty_file", "", "not valid JSON"),
    ("not_an_object", json.dumps([1, 2, 3]), "expected a JSON object"),
    ("missing_format", json.dumps(_NO_FORMAT), "format"),
    ("format_not_int", json.dumps(_doc(format="1")), "format"),
    ("newer_format", json.dumps(_doc(format=CASE_FORMAT + 1)), "newer"),
    ("missing_config", json.dumps({k: v for k, v in good_case().to_dict().items() if k != "config"}), "config"),
    ("missing_workload", json.dumps({k: v for k, v in good_case().to_dict().items() if k != "workload"}),
     "workload"),
    ("config_not_object", json.dumps(_doc(config=5)), "config"),
    ("unknown_config_field", json.dumps(_cfg_doc(num_experts=8)), "num_experts"),
    ("heads_not_divisible_by_tp", json.dumps(_cfg_doc(tensor_parallel_size=3)), "divisible by tp=3"),
    ("more_stages_than_layers", json.dumps(_cfg_doc(pipeline_parallel_size=9)), "more stages"),
    ("negative_block_size", json.dumps(_cfg_doc(block_size=-4)), "block_size"),
    ("bad_dtype", json.dumps(_cfg_doc(dtype="float8")), "dtype"),
    ("sp_without_tp", json.dumps(_cfg_doc(tensor_parallel_size=1, sequence_parallel=True)), "sequence_parallel"),
    ("no_requests", json.dumps(_doc(workload=[])), "no requests"),
    ("workload_not_list", json.dumps(_doc(workload=7)), "workload"),
    ("request_missing_max_tokens", json.dumps(_doc(workload=[{"prompt_token_ids": [1]}])), "max_tokens"),
    ("empty_prompt", json.dumps(_req_doc(prompt_token_ids=[])), "empty prompt"),
    ("token_outside_vocab", json.dumps(_req_doc(prompt_token_ids=[1, FUZZ_MODEL.vocab_size])),
     f"token id {FUZZ_MODEL.vocab_size} outside vocab"),
    ("negative_token", json.dumps(_req_doc(prompt_token_ids=[-1])), "token id -1 outside vocab"),
    ("prompt_plus_max_tokens_too_long",
     json.dumps(_req_doc(prompt_token_ids=[1] * 60, max_tokens=5)), "max_model_len"),
    ("zero_max_tokens", json.dumps(_req_doc(max_tokens=0)), "max_tokens"),
    ("negative_arrival", json.dumps(_req_doc(arrival_step=-1)), "arrival_step"),
    ("bad_schedule_field", json.dumps(_doc(schedule={"seed": 0, "jitter": 1})), "jitter"),
    ("bad_rank_order", json.dumps(_doc(schedule={"rank_order": "reverse"})), "rank_order"),
    ("copy_delay_out_of_range", json.dumps(_doc(schedule={"copy_delay": 2.0})), "copy_delay"),
    ("unknown_fault", json.dumps(_doc(faults=["pp_everything_wrong"])), "unknown fault 'pp_everything_wrong'"),
    # Sampling params and aborts (format 6).
    ("sampling_not_object", json.dumps(_req_doc(sampling=5)), "sampling: expected a JSON object"),
    ("sampling_unknown_field", json.dumps(_req_doc(sampling={"temprature": 1.0})), "unknown field 'temprature'"),
    ("sampling_negative_temperature", json.dumps(_req_doc(sampling={"temperature": -1})), "sampling.temperature"),
    ("sampling_top_p_zero", json.dumps(_req_doc(sampling={"temperature": 1.0, "top_p": 0})), "sampling.top_p"),
    ("sampling_greedy_children", json.dumps(_req_doc(sampling={"n": 2})), "sampling.n"),
    ("sampling_stop_list_of_words", json.dumps(_req_doc(sampling={"stop_token_ids": ["eos"]})), "sampling"),
    ("sampling_stop_outside_vocab", json.dumps(_req_doc(sampling={"stop_token_ids": [FUZZ_MODEL.vocab_size]})),
     f"token id {FUZZ_MODEL.vocab_size} outside vocab"),
    ("sampling_min_tokens_over_max", json.dumps(_req_doc(sampling={"min_tokens": 4})), "min_tokens"),
    ("sampling_max_tokens_contradicts", json.dumps(_req_doc(sampling={"max_tokens": 7})), "contradicts"),
    ("random_sampling_with_drafts",
     json.dumps({**_cfg_doc(speculative_method="ngram", num_speculative_tokens=2),
                 "workload": [{"prompt_token_ids": [1, 2], "max_tokens": 2, "sampling": {"temperature": 1.0}}]}),
     "needs speculative_method none"),
    ("abort_before_arrival", json.dumps(_req_doc(arrival_step=2, abort_step=1)), "abort_step"),
    ("abort_not_int", json.dumps(_req_doc(abort_step="3")), "abort_step"),
    ("abort_bool", json.dumps(_req_doc(abort_step=True)), "abort_step"),
    ("in_step_without_abort", json.dumps(_req_doc(abort_in_step=True)), "abort_in_step"),
    ("in_step_not_bool", json.dumps(_req_doc(abort_step=1, abort_in_step=1)), "abort_in_step"),
]


def _one_line(msg: str) -> None:
    assert msg and "\n" not in msg, repr(msg)
    assert "Traceback" not in msg


@pytest.mark.parametrize("text,words", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_case_is_one_line_error(text: str, words: str) -> None:
    with pytest.raises(CaseFormatError) as ei:
        Case.from_json(text)
    msg = str(ei.value)
    _one_line(msg)
    assert words in msg, msg


def _repro_text(case_text: str) -> str:
    """A reproducer document wrapping `case_text` (kept as raw text: it may be broken)."""
    return ('{"format": %d, "property": "logits", "message": "m", "error_ratio": 2.0, "case": %s}'
            % (REPRO_FORMAT, case_text))


# Case-level problems, seen through a reproducer file (the not-JSON ones are file-level).
_CASE_LEVEL = [m for m in MALFORMED if m[0] not in ("not_json", "truncated", "empty_file")]


@pytest.mark.parametrize("text,words", [m[1:] for m in _CASE_LEVEL], ids=[m[0] for m in _CASE_LEVEL])
def test_load_reproducer_rejects_malformed_case(tmp_path, text: str, words: str) -> None:
    p = tmp_path / "bad.json"
    p.write_text(_repro_text(text))
    with pytest.raises(CaseFormatError) as ei:
        load_reproducer(str(p))
    msg = str(ei.value)
    _one_line(msg)
    assert words in msg and str(p) in msg, msg


def _good_repro(tmp_path) -> str:
    return write_reproducer(str(tmp_path), good_case(), "logits", "planted", 3.5)


FILE_LEVEL = [
    ("not_json", lambda full: "garbage{", "not valid JSON"),
    ("truncated", lambda full: full[: len(full) * 2 // 3], "truncated"),
    ("empty_file", lambda full: "", "not valid JSON"),
    ("not_an_object", lambda full: "[]", "expected a JSON object"),
    ("missing_format", lambda full: json.dumps({k: v for k, v in json.loads(full).items() if k != "format"}),
     "'format' missing"),
    ("newer_format", lambda full: json.dumps(dict(json.loads(full), format=REPRO_FORMAT + 1)), "newer"),
    ("missing_case", lambda full: json.dumps({k: v for k, v in json.loads(full).items() if k != "case"}),
     "'case' missing"),
]


@pytest.mark.parametrize("mutate,words", [m[1:] for m in FILE_LEVEL], ids=[m[0] for m in FILE_LEVEL])
def test_load_reproducer_rejects_malformed_file(tmp_path, mutate, words: str) -> None:
    path = _good_repro(tmp_path)
    with open(path) as f:
        full = f.read()
    bad = tmp_path / "bad.json"
    bad.write_text(mutate(full))
    with pytest.raises(CaseFormatError) as ei:
        load_reproducer(str(bad))
    msg = str(ei.value)
    _one_line(msg)
    assert words in msg, msg


def test_load_reproducer_missing_file(tmp_path) -> None:
    with pytest.raises(CaseFormatError) as ei:
        load_reproducer(str(tmp_path / "nope.json"))
    _one_line(str(ei.value))
    assert "cannot read" in str(ei.value)


def test_reproducer_round_trip(tmp_path) -> None:
    path = _good_repro(tmp_path)
    # <out>/<property>/<id>.json, the id a hash of the Case: the same Case lands in one file.
    assert path.startswith(str(tmp_path / "logits")) and path.endswith(".json")
    assert _good_repro(tmp_path) == path
    r = load_reproducer(path)
    assert r.case == good_case()
    assert (r.property, r.message, r.error_ratio, r.path) == ("logits", "planted", 3.5, path)
    for key in ("format", "llmfuzz_version", "torch_version", "device", "created"):
        assert key in r.meta
    # Atomic write: no temp file left beside it.
    assert sorted(p.name for p in (tmp_path / "logits").iterdir()) == [path.rsplit("/", 1)[1]]


def test_reproducer_infinite_ratio_round_trips(tmp_path) -> None:
    path = write_reproducer(str(tmp_path), good_case(), "logits", "nan logits", float("inf"))
    with open(path) as f:
        doc = json.load(f, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert doc["error_ratio"] == "inf"
    assert load_reproducer(path).error_ratio == float("inf")


def test_prompt_lengths_draw_when_no_block_or_budget_edge_fits():
    """vLLM's block 128 with a 128-token budget and max_model_len 128: every edge is past half
    the context, and the strategy must still draw (it raised, ending a vLLM campaign)."""
    from hypothesis import given, settings

    from fuzz.cases.strategies import FUZZ_MODEL, prompt_lengths

    cfg = FUZZ_MODEL.replace(block_size=128, max_num_batched_tokens=128, max_model_len=128, num_gpu_blocks=8)
    seen = []

    @settings(max_examples=30, database=None, deadline=None)
    @given(prompt_lengths(cfg))
    def draw(n):
        seen.append(n)
    draw()
    assert seen and all(1 <= n <= 64 for n in seen)


def test_async_scheduling_is_written_only_when_on() -> None:
    """Async scheduling off (and a Schedule that never waits): the JSON of before, format 2.
    On, or a Schedule with async_wait: format 7, and it round-trips; the reference run is
    synchronous."""
    from fuzz.cases.case import ASYNC_FORMAT, reference_config

    plain = Case(FUZZ_MODEL, Workload((RequestSpec((1, 2, 3), 2),)))
    d = plain.to_dict()
    assert d["format"] == 2 and "async_scheduling" not in d["config"] and "async_wait" not in d["schedule"]
    on = dataclasses.replace(plain, config=FUZZ_MODEL.replace(async_scheduling=True))
    waits = dataclasses.replace(on, schedule=Schedule(seed=4, async_wait=0.5))
    for case in (on, waits):
        d = case.to_dict()
        assert d["format"] == ASYNC_FORMAT and d["config"]["async_scheduling"] is True
        assert Case.from_json(case.to_json()) == case
    assert Case.from_json(waits.to_json()).schedule.async_wait == 0.5
    assert not reference_config(on.config).async_scheduling
    assert "async_scheduling" in on.describe()
