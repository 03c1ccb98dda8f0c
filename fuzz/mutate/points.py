"""Mutation points: every first-order mutant of a Python source, found with `ast`.

A point is one operator applied at one node; `points(source, file)` lists them all in a
fixed order (ast.walk's, operators in OPERATORS' order), so a seed samples the same mutants
on every machine. `apply(source, mutant)` replaces the node's text span with its mutated
form (parenthesized), leaving every other byte of the file as it was; the result is parsed
again, so a mutant that would not compile is never produced.

Operators (docs/mutate.md): comparison flips (< <=, > >=, == !=), off-by-one on arithmetic
(e -> (e + 1), (e - 1)), small-constant bumps (an int literal k -> k+1, k-1), and/or swap,
a dropped `not`, min <-> max, a dropped statement in a function body (an expression,
assignment or augmented assignment replaced by `pass`), and swapped call arguments.
"""
from __future__ import annotations

import ast
import copy
import re
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
_ARITH = (ast.Add, ast.Sub, ast.FloorDiv, ast.Mod)  # integer arithmetic, in practice
SMALL = 64  # int literals up to this size are "small constants" worth a bump


@dataclass(frozen=True)
class Mutant:
    file: str  # relative to the target's source root, '/'-separated
    line: int
    col: int
    end_line: int
    end_col: int
    operator: str
    original: str  # ast.unparse of the node before
    mutated: str  # ast.unparse of the node after

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.col}:{self.operator}:{self.mutated}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Mutant":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


Pos = tuple[int, int]  # (1-based line, UTF-8 byte column), as ast reports positions
Edit = tuple[Pos, Pos, str]  # replace the text between two positions


def _span(n: ast.AST) -> tuple[Pos, Pos]:
    return (n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)


def _int_const(n: ast.AST) -> bool:
    return isinstance(n, ast.Constant) and type(n.value) is int


_OP_TEXT = {ast.Lt: r"<(?!=)", ast.LtE: r"<=", ast.Gt: r">(?!=)", ast.GtE: r">=", ast.Eq: r"==", ast.NotEq: r"!="}
_OP_STR = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


def _in_gap(src: "Source", a: ast.AST, b: ast.AST, pattern: str, text: str) -> list[Edit]:
    """Replace the first match of `pattern` between nodes a and b (an operator token)."""
    start, end = _span(a)[1], _span(b)[0]
    gap = src.text(start, end)
    m = re.search(pattern, gap)
    if m is None:
        return []
    return [(src.advance(start, gap[:m.start()]), src.advance(start, gap[:m.end()]), text)]


def _cmp_flip(n: ast.AST, src) -> Iterator[tuple[ast.AST, list[Edit]]]:
    if isinstance(n, ast.Compare):
        operands = [n.left, *n.comparators]
        for i, op in enumerate(n.ops):
            if type(op) in _FLIP:
                m = copy.deepcopy(n)
                m.ops[i] = _FLIP[type(op)]()
                yield m, _in_gap(src, operands[i], operands[i + 1], _OP_TEXT[type(op)], _OP_STR[_FLIP[type(op)]])


def _off_by_one(n: ast.AST, src) -> Iterator[tuple[ast.AST, list[Edit]]]:
    if isinstance(n, ast.BinOp) and isinstance(n.op, _ARITH):
        a, b = _span(n)
        for op, sign in ((ast.Add(), "+"), (ast.Sub(), "-")):
            yield ast.BinOp(copy.deepcopy(n), op, ast.Constant(1)), [(a, a, "("), (b, b, f" {sign} 1)")]


def _const_bump(n: ast.AST, src) -> Iterator[tuple[ast.AST, list[Edit]]]:
    if _int_const(n) and abs(n.value) <= SMALL:
        bumps = (n.value + 1, n.value - 1) if n.value > 0 else (n.value + 1,)  # -k is -(k): k never below 0
        for v in bumps:
            yield ast.Constant(v), [(*_span(n), str(v))]


def _boolop_swap(n: ast.AST, src) -> Iterator[tuple[ast.AST, list[Edit]]]:
    if isinstance(n, ast.BoolOp):
        old, new = ("and", "or") if isinstance(n.op, ast.And) else ("or", "and")
        edits = [e for a, b in zip(n.values, n.values[1:]) for e in _in_gap(src, a, b, rf"\b{old}\b", new)]
        yield ast.BoolOp(ast.Or() if old == "and" else ast.And(), copy.deepcopy(n.values)), edits


def _drop_not(n: ast.AST, src) -> Iterator[tuple[ast.AST, list[Edit]]]:
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
        yield copy.deepcopy(n.operand), [(*_span(n), f"({src.text(*_span(n.operand))})")]


def _min_max(n: ast.AST, src) -> Iterator[tuple[ast.AST, list[Edit]]]:
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("min", "max"):
        m = copy.deepcopy(n)
        m.func.id = "max" if n.func.id == "min" else "min"
        yield m, [(*_span(n.func), m.func.id)]


