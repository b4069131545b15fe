"""Move cmlcluster's modules and rewrite every import of them: the tool of issue 36's reshape.

    python scripts/move_modules.py agent_files=agent.files agent_engine=agent.engine ...

Each OLD=NEW names a module without the leading "cmlcluster." (NEW's packages are made, with an empty
__init__.py, when missing). Then, in cmlcluster/, tests/, scripts/, bench/ and notebooks/:

- relative imports in the package are recomputed from the files' new places (a moved file's own, and any
  that name a moved module); `from . import old_name` keeps its local name (`from .agent import files as
  agent_files`), so no code below the imports changes;
- absolute imports and dotted names in strings ("cmlcluster.agent_files:unpack_files", `-m ...`,
  monkeypatch targets, docs) are renamed, longest name first.

It moves with `git mv` and prints what it changed; read the diff after it, and grep what it cannot see:
`from cmlcluster import old_name` inside a string (a test's child program) is code it does not parse.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "cmlcluster"
TEXT_FOLDERS = ("cmlcluster", "tests", "scripts", "bench", "notebooks", "docs", "labextension/src")
DONE = "\u00a7"  # marks a name rewrite_imports wrote: rename_strings leaves it
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".ipynb", ".cfg", ".ts", ".txt", ".yaml", ".yml"}


def module_of(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def path_of(module: str, is_package: bool = False) -> pathlib.Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if is_package else base.with_suffix(".py")


def renamed(name: str, moves: dict[str, str]) -> str:
    """`name` (absolute, dotted) after the moves: the longest moved prefix decides."""
    for old in sorted(moves, key=len, reverse=True):
        if name == old or name.startswith(old + "."):
            return moves[old] + name[len(old) :]
    return name


def relative(target: str, importer: str, importer_is_package: bool) -> str:
    """`target` as a relative name from module `importer` ("." + ...)."""
    here = importer.split(".") if importer_is_package else importer.split(".")[:-1]
    there = target.split(".")
    common = 0
    while common < min(len(here), len(there)) and here[common] == there[common]:
        common += 1
    return "." * (len(here) - common + 1) + ".".join(there[common:])


def rewrite_imports(
    path: pathlib.Path, old_module: str | None, new_module: str | None, moves: dict[str, str], new_is_package: bool
) -> str:
    """The file's source with its imports of moved modules rewritten; a module of the package (old_module,
    new_module: its names before and after) has its relative imports recomputed from its new place."""
    lines = path.read_text().splitlines(keepends=True)
    is_package = path.name == "__init__.py"  # where it is now
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse("".join(lines))):
        indent = lines[node.lineno - 1][: node.col_offset] if isinstance(node, ast.stmt) else ""
        if isinstance(node, ast.ImportFrom):
            absolute = _absolute(node, old_module, is_package)
            if absolute is None:
                continue
            # (its module's new name, the name imported, the local name): a moved module imported from its
            # package keeps its local name (`from .agent import files as agent_files`)
            statements = []
            for alias in node.names:
                if f"{absolute}.{alias.name}" in moves:
                    parent, _, name = moves[f"{absolute}.{alias.name}"].rpartition(".")
                    local = alias.asname or alias.name
                    statements.append((parent, name, None if local == name else local))
                else:
                    statements.append((renamed(absolute, moves), alias.name, alias.asname))
            same = [(absolute, a.name, a.asname) for a in node.names] == statements
            if same and not (node.level and old_module != new_module):
                continue
            grouped: dict[str, list[str]] = {}
            for parent, name, local in statements:
                where = relative(parent, str(new_module), new_is_package) if node.level else DONE + parent
                grouped.setdefault(where, []).append(f"{name} as {local}" if local else name)
            text = f"\n{indent}".join(f"from {where} import {', '.join(names)}" for where, names in grouped.items())
            edits.append((node.lineno, node.end_lineno or node.lineno, indent + text))
    return _apply(path, lines, edits)


def _absolute(node: ast.ImportFrom, module: str | None, is_package: bool) -> str | None:
    """The absolute name an ImportFrom imports from, if it is of the package; None otherwise."""
    if node.level and module is not None:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))
    if node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
        return node.module
    return None


def _apply(path: pathlib.Path, lines: list[str], edits: list[tuple[int, int, str]]) -> str:
    """The edits made, each statement's trailing comment kept (a comment inside one is said, for a look)."""
    for start, end, text in sorted(edits, reverse=True):
        comment = re.search(r"#.*$", lines[end - 1].rstrip("\n"))
        if any("#" in line for line in lines[start - 1 : end - 1]):
            print(f"look at {path.relative_to(ROOT)}:{start}: a comment inside an import that was rewritten")
        lines[start - 1 : end] = [text + (f"  {comment.group(0)}" if comment else "") + "\n"]
    return "".join(lines)


