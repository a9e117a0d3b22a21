"""Python functions from the source trees on the machine, and the code prompts made from them.

Shapes, as users write them: a stub to complete (signature + docstring in a ```python block, HumanEval's shape), a
one-line request ("Write a python function to ...", MBPP's shape), "add a docstring to this function", "fix the bug
in this function" (a small bug planted with the `ast` module: a flipped comparison, an off-by-one, a swapped operator),
"explain this code" and "write tests for this function".
"""

from __future__ import annotations

import ast
import copy
import hashlib
import random
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .texts import Passage, group_paragraphs, is_prose, text_paragraphs


SKIPPED_PARTS = {"test", "tests", "testing", "idlelib", "site-packages", "dist-packages", "__pycache__", "_vendor",
                 "vendored", "_vendored", "benchmarks", "examples", "turtledemo", "lib2to3", "ensurepip"}


@dataclass(frozen=True)
class Function:
    """A function or method of a source file.

    Attributes:
        source: the file it comes from, as "<tree>:<relative path>" (the unit of the train / held-out split).
        name: its name; `qualname` adds the class for methods.
        signature: the `def` line without `self` / `cls`.
        docstring: its docstring ("" when none).
        code: its source, dedented, comments and formatting as written.
        code_without_docstring: the same with the docstring lines removed.
        node: the parsed function, for planting bugs.
    """

    source: str
    name: str
    qualname: str
    signature: str
    docstring: str
    code: str
    code_without_docstring: str
    node: ast.FunctionDef


def python_files(root: Path, max_files_per_package: int = 120, max_bytes: int = 150_000) -> list[Path]:
    """`*.py` files under `root`, sorted, without tests, vendored copies, examples or nested package trees, and at most
    `max_files_per_package` per top-level package (spread over its subpackages by a hash of the path), so that a few
    huge packages neither drown the rest nor make parsing slow."""
    by_package: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if SKIPPED_PARTS & set(parts[:-1]) or path.name.startswith("test_") or path.stat().st_size > max_bytes:
            continue
        by_package.setdefault(parts[0].removesuffix(".py"), []).append(path)
    chosen = []
    for paths in by_package.values():
        if len(paths) > max_files_per_package:
            paths = sorted(paths, key=lambda path: hashlib.sha1(str(path.relative_to(root)).encode()).digest())
        chosen += paths[:max_files_per_package]
    return sorted(chosen)