def _drop_stmt(n: ast.AST, src) -> Iterator[tuple[ast.AST, list[Edit]]]:
    # Marked by `_mark`: only statements of function bodies (bookkeeping), never a docstring
    # (an expression statement that is a string constant).
    if getattr(n, "_in_function", False) and isinstance(n, (ast.Expr, ast.Assign, ast.AugAssign)):
        if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)):
            yield ast.Pass(), [(*_span(n), "pass")]


def _swap_args(n: ast.AST, src) -> Iterator[tuple[ast.AST, list[Edit]]]:
    if isinstance(n, ast.Call) and not any(isinstance(a, ast.Starred) for a in n.args):
        for i in range(len(n.args) - 1):
            a, b = n.args[i], n.args[i + 1]
            if ast.dump(a) != ast.dump(b):  # equal arguments: no mutant
                m = copy.deepcopy(n)
                m.args[i], m.args[i + 1] = m.args[i + 1], m.args[i]
                yield m, [(*_span(a), src.text(*_span(b))), (*_span(b), src.text(*_span(a)))]


OPERATORS: dict[str, Callable] = {
    "cmp_flip": _cmp_flip, "off_by_one": _off_by_one, "const_bump": _const_bump, "boolop_swap": _boolop_swap,
    "drop_not": _drop_not, "min_max": _min_max, "drop_stmt": _drop_stmt, "swap_args": _swap_args,
}


def _mark(tree: ast.Module) -> set[int]:
    """Flag the statements inside function bodies (`_in_function`), and return the ids of
    nodes never mutated: f-strings (their format specs hold literal text) and annotations."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.stmt) and sub is not node:
                    sub._in_function = True
            for a in (*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs):
                if a.annotation is not None:
                    skip |= {id(x) for x in ast.walk(a.annotation)}
            if node.returns is not None:
                skip |= {id(x) for x in ast.walk(node.returns)}
        elif isinstance(node, ast.JoinedStr):
            skip |= {id(x) for x in ast.walk(node)}
        elif isinstance(node, ast.AnnAssign):
            skip |= {id(x) for x in ast.walk(node.annotation)}
    return skip


class Source:
    """A file's text, addressed by ast positions (UTF-8 byte columns)."""

    def __init__(self, text: str) -> None:
        self.src = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for ln in self.lines:
            self.starts.append(self.starts[-1] + len(ln))

    def offset(self, p: Pos) -> int:
        line = self.lines[p[0] - 1] if p[0] - 1 < len(self.lines) else ""
        return self.starts[p[0] - 1] + len(line.encode()[:p[1]].decode())

    def text(self, a: Pos, b: Pos) -> str:
        return self.src[self.offset(a):self.offset(b)]

    def advance(self, p: Pos, text: str) -> Pos:
        """The position `text` (which starts at `p`) ends at."""
        parts = text.split("\n")
        if len(parts) == 1:
            return p[0], p[1] + len(text.encode())
        return p[0] + len(parts) - 1, len(parts[-1].encode())


def _walk(source: str, operators: tuple[str, ...]):
    """(operator, node, new node, edits) for every point, in a fixed order; and the tree."""
    tree = ast.parse(source)
    skip, src = _mark(tree), Source(source)
    out = []
    for name in operators:
        for node in ast.walk(tree):
            if id(node) in skip or not hasattr(node, "end_col_offset"):
                continue
            for new, edits in OPERATORS[name](node, src):
                if edits:  # an operator token not found in the text (never seen): no point
                    out.append((name, node, new, edits))
    return out, tree


def points(source: str, file: str, operators: tuple[str, ...] = tuple(OPERATORS)) -> list[Mutant]:
    """Every mutant of `source` (named `file`) by `operators`, in a fixed order."""
    return [Mutant(file, node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, name,
                   ast.unparse(node), ast.unparse(new)) for name, node, new, _ in _walk(source, operators)[0]]


class MutationError(ValueError):
    """The mutant does not fit the source (another version of the file) or does not compile."""


def _replace(tree: ast.Module, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for fname, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, fname, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                value[[i for i, v in enumerate(value) if v is old][0]] = new
                return
    raise MutationError("the node to mutate is not in the tree")


def apply(source: str, m: Mutant) -> str:
    """`source` with `m` applied: small text edits at the node (the rest of the file byte
    for byte as it was), checked to parse to exactly the mutated tree."""
    found, tree = _walk(source, (m.operator,))
    hit = [(node, new, edits) for _, node, new, edits in found
           if (node.lineno, node.col_offset, ast.unparse(new)) == (m.line, m.col, m.mutated)]
    if not hit or ast.unparse(hit[0][0]) != m.original:
        raise MutationError(f"{m.file}:{m.line}: no {m.operator} point {m.original!r} -> {m.mutated!r} there")
    node, new, edits = hit[0]
    src, out = Source(source), source
    for a, b, text in sorted(edits, key=lambda e: src.offset(e[0]), reverse=True):
        out = out[:src.offset(a)] + text + out[src.offset(b):]
    _replace(tree, node, new)
    try:
        got = ast.parse(out)
    except SyntaxError as e:
        raise MutationError(f"{m.file}:{m.line}: the mutant does not parse ({e.msg})") from None
    if ast.dump(got) != ast.dump(ast.parse(ast.unparse(tree))):
        raise MutationError(f"{m.file}:{m.line}: the edited text is not the mutated tree")
    return out
