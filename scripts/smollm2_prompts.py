"""Builds the prompt set for the embedded default drafter (SmolLM2-135M-Instruct), from text on every machine.

- math: gsm8k lines 501+ of the shared eval file (lines 1-500 are held out for evaluation);
- code: "write this function" requests made from docstrings of the Python standard library's own functions;
- chat: "explain / summarize" requests over README and text files from /usr/share/doc.

Responses are NOT here: `dspark-hf prepare-data` regenerates them with the target. Deterministic (fixed seed).

    python scripts/smollm2_prompts.py --gsm8k ../shared/data/eval/gsm8k.jsonl --out data/smollm2_prompts.jsonl
    # second stage: 1,000 more code prompts and later doc paragraphs, none already in the first file
    python scripts/smollm2_prompts.py --gsm8k ../shared/data/eval/gsm8k.jsonl --out data/extra.jsonl \
        --extra data/smollm2_prompts.jsonl
    # third stage: code in the two other shapes users send: a stub to complete ("Write a solution to the following
    # problem ... ```python def f(...): \"\"\"doc\"\"\"```") and a one-line request ("Write a python function to ..."),
    # from standard-library functions (packages included) not used by the first two files
    python scripts/smollm2_prompts.py --gsm8k ../shared/data/eval/gsm8k.jsonl --out data/code3.jsonl \
        --code-shapes data/smollm2_prompts.jsonl data/extra.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sysconfig
from pathlib import Path


def gsm8k_prompts(path: Path, first_line: int = 501) -> list[str]:
    lines = path.read_text().splitlines()[first_line - 1:]
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]


def code_prompts(limit: int, rng: random.Random) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and 40 <= len(doc) <= 600:
                    args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
                    prompts.append(f"Write a Python function `{node.name}({args})`.\n\n{doc.strip()}")
    rng.shuffle(prompts)
    return prompts[:limit]


STUB_ASK = "Write a solution to the following problem and make sure that it passes the tests:"


def stdlib_functions(exclude: set[str]) -> list[tuple[str, str, str]]:
    """(name, signature line, docstring) of documented public functions of the standard library and its packages
    (tests, idlelib and site-packages left out) whose names are not in `exclude`, one per name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    functions, names = [], set(exclude)
    for path in sorted(stdlib.rglob("*.py")):
        if {"test", "tests", "idlelib", "site-packages"} & set(path.relative_to(stdlib).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.name not in names:
                doc = ast.get_docstring(node)
                if doc and 40 <= len(doc) <= 600:
                    node.args.args = [a for a in node.args.args if a.arg not in ("self", "cls")]
                    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
                    functions.append((node.name, f"def {node.name}({ast.unparse(node.args)}){returns}:", doc.strip()))
                    names.add(node.name)
    return functions


def stub_prompt(signature: str, doc: str) -> str:
    """A HumanEval-shaped request: the signature and docstring of a function to complete, in a code block."""
    body = "\n".join(("    " + line) if line else "" for line in doc.splitlines())
    return f'{STUB_ASK}\n```python\n{signature}\n    """ {body.lstrip()}\n    """\n\n```'


def used_function_names(prompt_files: list[Path]) -> set[str]:
    """Names of the functions that the "Write a Python function `name(...)`" prompts of these files ask for."""
    used = set()
    for path in prompt_files:
        for line in filter(str.strip, path.read_text().splitlines()):
            match = re.match(r"Write a Python function `(\w+)\(", json.loads(line)["turns"][0])
            if match:
                used.add(match.group(1))
    return used


def code_shape_prompts(exclude_files: list[Path], num_stubs: int, num_requests: int, seed: int) -> list[dict]:
    """Stub-completion and one-line code requests over functions the `exclude_files` prompts did not use."""
    functions = stdlib_functions(used_function_names(exclude_files))
    rng = random.Random(seed)
    rng.shuffle(functions)
    rows = []
    for name, signature, doc in functions[:num_stubs]:
        rows.append({"turns": [stub_prompt(signature, doc)], "category": "code"})
    for name, signature, doc in functions[num_stubs:num_stubs + num_requests]:
        first = doc.split("\n\n")[0].replace("\n", " ").strip().rstrip(".")
        request = f"Write a python function `{name}` to {first[0].lower()}{first[1:]}."
        rows.append({"turns": [request], "category": "code"})
    rng.shuffle(rows)
    return rows


def chat_chunks(first: int = 0, last: int = 3) -> list[str]:
    """Paragraphs `first..last-1` (200-1200 characters) of each README/NEWS file under /usr/share/doc."""
    files = sorted(p for p in Path("/usr/share/doc").rglob("*")
                   if p.is_file() and p.suffix in ("", ".txt", ".md") and p.name.upper().startswith(("README", "NEWS"))
                   and p.stat().st_size < 200_000)
    chunks = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        paragraphs = [p.strip() for p in text.split("\n\n") if 200 <= len(p.strip()) <= 1200]
        chunks += paragraphs[first:last]
    return chunks


ASKS = ["Explain this in simple terms:", "Summarize the following text:", "What is this about? Answer briefly.",
        "Rewrite this as a short list of key points:"]


def chat_prompts(limit: int, rng: random.Random) -> list[str]:
    chunks = chat_chunks()
    rng.shuffle(chunks)
    return [f"{rng.choice(ASKS)}\n\n{chunk}" for chunk in chunks[:limit]]


def extra_prompts(exclude: Path, num_code: int, num_chat: int, seed: int) -> list[dict]:
    """The second-stage set: code prompts not in `exclude` (the first set) and later paragraphs of the same docs."""
    seen = {json.loads(line)["turns"][0] for line in exclude.read_text().splitlines() if line.strip()}
    rng = random.Random(seed)
    code = [p for p in code_prompts(10**6, rng) if p not in seen][:num_code]
    chat = [f"{rng.choice(ASKS)}\n\n{chunk}" for chunk in chat_chunks(3, 10)][:num_chat]
    rows = [{"turns": [p], "category": "code"} for p in code] + [{"turns": [p], "category": "chat"} for p in chat]
    rng.shuffle(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gsm8k", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-math", type=int, default=600)
    parser.add_argument("--num-code", type=int, default=500)
    parser.add_argument("--num-chat", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra", type=Path, default=None,
                        help="write the second-stage set instead: prompts not in this first-stage file")
    parser.add_argument("--code-shapes", type=Path, nargs="+", default=None, metavar="PROMPTS",
                        help="write the third-stage code set instead, over functions these prompt files did not use")
    args = parser.parse_args()
    if args.code_shapes is not None:
        _write(code_shape_prompts(args.code_shapes, num_stubs=600, num_requests=300, seed=args.seed), args.out)
        return
    if args.extra is not None:
        rows = extra_prompts(args.extra, num_code=1000, num_chat=300, seed=args.seed)
        _write(rows, args.out)
        return
    rng = random.Random(args.seed)
    sets = {
        "math": gsm8k_prompts(args.gsm8k)[: args.num_math],
        "code": code_prompts(args.num_code, rng),
        "chat": chat_prompts(args.num_chat, rng),
    }
    rows = [{"turns": [p], "category": name} for name, prompts in sets.items() for p in prompts]
    rng.shuffle(rows)
    _write(rows, args.out)


def _write(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    counts = {}
    for row in rows:
        counts[row["category"]] = counts.get(row["category"], 0) + 1
    print(counts, "->", out)


if __name__ == "__main__":
    main()
