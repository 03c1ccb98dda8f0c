"""`llmfuzz`: run a campaign, replay or minimize a reproducer, list faults, generate a demo.

Exit codes: 0 nothing failed (or a replayed case passes now), 1 a failure was found /
reproduces as recorded, 2 bad input (one line on stderr naming the problem, before any rank
starts), 3 a failure was found but its reproducer could not be written (the Case JSON went
to stderr), 4 a replayed or minimized reproducer fails, but with another violation than the
one it records (another property or kind of message), 130 interrupted before a campaign
could summarise, or a selftest stopped at any point (it prints the faults run so far). A
campaign interrupted by SIGINT or SIGTERM prints its summary so far and exits 0 or 1 as above.
Torch is imported only by the commands that need it, so `llmfuzz --help` starts fast.
"""
from __future__ import annotations

import argparse
import json
import sys

from fuzz.errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNWRITTEN, BadInput
from fuzz.cli.common import base_config as _base_config
from fuzz.cli.common import base_configs as _base_configs
from fuzz.cli.common import load_profile as _load_profile
from fuzz.cli.common import oracles as _oracles
from fuzz.cli.common import poison as _poison
from fuzz.cli.faults import cmd_faults, cmd_selftest
from fuzz.cli.common import parse_layouts as _parse_layouts
from fuzz.cli.replay import cmd_minimize, cmd_replay
from fuzz.stop import (clear_stop, exit_past_stuck_ranks, is_main_thread, stop_after_command, stop_requested,
                       terminate_as_interrupt)  # `replay` and `minimize`


TARGETS = ("reference", "vllm", "transformers-cb")
VLLM_ONLY = ("configs", "cells", "exclude", "known", "include_known")


def cmd_run(args) -> int:
    from fuzz.campaign.jobs import parse_jobs
    from fuzz.campaign.jobs_worker import worker_args
    from fuzz.contention.command import checked, held

    args, share = worker_args(args)  # a worker of `run --jobs N`: its part of the campaign (else None)
    if args.target not in TARGETS:
        raise BadInput(f"--target: unknown target {args.target!r} (known: {', '.join(TARGETS)})")
    # The parent holds the load for the whole campaign; its workers only record it (never passed on).
    profile = checked(getattr(args, "contention", None), allow_draw=True, device=args.device)
    jobs = parse_jobs(args)  # None: the default, once the cells are known
    if profile is not None and getattr(args, "cluster", None) is not None:
        raise BadInput("--contention: loads this machine only, not a Ray cluster's nodes; run each node's own")
    if profile == "draw":
        if jobs not in (None, 1):
            raise BadInput("--contention draw: a level per cell needs the cells in one process: --jobs 1")
        args.jobs, jobs = "1", 1
    with held(profile, device=args.device, seed=args.seed):
        return _cmd_run(args, share, jobs)