def file_functions(path: Path, source: str) -> tuple[list[Function], list[str]]:
    """The functions and methods of one file (at most one class level deep), and its module and class docstrings."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return [], []
    lines = text.splitlines()
    docstrings = [ast.get_docstring(tree) or ""]
    functions = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            docstrings.append(ast.get_docstring(node) or "")
            children = [(child, f"{node.name}.{child.name}") for child in node.body
                        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            children = [(node, node.name)]
        else:
            continue
        for child, qualname in children:
            function = _function(child, qualname, lines, source)
            if function is not None:
                functions.append(function)
    return functions, [doc for doc in docstrings if doc]


def _function(node: ast.FunctionDef, qualname: str, lines: list[str], source: str) -> Function | None:
    first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
    code_lines = lines[first - 1:node.end_lineno]
    if any("\t" in line for line in code_lines):
        return None
    docstring = ast.get_docstring(node) or ""
    without = code_lines
    if docstring:
        doc_node = node.body[0]
        without = [line for number, line in enumerate(code_lines, start=first)
                   if not doc_node.lineno <= number <= doc_node.end_lineno]
    stub = copy.copy(node.args)
    stub.args = [arg for arg in node.args.args if arg.arg not in ("self", "cls")]
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return Function(source=source, name=node.name, qualname=qualname,
                    signature=f"{prefix} {node.name}({ast.unparse(stub)}){returns}:", docstring=docstring,
                    code=textwrap.dedent("\n".join(code_lines)), code_without_docstring=textwrap.dedent(
                        "\n".join(without)), node=node)


def harvest(roots: dict[str, Path], exclude_names: dict[str, set[str]]) -> tuple[list[Function], list[Passage]]:
    """Functions of every tree in `roots` ({tree name: folder}) except those whose name is in
    `exclude_names[tree]`, one per distinct code text; and the prose of module / class docstrings as passages."""
    functions, passages, seen = [], [], set()
    for tree, root in roots.items():
        for path in python_files(root):
            relative = path.relative_to(root)
            source = f"{tree}:{relative}"
            found, docstrings = file_functions(path, source)
            for function in found:
                fingerprint = re.sub(r"\s+", "", function.code_without_docstring)
                if function.name in exclude_names.get(tree, ()) or fingerprint in seen:
                    continue
                seen.add(fingerprint)
                functions.append(function)
            title = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
            for docstring in docstrings:
                prose = [p for p in text_paragraphs(docstring) if is_prose(p) and not _FIELD_LIST.search(p)]
                passages += [Passage(source, title, text) for text in group_paragraphs(prose, 60, 300)]
    return functions, passages


_FIELD_LIST = re.compile(r"^(Args|Arguments|Parameters|Params|Returns?|Raises|Yields|Examples?|Attributes|Notes?|"
                         r"See Also)\b|\w+ \((str|int|float|bool|dict|list|tuple|`|optional)|^:\w+|\w+ : [\w.]+",
                         re.MULTILINE)


# --- shapes ----------------------------------------------------------------------------------------------------------

STUB_ASKS = [
    "Write a solution to the following problem and make sure that it passes the tests:",
    "Complete the following Python function:",
    "Implement the function below.",
    "Fill in the body of this function so that it does what its docstring says:",
    "Finish this Python function:",
    "Write the implementation of this function:",
]
REQUEST_TEMPLATES = [
    "Write a python function to {task}.",
    "Write a Python function that {tasks}.",
    "Write a function to {task}.",
    "Can you write a Python function `{name}` to {task}?",
    "How would I write a function in Python to {task}?",
    "Create a Python function named {name} that {tasks}.",
    "I need a Python function to {task}. Please include an example of how to call it.",
]
DOCSTRING_ASKS = [
    "Add a docstring to this function:", "Write a docstring for the following Python function.",
    "Document this function with a Google-style docstring:", "Please add a clear docstring to this code:",
    "What would be a good docstring for this function? Return the function with the docstring added.",
]
BUG_ASKS = [
    "The following function has a bug. Find it and fix it:", "Fix the bug in this function:",
    "This function doesn't work as expected. What is wrong with it, and how do I fix it?",
    "There is a mistake in this Python code. Can you spot it and correct it?",
    "Find and fix the error in the following function.",
]
EXPLAIN_ASKS = [
    "Explain this code:", "What does this Python function do?",
    "Explain what the following function does, step by step.",
    "Can you walk me through this code?", "Describe in plain English what this function does:",
    "I found this function in a codebase. What is it for and how does it work?",
]
TESTS_ASKS = ["Write unit tests for this function using pytest:", "Write a few test cases for the following function:",
              "How would you test this function? Write the tests."]


def code_block(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def stub_prompt(function: Function, rng: random.Random) -> str | None:
    """Signature and docstring, HumanEval-style, under one of [`STUB_ASKS`]."""
    if not 40 <= len(function.docstring) <= 900 or function.name.startswith("_"):
        return None
    body = "\n".join(("    " + line) if line else "" for line in function.docstring.splitlines())
    return f'{rng.choice(STUB_ASKS)}\n```python\n{function.signature}\n    """ {body.lstrip()}\n    """\n\n```'


_THIRD_PERSON = re.compile(r"^([A-Z][a-z]+?)(ies|ses|ches|shes|xes|zes|s)\b")


def first_sentence_task(docstring: str) -> tuple[str, str] | None:
    """("return the x of y", "returns the x of y") from a docstring starting with a verb, else `None`."""
    first = re.split(r"(?<=[.!?])\s|\n\n", docstring.strip(), maxsplit=1)[0].replace("\n", " ").strip().rstrip(".")
    words = first.split()
    if not 5 <= len(words) <= 30 or not first[:1].isupper() or any(c in first for c in "`:>{}[]=*"):
        return None
    match = _THIRD_PERSON.match(first)
    if match:
        stem = match.group(1) + {"ies": "y", "s": ""}.get(match.group(2), match.group(2)[:-1])
        base, third = stem + first[match.end():], first
    elif words[0].lower() in _IMPERATIVES:
        base = first
        third = _third_person(words[0]) + first[len(words[0]):]
    else:
        return None
    return base[0].lower() + base[1:], third[0].lower() + third[1:]


_IMPERATIVES = set("""return get set compute create convert check make find build parse read write load save apply
add remove update generate calculate determine validate test format split join run call open close copy move
normalize encode decode extract resolve register initialize construct search sort filter merge count compare
insert delete replace emit send receive wrap print raise yield produce prepare""".split())


def _third_person(verb: str) -> str:
    if verb.endswith("y") and verb[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + ("es" if verb.endswith(("s", "sh", "ch", "x", "z")) else "s")


def request_prompt(function: Function, rng: random.Random) -> str | None:
    """A one-line request from the first sentence of the docstring, when it starts with a verb."""
    task = first_sentence_task(function.docstring) if not function.name.startswith("_") else None
    if task is None:
        return None
    base, third = task
    return rng.choice(REQUEST_TEMPLATES).format(task=base, tasks=third, name=function.name)


def _short_enough(code: str, max_lines: int = 45, max_chars: int = 1800) -> bool:
    lines = code.splitlines()
    return 4 <= len(lines) <= max_lines and len(code) <= max_chars


def _statements(function: Function) -> int:
    """Statements in the body, the docstring left out: one-liners (getters, `pass`) are not worth a prompt."""
    return len(function.node.body) - bool(function.docstring)


def docstring_prompt(function: Function, rng: random.Random) -> str | None:
    code = function.code_without_docstring
    # a function that was only a docstring does not parse once it is removed
    if _statements(function) < 2 or not _short_enough(code) or not _parses(code):
        return None
    return f"{rng.choice(DOCSTRING_ASKS)}\n\n{code_block(code)}"


def explain_prompt(function: Function, rng: random.Random) -> str | None:
    code_lines = len(function.code_without_docstring.splitlines())
    if _statements(function) < 2 or not _short_enough(function.code) or code_lines < 6:
        return None
    return f"{rng.choice(EXPLAIN_ASKS)}\n\n{code_block(function.code)}"


def tests_prompt(function: Function, rng: random.Random) -> str | None:
    if function.qualname != function.name or _statements(function) < 2 or not _short_enough(function.code, 30, 1200):
        return None
    return f"{rng.choice(TESTS_ASKS)}\n\n{code_block(function.code)}"


def bug_prompt(function: Function, rng: random.Random) -> str | None:
    """The function with one planted bug (printed back by `ast.unparse`, so comments are gone)."""
    if _statements(function) < 2 or not _short_enough(function.code, 35, 1500):
        return None
    buggy = plant_bug(function.node, rng)
    return None if buggy is None else f"{rng.choice(BUG_ASKS)}\n\n{code_block(buggy)}"


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except SyntaxError:
        return False


_SWAPS: dict[type, type] = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                            ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn,
                            ast.NotIn: ast.In, ast.Add: ast.Sub, ast.Sub: ast.Add, ast.And: ast.Or, ast.Or: ast.And}


def plant_bug(node: ast.FunctionDef, rng: random.Random) -> str | None:
    """Source of a copy of `node` with one small change of behaviour, chosen among its comparisons, operators, small
    integer constants (an off-by-one) and boolean returns; `None` when it has none of these."""
    tree = copy.deepcopy(node)
    body = tree.body[1:] if ast.get_docstring(tree) else tree.body
    candidates: list[Callable[[], None]] = []
    for statement in body:
        for child in ast.walk(statement):
            candidates += _mutations(child)
    if not candidates:
        return None
    rng.choice(candidates)()
    tree.decorator_list = []
    return ast.unparse(tree)


def _mutations(child: ast.AST) -> list[Callable[[], None]]:
    found = []
    if isinstance(child, ast.Compare):
        for index, op in enumerate(child.ops):
            if type(op) in _SWAPS:
                found.append(lambda c=child, i=index: c.ops.__setitem__(i, _SWAPS[type(c.ops[i])]()))
    elif isinstance(child, (ast.BinOp, ast.BoolOp, ast.AugAssign)) and type(child.op) in _SWAPS:
        found.append(lambda c=child: setattr(c, "op", _SWAPS[type(c.op)]()))
    elif isinstance(child, ast.Constant) and type(child.value) is int and 0 <= child.value <= 2:
        found.append(lambda c=child: setattr(c, "value", c.value + 1))
    elif isinstance(child, ast.Return) and isinstance(child.value, ast.Constant) and type(child.value.value) is bool:
        found.append(lambda c=child: setattr(c.value, "value", not c.value.value))
    return found


SHAPES: dict[str, Callable[[Function, random.Random], str | None]] = {
    "stub": stub_prompt, "request": request_prompt, "docstring": docstring_prompt, "bugfix": bug_prompt,
    "explain": explain_prompt, "tests": tests_prompt,
}
