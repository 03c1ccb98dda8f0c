#!/usr/bin/env python3
"""Write a transformers-cb reproducer as what scripts/cb_greedy_check.py reads: the model the
harness loads for it and its Case's requests and config, outside llmfuzz.

    PYTHONPATH=. python3 scripts/tcb_export.py REPRODUCER.json OUTDIR

OUTDIR/model/: the Hugging Face checkpoint (config.json + model.safetensors) the harness's
worker loads for the Case, copied from llmfuzz's checkpoint cache
(fuzz.targets.checkpoint.checkpoint_dir, which writes the seeded weights there first if
needed), so both run the very same tensors. OUTDIR/case.json: the requests (ids r0, r1, ...
as the harness names them, prompt token ids, max_tokens, arrival_step), the attention
implementation, dtype and device the worker loads the model with (configs.process_spec),
the ContinuousBatchingConfig arguments it builds (configs.cb_config), and the reproducer's
property and message. Prints OUTDIR/case.json's path."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys


def export(repro_path: str, out_dir: str) -> str:
    from fuzz.campaign.reproduce import load_reproducer
    from fuzz.targets.checkpoint import checkpoint_dir
    from fuzz.targets.runs import request_items
    from fuzz.targets.transformers_cb.configs import TARGET, CBOptions, cb_config, cell_name, process_spec

    repro = load_reproducer(repro_path)
    case = repro.case
    if case.target != TARGET:
        raise SystemExit(f"{repro_path}: a {case.target!r} reproducer, not a {TARGET} one")
    opts = CBOptions.of(case)
    items = request_items(case)
    for rid, r in items:
        if r.sampling is not None or r.abort_step is not None:
            raise SystemExit(f"{repro_path}: request {rid} samples or aborts; the {TARGET} target runs greedy requests only")
    src = checkpoint_dir(case.config)
    model_dir = os.path.join(out_dir, "model")
    os.makedirs(model_dir, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if name == "config.json" or name.endswith(".safetensors"):
            shutil.copyfile(os.path.join(src, name), os.path.join(model_dir, name))
    spec = process_spec(case.config, opts, model_dir)
    doc = {"source": os.path.relpath(repro_path), "property": repro.property, "message": repro.message,
           "cell": cell_name(case.config, opts),
           "recorded": {k: (repro.meta or {}).get(k) for k in ("transformers_version", "torch_version", "device")},
           "attn": spec["attn"], "dtype": spec["dtype"], "device": spec["device"], "cb": cb_config(case.config, opts),
           "requests": [{"id": rid, "prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens,
                         "arrival_step": r.arrival_step} for rid, r in items]}
    path = os.path.join(out_dir, "case.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reproducer")
    p.add_argument("out_dir")
    a = p.parse_args(argv)
    print(export(a.reproducer, a.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
