"""The size rules of the code base, checked by `make check`: no hand-written module over
500 lines, no class over 300, no function over 60 (the generated stubs in kvferry/v1 and
anything outside the repository's own packages aside). A newcomer reads a room at a time;
these bounds keep the rooms small.

    python scripts/check_sizes.py [PATH ...]    # default: every tracked package
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MODULE_LINES = 500
CLASS_LINES = 300
FUNCTION_LINES = 60
ROOTS = (
    "controlplane",
    "kvferry",
    "kvferry_cli",
    "sidecar",
    "router",
    "emulator",
    "planner",
    "bench",
    "realvllm",
    "scripts",
    "tests",
)
SKIP = ("kvferry/v1/",)


def _span(node: ast.AST) -> int:
    end = getattr(node, "end_lineno", None) or node.lineno  # type: ignore[attr-defined]
    return int(end) - int(node.lineno) + 1  # type: ignore[attr-defined]


def violations(path: Path) -> list[str]:
    """Each rule `path` breaks, as 'path:line what (n lines, limit m)'."""
    text = path.read_text()
    out: list[str] = []
    lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    if lines > MODULE_LINES:
        out.append(f"{path}:1 module ({lines} lines, limit {MODULE_LINES})")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.ClassDef) and _span(node) > CLASS_LINES:
            out.append(f"{path}:{node.lineno} class {node.name} ({_span(node)} lines, limit {CLASS_LINES})")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _span(node) > FUNCTION_LINES:
            out.append(
                f"{path}:{node.lineno} function {node.name} ({_span(node)} lines, limit {FUNCTION_LINES})"
            )
    return out


def _files(args: list[str]) -> list[Path]:
    roots = [Path(a) for a in args] or [Path(r) for r in ROOTS if Path(r).exists()]
    files: list[Path] = []
    for root in roots:
        files += [root] if root.is_file() else sorted(root.rglob("*.py"))
    return [f for f in files if not any(str(f).startswith(s) for s in SKIP)]


def main(argv: list[str]) -> int:
    found = [v for f in _files(argv) for v in violations(f)]
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} size rule(s) broken: split the module, class or function", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
