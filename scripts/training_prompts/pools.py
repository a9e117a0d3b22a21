"""Candidate prompts per domain (more than each quota, in the order they are taken) and the held-out sets."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from . import code, math, tasks
from .material import Material, Message
from .texts import Passage


SHARES = {"code": 0.30, "math": 0.15, "chat": 0.15, "summarization": 0.10, "translation": 0.10, "passage_qa": 0.10,
          "rewriting": 0.10}
CODE_SHAPES = {"stub": 0.25, "request": 0.25, "docstring": 0.13, "bugfix": 0.15, "explain": 0.15, "tests": 0.07}
HELDOUT_SETS = ("summarization", "translation", "passage_qa", "rewriting", "code_stubs", "code_requests")
# Candidates per quota slot: room for prompts rejected for overlap or length.
SLACK = 1.5

# Which passages each passage task takes (words): summaries need substance, translations and rewrites stay short.
PASSAGE_TASKS = {"summarization": (100, 300), "passage_qa": (60, 300), "rewriting": (40, 250),
                 "translation": (40, 180), "explain": (40, 250)}


def assign(items: list, demands: dict[str, int], fits: Callable[[object, str], bool],
           scarce: tuple[str, ...] = ("passage_qa",)) -> dict[str, list]:
    """Each item to one task it fits: a `scarce` task first (few passages have a question to ask), else the task that
    is least filled relative to its demand."""
    assigned = {task: [] for task in demands}
    for item in items:
        open_tasks = [task for task in demands if len(assigned[task]) < demands[task] and fits(item, task)]
        if open_tasks:
            first = [task for task in open_tasks if task in scarce]
            task = first[0] if first else min(open_tasks, key=lambda name: len(assigned[name]) / demands[name])
            assigned[task].append(item)
    return assigned


def _rng(seed: int, name: str) -> random.Random:
    return random.Random(f"{seed}:{name}")


def code_prompts(functions: list[code.Function], count: int, rng: random.Random) -> tuple[list[str], Counter]:
    """About `count` code prompts over distinct functions, in the [`CODE_SHAPES`] proportions."""
    functions = list(functions)
    rng.shuffle(functions)
    demands = {shape: max(1, round(count * share)) for shape, share in CODE_SHAPES.items()}
    made = {shape: [] for shape in demands}
    for function in functions:
        open_shapes = sorted((shape for shape in demands if len(made[shape]) < demands[shape]),
                             key=lambda shape: len(made[shape]) / demands[shape])
        for shape in open_shapes:
            prompt = code.SHAPES[shape](function, rng)
            if prompt is not None:
                made[shape].append(prompt)
                break
    prompts = [prompt for shape_prompts in made.values() for prompt in shape_prompts]
    rng.shuffle(prompts)
    return prompts, Counter({shape: len(shape_prompts) for shape, shape_prompts in made.items()})


def _fits(passage: Passage, task: str) -> bool:
    low, high = PASSAGE_TASKS[task]
    if not low <= passage.num_words <= high:
        return False
    return task != "passage_qa" or bool(tasks.passage_questions(passage))


def translation_prompts(passages: list[Passage], foreign: list[Passage], messages: list[Message], count: int,
                        rng: random.Random) -> list[tuple[str, str]]:
    """About `count` (prompt, text to translate) pairs: English passages into the six languages (45%), man page
    passages of those languages into English (up to 30%), and catalog messages both ways, one long message or a
    numbered list."""
    languages = sorted(tasks.LANGUAGES)
    prompts = [(tasks.translation_prompt(p.text, languages[i % len(languages)], False, rng), p.text)
               for i, p in enumerate(passages[:int(count * 0.45)])]
    prompts += [(tasks.translation_prompt(p.text, p.language, True, rng), p.text) for p in foreign[:int(count * 0.3)]]
    by_catalog: dict[tuple[str, str], list[Message]] = {}
    for message in messages:
        by_catalog.setdefault((message.source, message.language), []).append(message)
    groups = list(by_catalog.values())
    rng.shuffle(groups)
    while len(prompts) < count and groups:
        group = groups.pop()
        rng.shuffle(group)
        for start in range(0, len(group), 5):
            chunk, to_english = group[start:start + rng.randint(1, 5)], rng.random() < 0.5
            texts = [m.translated if to_english else m.english for m in chunk]
            if len(chunk) == 1 and len(chunk[0].english.split()) >= 12:
                prompts.append((tasks.translation_prompt(texts[0], chunk[0].language, to_english, rng), texts[0]))
            elif len(chunk) >= 3:
                prompts.append((tasks.message_list_prompt(texts, chunk[0].language, to_english, rng), "\n".join(texts)))
    rng.shuffle(prompts)
    return prompts


def chat_prompts(material: Material, explain: list[Passage], spare: list[code.Function], count: int,
                 rng: random.Random) -> list[str]:
    """Questions about man pages (up to half), Python modules and functions, and "explain this" over passages."""
    prompts = [tasks.man_page_question(page, rng) for page in material.pages]
    prompts = [prompt for prompt in prompts if prompt][:count // 2]
    modules = sorted({passage.title for passage in material.passages if ":" in passage.source
                      and passage.source.split(":")[0] in ("stdlib", "site")})
    prompts += [tasks.module_question(title, rng) for title in modules]
    functions = [f for f in spare if f.qualname == f.name and not f.name.startswith("_") and f.docstring]
    for function in functions[:max(0, int(count * 0.8) - len(prompts))]:
        module = function.source.split(":", 1)[1].removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        prompts.append(rng.choice([f"In Python, what does `{module}.{function.name}()` do? Show an example.",
                                   f"How do I use `{function.name}` from `{module}`?"]))
    prompts += [tasks.explain_passage(passage, rng) for passage in explain]
    rng.shuffle(prompts)
    return prompts


def training_pools(train: Material, quotas: dict[str, int], gsm8k: Path, seed: int) -> tuple[dict, dict]:
    """Candidate prompts per domain, in the order to take them, and the number of code prompts of each shape."""
    want = {domain: int(quota * SLACK) + 10 for domain, quota in quotas.items()}
    math_rng = _rng(seed, "math")
    gsm8k_prompts = math.gsm8k_training_prompts(gsm8k)
    templated = math.templated_problems(max(0, want["math"] - len(gsm8k_prompts)), math_rng)
    math_prompts = gsm8k_prompts + templated  # every GSM8K training line first: real problems before templated ones

    functions = list(train.functions)
    _rng(seed, "functions").shuffle(functions)
    code_count = want["code"]
    code_list, shapes = code_prompts(functions[:code_count * 3], code_count, _rng(seed, "code"))

    passages = list(train.passages)
    _rng(seed, "passages").shuffle(passages)
    demands = {task: want.get(task, 0) for task in PASSAGE_TASKS}
    demands["translation"] = int(want["translation"] * 0.45)
    demands["explain"] = int(want["chat"] * 0.2)
    demands["passage_qa"] = int(want["passage_qa"] * 0.6)
    by_task = assign(passages, demands, _fits)
    rng = _rng(seed, "passage-tasks")
    # up to three excerpts of a long OPTIONS section, from different random starting options
    options_qa = [tasks.options_qa_prompt(page, rng) for page in train.pages
                  for _ in range(min(3, len(page.options) // 8 + 1))]
    qa = [p for p in options_qa if p][:want["passage_qa"] - len(by_task["passage_qa"])]
    qa += [tasks.passage_qa_prompt(passage, rng) for passage in by_task["passage_qa"]]
    rng.shuffle(qa)
    foreign = list(train.foreign_passages)
    rng.shuffle(foreign)
    pools = {
        "code": code_list,
        "math": math_prompts,
        "chat": chat_prompts(train, by_task["explain"], functions[code_count * 3:], want["chat"], _rng(seed, "chat")),
        "summarization": [tasks.summarization_prompt(p, rng) for p in by_task["summarization"]],
        "translation": [prompt for prompt, _ in translation_prompts(by_task["translation"], foreign, train.messages,
                                                                    want["translation"], rng)],
        "passage_qa": [prompt for prompt in qa if prompt],
        "rewriting": [tasks.rewriting_prompt(p, rng) for p in by_task["rewriting"]],
    }
    return pools, dict(shapes)


def heldout_sets(held: Material, size: int, seed: int) -> dict[str, list[tuple[str, str]]]:
    """Twice `size` (prompt, material) pairs for each held-out set, from held-out source units only; the material is
    the source text in the prompt (passage, code, messages), which training prompts must not share (the builder
    keeps the first `size` prompts that overlap no evaluation prompt)."""
    rng = _rng(seed, "heldout")
    passages = list(held.passages)
    rng.shuffle(passages)
    demands = {task: 2 * size for task in ("summarization", "passage_qa", "rewriting", "translation")}
    by_task = assign(passages, demands, _fits)
    functions = sorted(held.functions, key=lambda f: (f.qualname != f.name, rng.random()))  # functions before methods
    foreign = list(held.foreign_passages)
    rng.shuffle(foreign)
    options_qa = [(tasks.options_qa_prompt(page, rng), "\n".join(map(" ".join, page.options))) for page in held.pages]
    passage_qa = [(tasks.passage_qa_prompt(p, rng), p.text) for p in by_task["passage_qa"]]
    stubs = [(code.stub_prompt(f, rng), f.code) for f in functions[0::2]]
    requests = [(code.request_prompt(f, rng), f.code) for f in functions[1::2]]
    sets = {
        "summarization": [(tasks.summarization_prompt(p, rng), p.text) for p in by_task["summarization"]],
        "translation": translation_prompts(by_task["translation"][:size], foreign, held.messages, 2 * size, rng),
        "passage_qa": _interleave([pair for pair in passage_qa if pair[0]], [pair for pair in options_qa if pair[0]]),
        "rewriting": [(tasks.rewriting_prompt(p, rng), p.text) for p in by_task["rewriting"]],
        "code_stubs": [pair for pair in stubs if pair[0]][:2 * size],
        "code_requests": [pair for pair in requests if pair[0]][:2 * size],
    }
    return sets


def _interleave(first: list, second: list) -> list:
    """first[0], second[0], first[1], ...: both kinds in any prefix of the list."""
    merged = [item for pair in zip(first, second) for item in pair]
    shorter = min(len(first), len(second))
    return merged + first[shorter:] + second[shorter:]
