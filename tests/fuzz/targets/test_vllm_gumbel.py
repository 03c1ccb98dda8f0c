"""fuzz.targets.vllm.gumbel: vLLM's CPU Gumbel-max draw, from its definition. Here without
vLLM: the draw samples the softmax, a seed's row seeds come from its own generator, and a
token that is not the seed's draw is named where no near tie leaves it open. The comparison
with vLLM's own kernel is a `vllm` test (tests/fuzz/targets/test_vllm_sampling.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sample.sampling_params import SamplingParams
from fuzz.cases.case import RequestSpec
from fuzz.targets.vllm.gumbel import check_draws, draw, noise, step_seeds


def test_the_draw_samples_the_softmax() -> None:
    logits = np.array([1.0, 0.0, -1.0, 2.0, -np.inf])
    p = np.exp(logits - logits[3])
    p /= p.sum()
    seeds = np.random.default_rng(0).integers(0, 2 ** 31, 20000)
    freq = np.bincount([draw(logits, int(s)) for s in seeds], minlength=5) / len(seeds)
    assert freq[4] == 0  # masked
    assert np.abs(freq - p).max() < 0.015, (freq, p)


def test_noise_is_a_function_of_seed_and_token() -> None:
    a, b = noise(7, 300), noise(7, 300)
    assert np.array_equal(a, b) and not np.array_equal(a, noise(8, 300))
    assert np.array_equal(noise(7, 10), a[:10])  # token i's noise does not depend on the vocabulary


def test_row_seeds_come_from_the_requests_own_generator() -> None:
    g = torch.Generator().manual_seed(11)
    want = [int(torch.randint(0, 2 ** 31, (1,), generator=g, dtype=torch.long)) for _ in range(4)]
    assert step_seeds(11, 4) == want and step_seeds(11, 2) == want[:2]


def _request(seed=3, **kw) -> RequestSpec:
    return RequestSpec((1, 2, 3), 6, sampling=SamplingParams(temperature=1.0, seed=seed, **kw))


def _rows(n=6, V=32, scale=3.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(V, generator=g) * scale for _ in range(n)]


def _drawn(spec, rows, seeds) -> list[int]:
    """The tokens vLLM draws with these row seeds (no params but temperature 1: raw logits)."""
    return [draw(r.double().numpy(), s) for r, s in zip(rows, seeds)]


def test_the_seeds_own_draws_pass_and_every_clear_position_is_checked() -> None:
    spec, rows = _request(), _rows()
    bad, checked, ties = check_draws(spec, rows, _drawn(spec, rows, step_seeds(3, 6)), 1e-5)
    assert bad is None and checked + ties == 6 and checked >= 5


def test_a_generator_advanced_for_a_step_it_did_not_sample_is_caught() -> None:
    """The class of docs/bug_classes.md#sampling_generator_advanced_unsampled in vLLM: one draw
    too many (a partial prefill's sample not rewound, another row's draw) shifts every later
    token of the request to another seed's draw."""
    spec, rows = _request(), _rows()
    shifted = step_seeds(3, 7)[1:]
    bad, _, _ = check_draws(spec, rows, _drawn(spec, rows, shifted), 1e-5)
    assert bad is not None and "its seeded Gumbel draw" in bad[1]


def test_a_near_tie_is_counted_not_judged() -> None:
    spec = _request(seed=5)
    seed = step_seeds(5, 1)[0]
    row = torch.zeros(8, dtype=torch.float64)
    z = noise(seed, 8)
    first, second = np.argsort(-z)[:2]
    row[second] += z[first] - z[second]  # the runner-up now ties the winner
    tokens = [int(second)]
    assert check_draws(spec, [row.float()], tokens, 1e-3)[0] is None
    assert check_draws(spec, [row.float()], tokens, 1e-3)[2] == 1
    # A tolerance far below the gap judges it.
    row[second] -= 0.5
    bad, checked, _ = check_draws(spec, [row.float()], tokens, 1e-3)
    assert bad is not None and checked == 1


def test_the_processed_logits_are_drawn_from() -> None:
    """top-k masks before the draw: only the k best can come out."""
    spec, rows = _request(top_k=2), _rows(n=8)
    tokens = []
    for r, s in zip(rows, step_seeds(3, 8)):
        z = r.double().numpy().copy()
        z[np.argsort(-z)[2:]] = -np.inf
        tokens.append(draw(z, s))
    assert check_draws(spec, rows, tokens, 1e-5)[0] is None
    unmasked = _drawn(spec, rows, step_seeds(3, 8))
    assert unmasked != tokens and check_draws(spec, rows, unmasked, 1e-5)[0] is not None


def test_a_token_the_target_may_keep_at_a_masks_threshold_is_a_near_tie_not_a_failure() -> None:
    """Found by a bf16 campaign (top-k 5, temperature 2): the sixth token, 0.017 under the fifth
    in the oracle's logits, kept by vLLM's rounding, won the draw. Within the tolerance it is a
    near tie; with a tolerance under the gap, the same draw is a failure."""
    spec = RequestSpec((1,), 1, sampling=SamplingParams(temperature=2.0, top_k=5, seed=20326))
    seed = step_seeds(20326, 1)[0]
    z = noise(seed, 16)
    order = np.argsort(-z)  # token order[0] has the most noise: put it sixth
    row = torch.zeros(16, dtype=torch.float64)
    for rank, t in enumerate(list(order[1:6]) + [order[0]] + list(order[6:])):
        row[t] = 3.0 - 0.1 * rank
    row[order[0]] = row[order[5]] - 0.017
    sixth = int(order[0])
    kept = row.clone()
    kept[sixth] += 0.05  # the target's rounding puts it in the top 5
    zz = kept.numpy() / 2.0
    zz[np.argsort(-zz)[5:]] = -np.inf
    assert draw(zz, seed) == sixth
    bad, checked, ties = check_draws(spec, [row.float()], [sixth], 0.17)
    assert bad is None and (checked, ties) == (0, 1)
    bad, _, _ = check_draws(spec, [row.float()], [sixth], 1e-3)
    assert bad is not None and f"vLLM drew token {sixth}" in bad[1]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_logits_drawn_from(temperature) -> None:
    spec = RequestSpec((1,), 6, sampling=SamplingParams(temperature=temperature, seed=9))
    rows = _rows()
    tokens = [draw(r.double().numpy() / temperature, s) for r, s in zip(rows, step_seeds(9, 6))]
    assert check_draws(spec, rows, tokens, 1e-5)[0] is None
