"""Mutants of a Python module, made on its AST.

Operators (each mutation point gives one mutant per replacement):

* ``cmp_flip``      a comparison negated: ``<``↔``>=``, ``<=``↔``>``, ``==``↔``!=``,
                    ``is``↔``is not``, ``in``↔``not in``
* ``cmp_boundary``  off by one in a comparison: ``<``↔``<=``, ``>``↔``>=``
* ``negate``        the test of ``if`` / ``while`` / ``x if t else y`` / ``assert``
                    negated; ``not x`` → ``x``
* ``and_or``        ``and``↔``or``
* ``arith``         ``+``↔``-``
* ``const``         an int constant ``c`` → ``c + 1`` and ``c - 1``; ``True``↔``False``
* ``delete``        a statement (assignment, expression, ``raise``, ``continue``,
                    ``break``) replaced by ``pass``
* ``return_none``   ``return expr`` → ``return None``

Not mutated: docstrings and other string constants (message wording is not a specified
behaviour beyond what the tests pin), annotations, ``__all__`` / ``__slots__``, imports.
Mutants are numbered in a fixed order (source order, then operator), so a mutant id
``path:line:col:operator:k`` names the same mutant on every run of the same source.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from dataclasses import dataclass

CMP_FLIP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.LtE: ast.Gt, ast.Gt: ast.LtE,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
}
CMP_BOUNDARY: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
}
DELETABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Raise, ast.Continue,
             ast.Break)


@dataclass(frozen=True)
class Mutant:
    """One mutation: where, which operator, and the mutated module source."""

    path: str
    line: int
    col: int
    operator: str
    index: int  # k-th replacement at this point
    description: str
    source: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}:{self.col}:{self.operator}:{self.index}"


@dataclass(frozen=True)
class _Point:
    node_number: int  # the node's position in ast.walk order of a fresh parse
    operator: str
    index: int
    line: int
    col: int
    description: str


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes that are never mutated: docstrings, annotations, imports, __all__."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                mark(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
            for arg in (*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs,
                        node.args.vararg, node.args.kwarg):
                if arg is not None:
                    mark(arg.annotation)
        if isinstance(node, ast.AnnAssign):
            mark(node.annotation)
            if node.value is None:
                mark(node)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mark(node)
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id in ("__all__", "__slots__") for t in node.targets):
            mark(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
                and node.test.id == "TYPE_CHECKING":
            mark(node)
        if isinstance(node, ast.JoinedStr):  # f-strings: message wording
            mark(node)
    return skip


def _points(node: ast.AST) -> Iterator[tuple[str, int, str]]:
    """(operator, index, description) for every mutation of ``node`` itself."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            name = type(op).__name__
            if type(op) in CMP_FLIP:
                yield "cmp_flip", i, f"{name} -> {CMP_FLIP[type(op)].__name__}"
            if type(op) in CMP_BOUNDARY:
                yield "cmp_boundary", i, f"{name} -> {CMP_BOUNDARY[type(op)].__name__}"
    elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
        yield "negate", 0, "test negated"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "negate", 0, "'not' removed"
    elif isinstance(node, ast.BoolOp):
        other = "Or" if isinstance(node.op, ast.And) else "And"
        yield "and_or", 0, f"{type(node.op).__name__} -> {other}"
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        other = "Sub" if isinstance(node.op, ast.Add) else "Add"
        yield "arith", 0, f"{type(node.op).__name__} -> {other}"
    elif isinstance(node, ast.Constant):
        if isinstance(node.value, bool):
            yield "const", 0, f"{node.value} -> {not node.value}"
        elif isinstance(node.value, int):
            yield "const", 0, f"{node.value} -> {node.value + 1}"
            yield "const", 1, f"{node.value} -> {node.value - 1}"
    elif isinstance(node, ast.Return) and node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None):
        yield "return_none", 0, "return value -> None"
    if isinstance(node, DELETABLE):
        yield "delete", 0, f"{type(node).__name__} statement deleted"


def _apply(node: ast.AST, operator: str, index: int) -> ast.AST:
    """The replacement of ``node`` (mutated in place where possible)."""
    if operator == "cmp_flip":
        node.ops[index] = CMP_FLIP[type(node.ops[index])]()  # type: ignore[attr-defined]  # a Compare
    elif operator == "cmp_boundary":
        node.ops[index] = CMP_BOUNDARY[type(node.ops[index])]()  # type: ignore[attr-defined]  # a Compare
    elif operator == "negate":
        if isinstance(node, ast.UnaryOp):
            return node.operand
        node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)  # type: ignore[attr-defined]  # If/While/IfExp/Assert
    elif operator == "and_or":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()  # type: ignore[attr-defined]  # a BoolOp
    elif operator == "arith":
        node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()  # type: ignore[attr-defined]  # a BinOp
    elif operator == "const":
        value = node.value  # type: ignore[attr-defined]  # a Constant
        node.value = (not value) if isinstance(value, bool) else value + (1 if index == 0 else -1)  # type: ignore[attr-defined]  # a Constant
    elif operator == "return_none":
        node.value = ast.Constant(value=None)  # type: ignore[attr-defined]  # a Return
    elif operator == "delete":
        return ast.Pass()
    return node


class _Replace(ast.NodeTransformer):
    def __init__(self, target: int, operator: str, index: int) -> None:
        self.target, self.operator, self.index, self.count = target, operator, index, -1
        self.done = False

    def visit(self, node: ast.AST) -> ast.AST:
        self.count += 1
        if self.count == self.target:
            self.done = True
            return _apply(node, self.operator, self.index)
        return super().visit(node)  # type: ignore[no-any-return]  # NodeTransformer.visit


def _numbered(tree: ast.AST) -> list[ast.AST]:
    """Nodes in the pre-order that :class:`_Replace` visits them in."""
    order: list[ast.AST] = []

    def walk(node: ast.AST) -> None:
        order.append(node)
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(tree)
    return order


def mutants(source: str, path: str) -> list[Mutant]:
    """Every mutant of ``source`` (the module at ``path``), in a fixed order."""
    tree = ast.parse(source)
    skip = _skipped_nodes(tree)
    points = []
    for number, node in enumerate(_numbered(tree)):
        if id(node) in skip:
            continue
        for operator, index, description in _points(node):
            points.append(_Point(number, operator, index, getattr(node, "lineno", 0),
                                 getattr(node, "col_offset", 0), description))
    out = []
    for point in points:
        replacer = _Replace(point.node_number, point.operator, point.index)
        mutated = replacer.visit(copy.deepcopy(tree))
        if not replacer.done:  # pragma: no cover - the numbering is the visit order
            raise AssertionError(f"mutation point {point} not found")
        ast.fix_missing_locations(mutated)
        text = ast.unparse(mutated)
        out.append(Mutant(path, point.line, point.col, point.operator, point.index,
                          point.description, text))
    return out
