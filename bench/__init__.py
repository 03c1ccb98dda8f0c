"""Benchmarks printing JSON: `cells` (`llmfuzz bench`: examples/s and efficiency per layout ×
mode), `efficiency` (where an example's time goes), `margin` (the logits check's margin), and
the scripts beside them. Results in bench/results/."""


def emit(doc: dict, out: str | None = None) -> int:
    """Print a benchmark's result as JSON (and write it to `out`, its --out file); exit 0."""
    import json

    text = json.dumps(doc, indent=1)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
