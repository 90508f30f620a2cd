"""The code's shape, for notes on structure work: the longest and branchiest functions, the largest modules.

    python scripts/code_shape.py [ROOT]

Counts services/ and operator/ (generated stubs left out); branch points are the same node kinds that
tests/test_layout.py counts.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

BRANCHES = (ast.If, ast.For, ast.While, ast.AsyncFor, ast.Try, ast.ExceptHandler, ast.With, ast.BoolOp,
            ast.IfExp, ast.comprehension)


def main(root: Path) -> None:
    funcs, mods = [], []
    for path in sorted([*root.glob("services/**/*.py"), *root.glob("operator/**/*.py")]):
        if "proto_gen" in path.parts:
            continue
        src = path.read_text()
        mods.append((len(src.splitlines()), str(path.relative_to(root))))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                branches = sum(isinstance(n, BRANCHES) for n in ast.walk(node))
                funcs.append((node.end_lineno - node.lineno + 1, branches, f"{path.relative_to(root)}:{node.name}"))
    print("longest functions (lines, branch points):")
    for f in sorted(funcs, reverse=True)[:8]:
        print(" ", f)
    print("most branch points:")
    for f in sorted(funcs, key=lambda f: -f[1])[:6]:
        print(" ", f)
    print("largest modules:")
    for m in sorted(mods, reverse=True)[:6]:
        print(" ", m)
    lengths = sorted(f[0] for f in funcs)
    print(f"{len(lengths)} functions, median {lengths[len(lengths) // 2]} lines")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
