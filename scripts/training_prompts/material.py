"""Everything the prompts are made from, read once, and its split into training and held-out source units."""

from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from dataclasses import dataclass, field, fields
from pathlib import Path

from smollm2_prompts import used_function_names

from . import code, texts


# Language folders of /usr/share/man and /usr/share/locale, and the language each is written in.
LANGUAGE_FOLDERS = {"fr": "fr", "es": "es", "de": "de", "it": "it", "pt": "pt", "pt_BR": "pt", "zh_CN": "zh"}


@dataclass(frozen=True)
class Message:
    """One message of a gettext catalog: the program's English text and its translation."""

    source: str
    language: str
    english: str
    translated: str


@dataclass
class Material:
    pages: list[texts.ManPage] = field(default_factory=list)
    passages: list[texts.Passage] = field(default_factory=list)
    foreign_passages: list[texts.Passage] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    functions: list[code.Function] = field(default_factory=list)

    def split(self, heldout_percent: int) -> tuple[Material, Material]:
        """(training, held-out): every item goes to the side of its source unit ([`is_heldout`])."""
        train, held = Material(), Material()
        for item_field in fields(self):
            for item in getattr(self, item_field.name):
                side = held if is_heldout(item.source, heldout_percent) else train
                getattr(side, item_field.name).append(item)
        return train, held

    def summary(self) -> dict[str, int]:
        counts = {item_field.name: len(getattr(self, item_field.name)) for item_field in fields(self)}
        counts["source_units"] = len({item.source for item_field in fields(self)
                                      for item in getattr(self, item_field.name)})
        return counts


def is_heldout(source: str, percent: int) -> bool:
    """Whether a source unit is held out: a stable hash of its name, not Python's salted `hash`."""
    return int(hashlib.sha1(source.encode()).hexdigest()[:8], 16) % 100 < percent


def python_roots(specs: list[str] | None) -> dict[str, Path]:
    """{tree name: folder} from "NAME=FOLDER" strings; by default the standard library and site-packages."""
    if not specs:
        paths = sysconfig.get_paths()
        return {"stdlib": Path(paths["stdlib"]), "site": Path(paths["purelib"])}
    roots = {}
    for spec in specs:
        name, _, folder = spec.partition("=")
        if not name or not folder or not Path(folder).is_dir():
            raise ValueError(f"--python-root {spec!r}: expected NAME=FOLDER with an existing folder, "
                             "e.g. --python-root stdlib=/usr/lib/python3.11.")
        roots[name] = Path(folder)
    return roots


# The stub shape ("def name(" at a line start) and the one-line shape of the earlier campaign's third stage.
_USED_NAME = re.compile(r"^(?:async )?def (\w+)\(|Write a python function `(\w+)`", re.MULTILINE)


def earlier_prompts(paths: list[Path]) -> tuple[set[str], set[str]]:
    """(function names, doc paragraph keys) that the earlier campaign's prompt files used: the names its three code
    shapes ask for, and the [`texts.paragraph_key`] of the paragraph after the instruction line of its chat prompts."""
    names = used_function_names(paths)
    paragraphs = set()
    for path in paths:
        for line in filter(str.strip, path.read_text(encoding="utf-8").splitlines()):
            prompt = json.loads(line)["turns"][0]
            names.update(match.group(1) or match.group(2) for match in _USED_NAME.finditer(prompt))
            if "\n\n" in prompt:
                paragraphs.add(texts.paragraph_key(prompt.split("\n\n", 1)[1]))
    return names, paragraphs


def gather(args) -> Material:
    """Reads every source named by the builder's arguments (see `build_training_prompts.py`)."""
    excluded_names, excluded_paragraphs = earlier_prompts(args.exclude_prompts)
    material = Material()
    cache = args.cache_dir / "man"
    for page in texts.man_pages(args.man_root, cache):
        material.pages.append(page)
        material.passages += texts.man_page_passages(page, 40, 300)
    for folder, language in LANGUAGE_FOLDERS.items():
        for page in texts.man_pages(args.man_root, cache, folder, language):
            material.foreign_passages += [passage for passage in texts.man_page_passages(page, 30, 180)
                                          if passage.language == language]
    for doc_root in args.doc_root + [root for name, root in args.python_roots.items() if name == "site"]:
        material.passages += texts.doc_passages(doc_root, 40, 300, excluded_paragraphs)
    for folder, language in LANGUAGE_FOLDERS.items():
        material.messages += [Message(f"mo:{catalog}", language, english, translated) for catalog, english, translated
                              in texts.catalog_messages(args.locale_root, folder)]
    # by name in every tree: site-packages hold copies of standard-library functions (setuptools' distutils)
    material.functions, docstring_passages = code.harvest(args.python_roots, {
        tree: excluded_names for tree in args.python_roots})
    material.passages += docstring_passages
    return material
