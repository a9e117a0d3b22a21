"""Private transformers names appear in `src/dspark_hf/_transformers_compat.py` only.

A name counts as private to transformers when it starts with one underscore and transformers' generation or cache
code defines it: module-level names of those modules, attributes of their classes, and the per-call attributes
`generate` sets on a `GenerationConfig`. The names every transformers model file uses (`config._attn_implementation`,
`_init_weights`, `_no_split_modules`, ...) are the model-authoring API and are not in that set; neither are our own
private helpers, unless they share a name with one of transformers'.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import transformers.cache_utils
import transformers.generation.candidate_generator
import transformers.generation.configuration_utils
import transformers.generation.utils


SOURCE = Path(__file__).resolve().parents[1] / "src" / "dspark_hf"
COMPAT = SOURCE / "_transformers_compat.py"
# The custom_generate template is a separate program: it is uploaded to the Hub beside a drafter and runs without
# dspark-hf installed, so it cannot import `_transformers_compat`. Its one private call
# (`GenerationMixin._prepare_generation_config`) is checked by `tests/test_transformers_contract.py` instead.
EXEMPT = {SOURCE / "templates" / "custom_generate" / "generate.py"}
GENERATION_MODULES = (
    transformers.generation.utils,
    transformers.generation.candidate_generator,
    transformers.generation.configuration_utils,
    transformers.cache_utils,
)
# Set on the GenerationConfig of each call by generate's `_prepare_special_tokens`.
CALL_ATTRIBUTES = {"_bos_token_tensor", "_eos_token_tensor", "_pad_token_tensor", "_decoder_start_token_tensor"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def transformers_private_names() -> set[str]:
    names = set(CALL_ATTRIBUTES)
    for module in GENERATION_MODULES:
        for name, value in vars(module).items():
            if _is_private(name):
                names.add(name)
            if inspect.isclass(value) and value.__module__ == module.__name__:
                # What transformers' classes define, not what they inherit from torch (`nn.Module._version`, ...).
                for klass in inspect.getmro(value):
                    if klass.__module__.split(".")[0] == "transformers":
                        names.update(attribute for attribute in vars(klass) if _is_private(attribute))
    return names


def private_uses(path: Path, private_names: set[str]) -> list[str]:
    """`line name` for each private transformers name `path` imports or reads. `self.<name>` is ours when the file
    defines `<name>` itself (a method or `self.<name> = ...`), as a class of ours may name a method `_sample`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
            found += [(node.lineno, alias.name) for alias in node.names if _is_private(alias.name)]
            found += [(node.lineno, node.module) for part in node.module.split(".") if _is_private(part)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names
                      if alias.name.split(".")[0] == "transformers" and any(map(_is_private, alias.name.split(".")))]
        elif isinstance(node, ast.Attribute) and node.attr in private_names:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in own):
                found.append((node.lineno, node.attr))
    return [f"{line} {name}" for line, name in sorted(found)]


def test_private_names_are_found():
    names = transformers_private_names()
    assert {"_speculative_sampling", "_assisted_decoding", "_get_candidate_generator", "_eos_token_tensor"} <= names
    # the model-authoring API is not counted, nor what transformers' modules inherit from torch
    assert not {"_attn_implementation", "_init_weights", "_name_or_path", "_version", "_parameters"} & names


def test_the_scan_flags_imports_and_attributes_not_our_own_privates(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from transformers.generation.utils import _speculative_sampling\n"
        "import transformers._private_module\n"
        "eos = generation_config._eos_token_tensor\n"
        "kernel = config._attn_implementation\n"
        "class Engine:\n"
        "    def _sample(self): ...\n"
        "    def step(self): return self._sample()\n"
    )
    assert private_uses(probe, transformers_private_names()) == [
        "1 _speculative_sampling", "2 transformers._private_module", "3 _eos_token_tensor"]


def test_private_transformers_names_only_in_the_compat_module():
    names = transformers_private_names()
    leaks = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path != COMPAT and path not in EXEMPT:
            leaks += [f"{path.relative_to(SOURCE.parent)}:{use}" for use in private_uses(path, names)]
    assert leaks == [], (
        "Private transformers names outside src/dspark_hf/_transformers_compat.py; wrap them there (with a "
        f"contract check) and call the wrapper: {leaks}"
    )
