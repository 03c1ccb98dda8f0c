"""llmfuzz: property-based correctness and fuzz testing for LLM inference engines.

The harness, by role (each package's `__init__` says what it exports):
- `fuzz.cases`: the Case (a JSON unit: config, workload, schedule, faults), the Hypothesis
  strategies that draw it and the config limits it reaches; `fuzz.errors`, `fuzz.stop`,
  `fuzz.profiles`: leaves; `fuzz.pytest_plugin`: profiles and markers for pytest.
- `fuzz.verdict`: what decides a verdict (harness, oracles, properties, tolerance, FA invariants).
- `fuzz.targets`: the engines a campaign drives (our reference engine, vLLM).
- `fuzz.campaign`: the time-budgeted campaign, its workers, shrinking and reproducers.
- `fuzz.guard`: the FlashAttention guard loaded into other engines.
- `fuzz.cli`, `fuzz.report`: the `llmfuzz` command and its reports.

Importing `fuzz` imports nothing else, so the guard's start-up hook and the build stay light.
"""
