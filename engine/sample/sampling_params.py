"""SamplingParams: how one request turns logits into tokens (vLLM's names and ranges).

The default, `SamplingParams()`, is greedy with nothing applied: the runner takes the argmax
of the raw logits row, exactly as an engine without sampling parameters does.

There is no tokenizer here, so vLLM's stop *strings* are stop *sequences of token ids*
(`stop_sequences`): a request stops once its output ends with one of them. As with a stop
token id, the tokens of the sequence stay in the output. There is no EOS token either:
`min_tokens` suppresses `stop_token_ids` only.

Plain values only (picklable, hashable): the driver ships them to every rank in
NewRequestData, and ranks build their per-request sampling state from them.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, fields, replace

from engine.config import ConfigError

MAX_LOGIT_BIAS = 100.0  # vLLM clamps biases to +-100; larger ones are refused here
MAX_LOGPROBS = 20
MIN_TEMPERATURE = 0.01  # below it logits / T overflows fp32 (vLLM clamps to the same bound)


class SamplingParamsError(ConfigError):
    """A sampling parameter that cannot work; the message is one line naming the field."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 0.0  # 0: greedy (argmax); top_p, top_k and min_p are then unused
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off; over prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias), sorted; a dict is accepted
    seed: int | None = None  # None: derived from the engine seed and the request id
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    max_tokens: int | None = None  # None: add_request's max_tokens
    logprobs: int | None = None  # top-k logprobs of the processed distribution per generated token
    prompt_logprobs: int | None = None  # top-k logprobs of the raw distribution per prompt token

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalising in place is the only way
        if isinstance(self.logit_bias, dict):
            set_(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        set_(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        set_(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        set_(self, "stop_sequences", tuple(tuple(int(t) for t in s) for s in self.stop_sequences))
        self._validate()
        if self.temperature == 0.0:  # as vLLM: greedy ignores the random-sampling knobs
            set_(self, "top_p", 1.0)
            set_(self, "top_k", 0)
            set_(self, "min_p", 0.0)

    def _validate(self) -> None:
        _int("n", self.n, 1)
        _float("temperature", self.temperature, 0.0, math.inf)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise SamplingParamsError(f"SamplingParams.temperature: {self.temperature} is neither 0 (greedy) "
                                      f"nor >= {MIN_TEMPERATURE}")
        _float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int("top_k", self.top_k, 0)
        _float("min_p", self.min_p, 0.0, 1.0)
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        toks = [t for t, _ in self.logit_bias]
        if len(set(toks)) != len(toks):
            raise SamplingParamsError(f"SamplingParams.logit_bias: token given twice in {self.logit_bias}")
        for t, b in self.logit_bias:
            _int("logit_bias token", t, 0)
            _float("logit_bias", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.seed is not None:
            _int("seed", self.seed, 0)
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, 0)
        for s in self.stop_sequences:
            if not s or min(s) < 0:
                raise SamplingParamsError(f"SamplingParams.stop_sequences: {s} is empty or has a negative id")
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
            if self.min_tokens > self.max_tokens:
                raise SamplingParamsError(f"SamplingParams.min_tokens: {self.min_tokens} > max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0, MAX_LOGPROBS)
        if self.n > 1 and self.temperature == 0.0:
            raise SamplingParamsError(f"SamplingParams.n: {self.n} greedy children would all be equal (temperature=0)")

    # -- what the engine needs to know ---------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Anything between the raw logits and the token besides a greedy argmax."""
        return (not self.is_greedy or self.has_penalties or bool(self.logit_bias)
                or (self.min_tokens > 0 and bool(self.stop_token_ids)))

    @property
    def records_distribution(self) -> bool:
        """The request's processed distribution goes to the Trace (a plain greedy request's is
        the raw logits row, which is recorded anyway)."""
        return self.processes_logits or self.logprobs is not None

    def token_ids(self) -> set[int]:
        """Every token id the params name (checked against the vocabulary at add_request)."""
        return ({t for t, _ in self.logit_bias} | set(self.stop_token_ids)
                | {t for s in self.stop_sequences for t in s})

    def child(self, index: int) -> "SamplingParams":
        """The index-th of n parallel samples (vLLM's ParentRequest): n=1, seed + index when
        seeded (unseeded children differ by their request ids)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    # -- plain data, for reproducers --------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready, defaults left out (`SamplingParams.from_dict` inverts it)."""
        d = {k: v for k, v in asdict(self).items() if v != getattr(DEFAULT, k)}
        for k in ("logit_bias", "stop_token_ids", "stop_sequences"):
            if k in d:
                d[k] = [list(x) if isinstance(x, tuple) else x for x in getattr(self, k)]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise SamplingParamsError(f"SamplingParams: unknown field {unknown[0]!r}")
        return cls(**d)


def request_seed(params: SamplingParams, engine_seed: int, req_id: str) -> int:
    """The seed of a request's generator: its own, or one derived from the engine seed and
    its id (a stable hash: Python's hash() of a str changes per process)."""
    if params.seed is not None:
        return params.seed
    digest = hashlib.sha256(f"{engine_seed}/{req_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def child_request_ids(req_id: str, n: int) -> list[str]:
    """vLLM's child ids for parallel sampling: f"{index}_{parent}"."""
    return [f"{i}_{req_id}" for i in range(n)]


def _int(name: str, v, low: int, high: int | None = None) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
        bound = f">= {low}" if high is None else f"within {low}..{high}"
        raise SamplingParamsError(f"SamplingParams.{name}: must be an int {bound}, got {v!r}")


def _float(name: str, v, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        and (v > low if low_open else v >= low) and v <= high
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise SamplingParamsError(f"SamplingParams.{name}: must be a finite number in {interval}, got {v!r}")


DEFAULT = SamplingParams()