def _cmd_run(args, share, jobs) -> int:
    from fuzz.campaign.jobs_worker import Share
    from fuzz.campaign.shard import parse_shard, shard_part

    shard = parse_shard(getattr(args, "shard", None))  # fuzz/campaign/shard.py
    if args.target == "vllm":  # fuzz/cli/vllm.py; docs/vllm.md
        return _run_vllm(args, shard)
    if args.target == "transformers-cb":  # fuzz/cli/transformers_cb.py
        if shard is not None or getattr(args, "cluster", None) is not None:
            raise BadInput("--shard/--cluster: not yet for --target transformers-cb (one machine, one process)")
        from fuzz.cli.transformers_cb import cmd_run as run_cb

        return run_cb(args)
    for opt in VLLM_ONLY:
        if getattr(args, opt) is not None:
            raise BadInput(f"--{opt.replace('_', '-')}: applies to --target vllm only")
    from fuzz.campaign.cluster import parse_cluster
    from fuzz.campaign.jobs_gpus import check_gpu_count
    from fuzz.campaign.loop import Campaign

    bases = _base_configs(args)  # one per attention kernel: cells of the campaign (fuzz/targets/kernels.py)
    base = bases[0]
    layouts, modes = _run_cells(args, base)
    profile = _load_profile(args.profile)
    oracles = _oracles(args)
    poison, _ = _poison(args), _shrink_budget(args)  # bad input is found before any worker starts
    cluster = parse_cluster(getattr(args, "cluster", None))  # Ray's address; None: this machine
    check_gpu_count(base.device, layouts, args.world)  # --world torch on CUDA: a GPU a rank, any --jobs
    cells_total = len(layouts) * len(bases)
    if shard is not None:  # its part of the layouts; chunk sizes and seeds stay the whole campaign's
        shard = shard_part(shard, layouts)
        layouts = shard.part["layouts"]
    code = _spread(args, cluster, jobs, layouts, bases, modes, shard, cells_total)
    if code is not None:
        return code
    if shard is not None and share is None:
        share = Share(cells_total, shard.part["stream"], shard.part["streams"])
    target = _kernel_cells(bases, layouts, modes, args, oracles)
    camp = Campaign(target=target, oracles=oracles, isolate=args.isolate, poison=poison, share=share,
                    use_database=profile in ("nightly", "repro"), layouts=layouts, modes=modes,
                    faults=tuple(args.fault), seed=args.seed,
                    out_dir=args.out or "reproducers", budget_s=args.budget, shrink_budget_s=_shrink_budget(args),
                    stop_on_failure=bool(args.fault) and not args.keep_going,
                    progress=not args.json and not args.quiet, base=base)
    try:
        summary = camp.run()  # closes the harness it made (not a kernel-cells target's)
    finally:
        if target is not None:
            target.close()
    summary.shard = shard
    if share is not None and share.report_path is not None:
        share.report(summary, camp.shrink_report)  # for the parent to merge
    return _report(args, summary, camp.shrink_report)


def _report(args, summary, shrink_report) -> int:
    """Print a reference campaign's summary (JSON or text); its exit code."""
    from fuzz.campaign.findings import run_json, run_text

    print(json.dumps(run_json(summary, shrink_report), indent=1) if args.json else run_text(summary, shrink_report))
    if summary.write_errors:
        return EXIT_UNWRITTEN
    return EXIT_FAIL if summary.failures else EXIT_OK


def _run_vllm(args, shard) -> int:
    if getattr(args, "cluster", None) is not None:
        raise BadInput("--cluster: the vllm target runs its configs one after another in one process; "
                       "split it over machines with --shard K/N")
    if args.fault:
        raise BadInput("--fault: registry faults exist in the reference engine only, not with --target vllm")
    from fuzz.cli.vllm import _cmd_run as run_vllm

    return run_vllm(args, shard)


def _spread(args, cluster, jobs, layouts, bases, modes, shard, cells_total) -> int | None:
    """The campaign (a shard's part, with `shard`) in Ray tasks (`cluster`: one per layout
    unless --jobs says) or in `--jobs` worker processes; its exit code. None: one worker, this
    process runs it."""
    from fuzz.campaign.cluster import run_cluster
    from fuzz.campaign.jobs import default_jobs, run_jobs

    part = shard.part if shard is not None else None
    if cluster is not None:  # fuzz/campaign/cluster.py
        return run_cluster(args, cluster, jobs or len(layouts), layouts, bases, shard, part, cells_total)
    jobs = jobs or default_jobs(bases[0].device, layouts, args.world)
    if jobs > 1:  # fuzz/campaign/jobs.py
        return run_jobs(args, jobs, layouts, bases, modes, shard, part, cells_total)
    return None


