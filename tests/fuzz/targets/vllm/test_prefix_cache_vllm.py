"""The `vllm_prefix_cache` property on a real vLLM (skips without it): a clean engine's
reported hits equal the harness's model, salted or not; a planted bug that leaves the cache
salt out of vLLM's block hash (LLMFUZZ_VLLM_PLANT=prefix_hash_ignores_salt, patched inside the
vLLM process by fuzz/targets/vllm/site/sitecustomize.py) is caught by it, while the outputs
stay right (the KV shared across salts is the same KV). Also: the worker's warm-up ran
before the engine was reported up."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from fuzz.cases.case import RequestSpec, Workload  # noqa: E402
from fuzz.targets.vllm.checker import VLLMChecker, VLLMPrefixCache, vllm_case  # noqa: E402
from fuzz.targets.vllm.configs import VLLMOptions  # noqa: E402
from fuzz.targets.vllm.runner import VLLMRunner  # noqa: E402

pytestmark = [pytest.mark.vllm]

PROMPT = tuple((7 * i) % 250 + 3 for i in range(40))  # one full block of 32, then 8


def case_of(salt: str | None):
    return VLLMOptions(enable_prefix_caching=True).on(vllm_case(Workload((RequestSpec(PROMPT, 3, cache_salt=salt),))))


@pytest.fixture
def checker(tmp_path, monkeypatch):
    made = []

    def make(plant: str | None = None) -> VLLMChecker:
        if plant:
            monkeypatch.setenv("LLMFUZZ_VLLM_PLANT", plant)
        chk = VLLMChecker(VLLMRunner(spare=False, log_dir=str(tmp_path / "logs")), transformers=False)
        made.append(chk)
        return chk
    yield make
    for c in made:
        c.close()


def test_clean_hits_equal_the_model_and_the_warm_up_is_start_up(checker):
    chk = checker()
    t = chk.runner
    chk.run(case_of("a"))
    assert t.starts[0]["warmup_s"] > 0 and t.starts[0]["ok"]
    assert t.last_prefix.requests["r0"] == (0, 0, 0)
    chk.run(case_of("a"))
    assert t.last_prefix.requests["r0"] == (32, 32, 32)  # the block the first run left
    chk.run(case_of("b"))
    assert t.last_prefix.requests["r0"] == (0, 0, 0)  # another salt: another block
    chk.run(case_of(None))
    assert t.last_prefix.requests["r0"] == (0, 0, 0)


def test_a_planted_salt_blind_hash_is_caught(checker):
    chk = checker("prefix_hash_ignores_salt")
    chk.run(case_of("a"))
    with pytest.raises(VLLMPrefixCache) as ei:
        chk.run(case_of("b"))
    assert ei.value.signature == "vllm_prefix_cache:above" and "reported 32 cached tokens" in str(ei.value)