def rename_strings(text: str, moves: dict[str, str]) -> str:
    """Every dotted name of the package in `text` renamed, in one pass (a new name may begin with an old one:
    backends.docker -> backends.docker.backend); the names rewrite_imports wrote are marked, and left."""
    dotted = re.compile(rf"(?<![\w.{DONE}]){PACKAGE}(?:\.\w+)*")
    return dotted.sub(lambda m: renamed(m.group(0), moves), text).replace(DONE, "")


def target_of(module: str, files: dict[str, pathlib.Path], moves: dict[str, str]) -> pathlib.Path:
    """Where `module`'s file goes: a package's __init__.py when it was one, or when other modules move below
    its new name (agent.py -> agent/__init__.py, beside agent/engine.py)."""
    new = renamed(module, moves)
    below = any(other.startswith(new + ".") for other in moves.values())
    return path_of(new, is_package=files[module].name == "__init__.py" or below)


def main(argv: list[str]) -> None:
    pairs = [arg.split("=", 1) for arg in argv]
    moves = {f"{PACKAGE}.{old}": f"{PACKAGE}.{new}" for old, new in pairs}
    files = {module_of(p): p for p in (ROOT / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts}
    # New packages first: an __init__.py where none is.
    for new in moves.values():
        parts = new.split(".")
        for i in range(2, len(parts)):
            package = ".".join(parts[:i])
            init = path_of(package, is_package=True)
            if not init.exists() and package not in moves.values():  # not a module that becomes a package
                init.parent.mkdir(parents=True, exist_ok=True)
                init.write_text("")
                subprocess.run(["/usr/bin/git", "add", str(init)], cwd=ROOT, check=True)
    # Imports, from the files' old places (their text), for their new ones.
    rewritten = {}
    for module, path in files.items():
        new_module = renamed(module, moves)
        text = rewrite_imports(path, module, new_module, moves, target_of(module, files, moves).name == "__init__.py")
        rewritten[path] = rename_strings(text, moves)
    for path, text in rewritten.items():
        if text != path.read_text():
            path.write_text(text)
            print("rewrote", path.relative_to(ROOT))
    for old in moves:
        source, target = files[old], target_of(old, files, moves)
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["/usr/bin/git", "mv", str(source), str(target)], cwd=ROOT, check=True)
        print("moved", source.relative_to(ROOT), "->", target.relative_to(ROOT))
    # Absolute names everywhere else: tests, scripts, docs, notebooks.
    for folder in TEXT_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in TEXT_SUFFIXES or "__pycache__" in path.parts or not path.is_file():
                continue
            if folder == PACKAGE or path == pathlib.Path(__file__).resolve():
                continue  # done above, with their imports; or this file
            text = path.read_text()
            if path.suffix == ".py" and folder != "docs":
                try:
                    text = rewrite_imports(path, None, None, moves, False)
                except SyntaxError:
                    pass
            text = rename_strings(text, moves)
            if text != path.read_text():
                path.write_text(text)
                print("rewrote", path.relative_to(ROOT))
    for name in ("README.md", "pyproject.toml", "setup.py"):
        path = ROOT / name
        text = rename_strings(path.read_text(), moves)
        if text != path.read_text():
            path.write_text(text)
            print("rewrote", name)


if __name__ == "__main__":
    main(sys.argv[1:])
