"""The house's structure, drawn from its imports (ast; function-local imports count).

Layers, lowest first; a module imports only its own layer's or lower ones:
- engine/: imports nothing from the harness; `engine.outputs` holds the data-only contracts
  scheduler and runner both import, and the FA contract is a leaf (torch and the standard
  library only);
- the harness's base: `fuzz.errors`, `fuzz.stop`, `fuzz.profiles` (leaves), `fuzz.cases` (the
  Case, its limits and its strategies, in that order), `fuzz.targets.runs` (data-only: what a
  black-box target returns) and `fuzz.contention` (the load a Case runs under: errors only);
- `fuzz.guard` (the FA guard, loaded into other engines: the contract and itself only) and
  `fuzz.report` (the standard library only; the campaign bins its summary's error/tolerance
  with the report's decades);
- `fuzz.verdict`, then `fuzz.targets`, then `fuzz.campaign`, then `fuzz.mutate` (beside
  `bench/`), then `fuzz.cli` and `bench/`;
- `llmfuzz/`, the public API, on top: it may import anything below; nothing imports it.
No module imports itself back through others."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "fuzz", "bench", "llmfuzz")

# Each layer of the harness and what it may import from engine/, fuzz/ and bench/ (prefixes).
BASE = ("fuzz.errors", "fuzz.stop", "fuzz.profiles", "fuzz.cases", "fuzz.targets.runs", "fuzz.contention")
ALLOWED = {
    "fuzz.errors": (), "fuzz.stop": (), "fuzz.profiles": (),
    "fuzz.pytest_plugin": ("fuzz.profiles",),
    "fuzz.cases": (),
    "fuzz.cases.case": ("engine", "fuzz.errors"),
    "fuzz.cases.limits": ("engine", "fuzz.cases.case"),
    "fuzz.cases.drafting_prompts": (),
    "fuzz.cases.drafting": ("engine", "fuzz.cases.case", "fuzz.cases.drafting_prompts"),
    "fuzz.cases.strategies": ("engine", "fuzz.cases.case", "fuzz.errors", "fuzz.cases.limits", "fuzz.cases.drafting"),
    "fuzz.targets.runs": ("fuzz.cases.case",),
    "fuzz.contention": ("fuzz.contention", "fuzz.errors"),
    "fuzz.guard": ("fuzz.guard", "engine.attention.fa_contract"),
    "fuzz.report": ("fuzz.report",),
    "fuzz.verdict": ("engine", "fuzz.verdict") + BASE,
    "fuzz.targets": ("engine", "fuzz.targets", "fuzz.verdict") + BASE,
    "fuzz.campaign": ("engine", "fuzz.campaign", "fuzz.targets", "fuzz.verdict", "fuzz.guard", "fuzz.report") + BASE,
    "fuzz.mutate": ("engine", "fuzz.mutate", "fuzz.campaign", "fuzz.targets", "fuzz.verdict") + BASE,
    "fuzz.cli": ("engine", "fuzz", "bench"),
    "bench": ("engine", "fuzz", "bench"),
    "llmfuzz": ("engine", "fuzz", "llmfuzz"),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            rel = f.relative_to(ROOT).with_suffix("")
            mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return mods


def _targets(mods: dict, cur: str, node) -> set[str]:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = cur.split(".") if mods[cur].name == "__init__.py" else cur.split(".")[:-1]
            base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]  # `from fuzz import guard`
    out = set()
    for n in names:
        parts = n.split(".")
        for i in range(len(parts), 0, -1):  # the longest module the name starts with
            if ".".join(parts[:i]) in mods:
                out.add(".".join(parts[:i]))
                break
    return out - {cur}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    g = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                g[m] |= _targets(mods, m, node)
    # Importing a.b runs a/__init__ first; that is not an edge of a's design.
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in g.items()}


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    sys.setrecursionlimit(10000)
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _layer(mod: str) -> str | None:
    """The most specific ALLOWED key `mod` falls under."""
    keys = [k for k in ALLOWED if _under(mod, (k,))]
    return max(keys, key=len) if keys else None


def test_the_engine_imports_nothing_from_the_harness() -> None:
    g = _graph()
    bad = sorted((a, b) for a in g for b in g[a] if a.startswith("engine") and not b.startswith("engine"))
    assert not bad, bad


def test_every_harness_module_imports_only_its_layer_or_lower() -> None:
    g = _graph()
    unplaced = sorted(m for m in g if not m.startswith("engine") and m != "fuzz" and _layer(m) is None)
    assert not unplaced, f"modules in no layer: {unplaced}"
    bad = sorted((a, b) for a in g if not a.startswith("engine") and a != "fuzz"
                 for b in g[a] if not _under(b, ALLOWED[_layer(a)]))
    assert not bad, bad


def test_nothing_imports_the_public_api() -> None:
    g = _graph()
    bad = sorted((a, b) for a in g if not _under(a, ("llmfuzz",)) for b in g[a] if _under(b, ("llmfuzz",)))
    assert not bad, bad
    assert _under_all(g["llmfuzz"], ("engine", "fuzz", "llmfuzz"))


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_fa_contract_is_a_leaf() -> None:
    g = _graph()
    contract = [m for m in g if _under(m, ("engine.attention.fa_contract",))]
    assert contract
    for m in contract:
        assert _under_all(g[m], ("engine.attention.fa_contract",)), (m, g[m])


def _under_all(mods, prefixes) -> bool:
    return all(_under(m, prefixes) for m in mods)


def test_importing_the_fa_contract_loads_no_other_engine_module() -> None:
    """In a fresh interpreter: what the FA guard carries into every process it watches."""
    code = ("import sys, engine.attention.fa_contract; "
            "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'fuzz'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    loaded = set(out.split())
    assert loaded - {"engine", "engine.attention"} <= {m for m in _modules() if _under(m, ("engine.attention.fa_contract",))}