def _run_cells(args, base) -> tuple[list[str], list[str]]:
    """`run`'s layouts and modes, checked with its faults and budget."""
    from engine.faults import FAULTS
    from fuzz.cases.strategies import CAMPAIGN_ORDER, IMPLEMENTED_MODES

    layouts = _parse_layouts(args.layouts, base) if args.layouts else list(CAMPAIGN_ORDER)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in IMPLEMENTED_MODES:
            raise BadInput(f"--modes: {m!r} is not one of {', '.join(IMPLEMENTED_MODES)}")
    for f in args.fault:
        if f not in FAULTS:
            raise BadInput(f"--fault: unknown fault {f!r} (see `llmfuzz faults`)")
    if not 0 < args.budget < float("inf"):
        raise BadInput(f"--budget: {args.budget} is not a positive number of seconds")
    return layouts, modes


def _shrink_budget(args) -> float | None:
    """--shrink-budget: seconds for the shrink phase after the budget (None: its default)."""
    if args.shrink_budget is not None and not 0 <= args.shrink_budget < float("inf"):
        raise BadInput(f"--shrink-budget: {args.shrink_budget} is not a number of seconds >= 0")
    return args.shrink_budget


def _kernel_cells(bases, layouts, modes, args, oracles):
    """On CUDA every kernel is a cell and the summary names it (fuzz/targets/kernels.py); None:
    the Campaign's own target (the CPU, one reference kernel)."""
    if bases[0].device == "cpu":
        return None
    from fuzz.verdict.engine_pool import pool_capacity_for
    from fuzz.verdict.isolated import make_harness
    from fuzz.targets.kernels import KernelCells

    harness = make_harness(bases[0].device, args.isolate,
                           pool_capacity_for(len(layouts) * len(bases), len(modes)), oracles)
    return KernelCells(harness, layouts, modes, tuple(args.fault), bases)


def cmd_generate(args) -> int:
    """Run one demo workload and print what it generated (a smoke test of the engine)."""
    import time

    from engine.llm_engine import LLMEngine
    from fuzz.cases.strategies import FUZZ_MODEL, tokens_from_seed

    cfg = FUZZ_MODEL.replace(layout=args.layout) if args.layout else FUZZ_MODEL
    eng = LLMEngine(cfg)
    for i in range(args.requests):
        eng.add_request(f"r{i}", list(tokens_from_seed(i, 3 + 5 * i % 40, cfg.vocab_size)), 8)
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    dt = time.perf_counter() - t0
    eng.shutdown()
    out = {"layout": cfg.layout, "steps": eng.trace.num_steps, "seconds": round(dt, 3),
           "outputs": eng.trace.output_token_ids()}
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return EXIT_OK


def _option_parents() -> dict[str, argparse.ArgumentParser]:
    """Options several commands share, each declared once (argparse parent parsers):
    `isolate` (run, replay, minimize, selftest), `engine` (run, selftest: the model's device,
    world, dtype and attention backend), `fuzz_oracles` (run, selftest: oracles on every Case),
    `check_oracles` (replay, minimize: oracles a reproducer is checked with)."""
    isolate = argparse.ArgumentParser(add_help=False)
    isolate.add_argument("--isolate", default="auto", choices=("auto", "on", "off"),
                         help="run Cases in a worker process that is replaced after a fatal error "
                              "(auto: on for CUDA devices)")
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--world", default="inproc", choices=("inproc", "torch"))
    engine.add_argument("--dtype", default=None, help="model dtype: float32, bfloat16, float16 (default: float32 "
                        "on the CPU, bfloat16 on CUDA unless --attention-backend reference)")
    engine.add_argument("--attention-backend", default=None,
                        help="reference (the CPU default), torch_flash (PyTorch's FlashAttention-2 kernel, CUDA), "
                             "flash_attn (flash-attn-4's flash_attn.cute, or FlashAttention-2); `run` takes a comma "
                             "list, each kernel a cell (default on CUDA: torch_flash, plus flash_attn if importable)")
    fuzz_oracles = argparse.ArgumentParser(add_help=False)
    fuzz_oracles.add_argument("--oracle", default=None,
                              help="oracles that check every Case: reference, solo, transformers, determinism, all "
                                   "(default: reference and solo always, transformers and determinism sampled)")
    check_oracles = argparse.ArgumentParser(add_help=False)
    check_oracles.add_argument("--oracle", default=None, help="oracles to check (default: all)")
    check_oracles.add_argument("--contention", default=None,
                               help="the load to replay under (default: the one the reproducer recorded; none: "
                                    "without): cpu[:N], gpu[:N], both[:N] or a comma list (docs/contention.md)")
    check_oracles.add_argument("--replays", type=int, default=None,
                               help="replays of the Case, reported as a rate (default: 8 under contention, else 1)")
    return {"isolate": isolate, "engine": engine, "fuzz_oracles": fuzz_oracles, "check_oracles": check_oracles}


