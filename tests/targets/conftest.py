"""tests/targets: real engines as targets. Tests that need vLLM skip without it."""


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM installed (scripts/setup_vllm_cpu.sh); skips cleanly without it")
