"""The layout keeps its promises: DESIGN.md's dependency rules, and no function or module too big to read."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "services" / "lockstep"
OPERATOR = ROOT / "operator" / "lockstep_operator"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450
MAX_BRANCHY = 15  # branch points above which a function is hard to test exhaustively
BRANCHY_ALLOWED = 4
PURE_CORES = [SERVICES / "kv", *(SERVICES / "coordinator" / f for f in
                                  ("scheduler.py", "admitting.py", "lookahead.py", "admission.py", "agreement.py",
                                   "waits.py", "request.py"))]
BRANCHES = (ast.If, ast.For, ast.While, ast.AsyncFor, ast.Try, ast.ExceptHandler, ast.With, ast.BoolOp,
            ast.IfExp, ast.comprehension)


def _sources() -> list[Path]:
    files = [*SERVICES.rglob("*.py"), *OPERATOR.rglob("*.py")]
    return sorted(p for p in files if "proto_gen" not in p.parts)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _files(paths: list[Path]) -> list[Path]:
    return [f for p in paths for f in (sorted(p.rglob("*.py")) if p.is_dir() else [p])]


def test_pure_cores_import_no_torch_grpc_aiohttp_or_services():
    banned = ("torch", "grpc", "aiohttp", "lockstep.engine", "lockstep.rank", "lockstep.proto_gen", "lockstep.wire",
              "lockstep.coordinator.group", "lockstep.coordinator.service", "lockstep.coordinator.openai_api")
    for path in _files(PURE_CORES):
        bad = [m for m in _imports(path) if any(m == b or m.startswith(b + ".") for b in banned)]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_rank_and_coordinator_share_only_the_protocol():
    for package, other in (("rank", "lockstep.coordinator"), ("coordinator", "lockstep.rank")):
        for path in (SERVICES / package).rglob("*.py"):
            bad = [m for m in _imports(path) if m == other or m.startswith(other + ".")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_protocol_stubs_are_imported_only_at_the_edges():
    edges = {"wire.py", "rank/service.py", "coordinator/rank_link.py", "coordinator/grpc_api.py",
             "coordinator/frontend_wire.py", "coordinator/frontend_link.py", "coordinator/remote.py"}
    for path in _sources():
        rel = str(path.relative_to(SERVICES)) if path.is_relative_to(SERVICES) else str(path)
        if any(m.startswith("lockstep.proto_gen") for m in _imports(path)):
            assert rel in edges, f"{rel} imports the generated stubs; convert at an edge ({sorted(edges)})"


def test_operator_imports_no_torch_and_nothing_of_the_engine():
    for path in OPERATOR.rglob("*.py"):
        bad = [m for m in _imports(path) if m.split(".")[0] in ("torch", "lockstep")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("module", ["lockstep.coordinator.main", "lockstep_operator.handlers"])
def test_coordinator_and_operator_start_without_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_no_module_or_function_too_big_to_read():
    too_long, branchy = [], []
    for path in _sources():
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines"
        for fn in _functions(path):
            where = f"{path.relative_to(ROOT)}:{fn.name}"
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES:
                too_long.append(where)
            if sum(isinstance(n, BRANCHES) for n in ast.walk(fn)) > MAX_BRANCHY:
                branchy.append(where)
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"
    assert len(branchy) <= BRANCHY_ALLOWED, f"functions with more than {MAX_BRANCHY} branch points: {branchy}"