def _add_run_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("run", help="fuzz for a time budget", parents=parents)
    r.add_argument("--budget", type=float, default=60.0, help="seconds (default 60)")
    r.add_argument("--layouts", default="", help="comma list, e.g. tp1pp1,tp2pp4,pp8 (default: all)")
    r.add_argument("--modes", default="eager,graph", help="comma list of modes (default eager,graph)")
    r.add_argument("--fault", action="append", default=[], help="switch a registry fault on (repeatable)")
    r.add_argument("--keep-going", action="store_true",
                   help="with --fault, keep fuzzing after the first failure (default: stop)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--poison", default="both", help="what resets leave in memory: nan, stale (finite values of "
                   "earlier batches, as GPU memory holds) or both (default: each Case draws one)")
    r.add_argument("--out", default=None, help="reproducer directory (default reproducers/; reproducers/vllm "
                   "with --target vllm)")
    r.add_argument("--profile", default=None, help="Hypothesis profile: dev, ci, nightly, repro")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--jobs", default=None, help="worker processes, each fuzzing its share of the layouts "
                   "(default: the cores available, counting --world torch's rank processes, at most one per "
                   "layout; on CUDA the GPUs are shared, as many workers on each as its free memory holds; "
                   "1: in this process)")
    r.add_argument("--shard", default=None, help="K/N: run shard K of a campaign split over N machines (each "
                   "its share of the layouts, or of a layout's chunks); `llmfuzz merge` joins their --json summaries")
    r.add_argument("--cluster", default=None, help="ray or ray://HOST:PORT: run the --jobs workers (default: one per "
                   "layout) as Ray tasks on a Ray cluster (pip install 'llmfuzz[cluster]'); reproducers come back here")
    r.add_argument("--worker-plan", default=None, help=argparse.SUPPRESS)  # a --jobs worker (fuzz/campaign/jobs_worker.py)
    r.add_argument("--contention", default=None, help="what runs beside the campaign, for the whole run: none, "
                   "cpu[:N] (busy cores), gpu[:N] (co-processes bursting on the GPU), both[:N], a comma list "
                   "(gpu:3,cpu:6), or draw (a level per cell); recorded in every reproducer (docs/contention.md)")
    r.add_argument("--target", default="reference",
                   help="engine to fuzz: reference (default: our engine, white-box), vllm (a real vLLM, docs/vllm.md) "
                   "or transformers-cb (transformers' continuous batching, docs/transformers_cb.md)")
    from fuzz.cli.vllm import add_vllm_run_options

    add_vllm_run_options(r, standalone=False)
    r.set_defaults(fn=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmfuzz", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    shared = _option_parents()
    fuzzing = [shared["engine"], shared["fuzz_oracles"], shared["isolate"]]  # run, selftest
    checking = [shared["check_oracles"], shared["isolate"]]  # replay, minimize
    _add_run_parser(sub, fuzzing)
    rp = sub.add_parser("replay", help="re-run a reproducer: exit 1 if it fails as recorded, 4 if with another "
                        "violation, 0 if it passes", parents=checking)
    rp.add_argument("file")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(fn=cmd_replay)
    mn = sub.add_parser("minimize", help="shrink a reproducer's Case further", parents=checking)
    mn.add_argument("file")
    mn.add_argument("--out", default="reproducers")
    mn.set_defaults(fn=cmd_minimize)
    f = sub.add_parser("faults", help="list the fault registry")
    f.add_argument("--json", action="store_true")
    f.set_defaults(fn=cmd_faults)
    st = sub.add_parser("selftest", help="fuzz with each registry fault on; exit 0 only if all are caught",
                        parents=fuzzing)
    st.add_argument("--budget-per-fault", type=float, default=60.0)
    st.add_argument("--fault", action="append", default=[], help="only these faults (repeatable)")
    st.add_argument("--out", default="reproducers/faults")
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--poison", default="both", help="nan, stale or both (default: each Case draws one)")
    st.add_argument("--profile", default=None)
    st.add_argument("--contention", default=None, help="the load every fault is fuzzed under: cpu[:N], gpu[:N], "
                    "both[:N] or a comma list (docs/contention.md)")
    st.add_argument("--everywhere", action="store_true",
                    help="switch each fault on in every run the harness makes (reference included), as a "
                         "real bug in shared code would be; only independent oracles can then see it")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_selftest)
    g = sub.add_parser("generate", help="run a demo workload on the reference engine")
    g.add_argument("--layout", default="")
    g.add_argument("--requests", type=int, default=8)
    g.add_argument("--json", action="store_true")
    g.set_defaults(fn=cmd_generate)
    from fuzz.guard.dump import add_check_fa_parser

    add_check_fa_parser(sub)
    from bench.cells import add_bench_parser

    add_bench_parser(sub)
    from fuzz.report.render import add_report_parser

    add_report_parser(sub)
    from fuzz.cli.merge import add_merge_parser

    add_merge_parser(sub)
    from fuzz.cli.vllm import add_vllm_parser

    add_vllm_parser(sub, replay=cmd_replay)
    from fuzz.mutate.cli import add_mutate_parser

    add_mutate_parser(sub)
    return p


