"""An IsolatedHarness child whose engine hits a real device-side assert (a fatal CUDA error)
when a Case's first prompt starts with token 127: the way a bad index kills a context."""
import torch

import engine.llm_engine as llm_engine
from fuzz.verdict import isolated

_step = llm_engine.LLMEngine.step


def step(self):
    if any(r.all_token_ids[:1] == [127] for r in self.scheduler.requests.values()):
        torch.zeros(4, device="cuda")[torch.tensor([1 << 30], device="cuda")].item()
    return _step(self)


llm_engine.LLMEngine.step = step
isolated.main()