def main(argv: list[str] | None = None, *, restore_signals: bool = True) -> int:
    """Run one command. `restore_signals`: put the SIGINT/SIGTERM handlers back as they were
    when done (main() called in-process, by tests); the `llmfuzz` command keeps a handler
    that only sets the stop flag until it exits (`stop_after_command`)."""
    import signal

    args = build_parser().parse_args(argv)
    saved = {}
    if is_main_thread():
        # SIGINT too: the default handler's KeyboardInterrupt alone could be swallowed by a gc
        # callback (Hypothesis 6.170) and not stop the campaign; ours also sets a stop flag.
        for sig in (signal.SIGTERM, signal.SIGINT):
            saved[sig] = signal.signal(sig, terminate_as_interrupt)
    clear_stop()  # a stop belongs to the command it interrupted (tests call main() in-process)
    try:
        try:
            with _reports_to_stderr():
                return args.fn(args)
        except BadInput as e:
            print(f"llmfuzz: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:
            print("llmfuzz: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as e:
            if not stop_requested():
                raise
            # An interrupt that landed inside a library can surface as another error.
            print(f"llmfuzz: interrupted ({type(e).__name__} while stopping)", file=sys.stderr)
            return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # a second signal while the first was being reported
        return EXIT_INTERRUPTED
    finally:
        for sig, handler in saved.items():  # main() called in-process (tests) leaves no trace
            if not restore_signals:
                handler = stop_after_command
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _reports_to_stderr():
    """Hypothesis' own reports (a slow shrink's warning, say) go to stderr: stdout is the
    command's output, one JSON document with --json (a warning printed there broke it)."""
    from hypothesis.reporting import with_reporter

    return with_reporter(lambda text: print(text, file=sys.stderr))


def console_main() -> int:
    """The `llmfuzz` command (and `python -m fuzz.cli`): `main`, then a process exit that a
    stuck rank cannot abort. A signal at any point ends it with a code: 130 if main had none."""
    try:
        code = main(restore_signals=False)
    except KeyboardInterrupt:  # before main's handlers were installed, or while it put them back
        code = EXIT_INTERRUPTED
    exit_past_stuck_ranks(code)
    return code


if __name__ == "__main__":
    sys.exit(console_main())
