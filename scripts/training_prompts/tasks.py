"""Prompts over text: explanations and chat, summarization, translation, question answering over a passage, rewriting.

Each maker takes its material and a `random.Random` and returns one prompt (or `None` when the material does not fit
the task), choosing among several phrasings so that no single instruction dominates.
"""

from __future__ import annotations

import random
import re

from .texts import ManPage, Passage


LANGUAGES = {"fr": "French", "es": "Spanish", "de": "German", "it": "Italian", "pt": "Portuguese", "zh": "Chinese"}


# --- explanations and chat -------------------------------------------------------------------------------------------

def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[1:2].islower() or len(text) == 1 else text


def man_page_question(page: ManPage, rng: random.Random) -> str | None:
    """A question a user would ask about the command, function, file format or topic of a man page (without the page:
    the target answers from what it knows)."""
    name, summary = page.name, page.summary.rstrip(".")
    if not summary or len(summary.split()) < 3 or page.language != "en":
        return None
    section = page.section[:1]
    if section in "18" and not name.isupper():
        how_to = [f"How do I {_lower_first(summary)} from the Linux command line?",
                  f"What is the `{name}` command used for?", f"How do I use `{name}`? Give a few examples.",
                  f"Explain the {name} command and its most useful options."]
        how_to += [f"With `{name}`, how do I {_lower_first(description.split('. ')[0].rstrip('.'))}?"
                   for _, description in page.options[:40] if _starts_with_verb(description)][:3]
        how_to += [f"What is the difference between `{name}` and `{other}`?" for other in page.see_also[:2]
                   if other != name]
        return rng.choice(how_to)
    if section in "23":
        if "perl" in page.source or "::" in name:
            return rng.choice([f"What is the Perl module {name} for? Show how to use it.",
                               f"How do I use {name} in Perl to {_lower_first(summary)}?"])
        return rng.choice([f"What does the C function `{name}()` do? Show a short example.",
                           f"In C, how do I {_lower_first(summary)}?",
                           f"Explain how to use `{name}` in a C program, with an example."])
    if section == "7" and name.isupper():
        return rng.choice([f"How do I use the SQL {name} command?", f"In SQL, how do I {_lower_first(summary)}?",
                           f"Explain PostgreSQL's {name} statement with an example."])
    if section == "5":
        return rng.choice([f"What is the `{name}` file for, and what does its format look like?",
                           f"Explain the purpose of {name}: {summary}."])
    return rng.choice([f"Give me an overview of {_lower_first(summary)}.",
                       f"Explain {name} ({summary}) to a beginner."])


def _starts_with_verb(description: str) -> bool:
    first = description.split(" ", 1)[0]
    return first.isalpha() and first[0].isupper() and not first.endswith(("s", "ed", "ing")) and len(
        description.split(". ")[0].split()) <= 16


EXPLAIN_ASKS = ["Explain this in simple terms:", "What is this about? Explain it to me like I'm new to the topic.",
                "Can you explain what the following means?", "Help me understand this text:",
                "I don't understand this part of the documentation. Can you explain it?"]


def explain_passage(passage: Passage, rng: random.Random) -> str:
    return f"{rng.choice(EXPLAIN_ASKS)}\n\n{passage.text}"


def module_question(title: str, rng: random.Random) -> str:
    return rng.choice([f"What is the Python module `{title}` used for? Show a short example.",
                       f"Explain what `{title}` does in Python and when I would use it.",
                       f"Give me a quick introduction to `{title}` with example code."])


# --- summarization ---------------------------------------------------------------------------------------------------

SUMMARY_BEFORE = ["Summarize the following text:", "Summarize this in two or three sentences:",
                  "Can you give me a short summary of this?", "Write a one-sentence summary of the following text.",
                  "Summarize the key points of this passage as a bulleted list:", "TL;DR this for me:",
                  "Give a brief summary of the following documentation excerpt.", "Summarize:"]
SUMMARY_AFTER = ["Summarize the text above in one paragraph.", "What are the main points of this text?",
                 "Summarize the above in a few sentences.", "Please write a concise summary of the passage above."]


def summarization_prompt(passage: Passage, rng: random.Random) -> str:
    if rng.random() < 0.3:
        return f"{passage.text}\n\n{rng.choice(SUMMARY_AFTER)}"
    return f"{rng.choice(SUMMARY_BEFORE)}\n\n{passage.text}"


# --- translation -----------------------------------------------------------------------------------------------------

TO_LANGUAGE = ["Translate the following text into {language}:\n\n{text}", "Translate to {language}: {text}",
               "How would you say this in {language}?\n\n{text}",
               "Please translate this paragraph from English to {language}.\n\n{text}",
               "{text}\n\nTranslate the text above into {language}.",
               "Can you translate this into {language} for me?\n\n{text}"]
FROM_LANGUAGE = ["Translate the following {language} text into English:\n\n{text}",
                 "What does this mean in English?\n\n{text}", "Translate to English: {text}",
                 "Please translate this from {language} to English.\n\n{text}",
                 "{text}\n\nTranslate this into English."]


def translation_prompt(text: str, language: str, to_english: bool, rng: random.Random) -> str:
    """A request to translate `text` into `language` (from English), or from `language` into English."""
    templates = FROM_LANGUAGE if to_english else TO_LANGUAGE
    return rng.choice(templates).format(language=LANGUAGES[language.split("_")[0]], text=text)


def message_list_prompt(messages: list[str], language: str, to_english: bool, rng: random.Random) -> str:
    """Several user-interface messages of one program to translate at once."""
    name = LANGUAGES[language.split("_")[0]]
    numbered = "\n".join(f"{index}. {message}" for index, message in enumerate(messages, start=1))
    if to_english:
        ask = rng.choice([f"Translate these {name} messages into English:",
                          f"These are error messages from a program in {name}. What do they say in English?"])
    else:
        ask = rng.choice([f"Translate these user-interface messages into {name}:",
                          f"I'm localizing my program. Translate each of these messages into {name}:"])
    return f"{ask}\n\n{numbered}"


# --- question answering over a passage -------------------------------------------------------------------------------

QA_FORMATS = ["Read the passage and answer the question.\n\nPassage:\n{passage}\n\nQuestion: {question}",
              "{passage}\n\nBased on the text above, {question_lower}",
              "Answer the question using only the information in the text below.\n\nQuestion: {question}\n\n{passage}",
              "Context:\n{passage}\n\nQuestion: {question}",
              "Here is an excerpt from the documentation of {title}:\n\n{passage}\n\n{question}"]

_CONDITION = re.compile(r"^(If|When|Unless) ([^,;:]{8,90}), ([^;:]{8,})\.$")
_DEFINITION = re.compile(r"^(?:The |An? )?((?:[A-Za-z][\w-]*\s){0,3}[A-Za-z][\w-]*) (is|are) (?:a|an|the|used|"
                         r"responsible|designed|intended|similar) ")
_STOP_SUBJECTS = {"this", "it", "there", "that", "which", "these", "they", "what", "here", "default", "option"}


_DEFAULTS = re.compile(r"^(?:The |By default, the )?((?:[\w-]+\s){0,4}[\w-]+) defaults to ")


def passage_questions(passage: Passage) -> list[str]:
    """Questions whose answers are stated in the passage: "what happens if ...?" from conditional sentences, "what is
    X?" from definitions, "what does X default to?", and "what does <title> do?" when a sentence says so."""
    questions = []
    subject = re.compile(rf"^(?:The )?{re.escape(passage.title)}(?:\(\))?(?: command| utility| program| function| "
                         rf"module| library)? [a-z]+s\b") if passage.title else None
    for sentence in re.split(r"(?<=[.!?])\s+", passage.text.replace("\n\n", " ")):
        condition, definition = _CONDITION.match(sentence), _DEFINITION.match(sentence)
        default = _DEFAULTS.match(sentence)
        if condition:
            word = {"If": "if", "When": "when", "Unless": "unless"}[condition.group(1)]
            questions.append(f"According to the text, what happens {word} {condition.group(2)}?")
        elif definition and definition.group(1).lower().split()[0] not in _STOP_SUBJECTS:
            article = "" if definition.group(1)[:1].isupper() else "the "
            questions.append(f"According to the passage, what {definition.group(2)} {article}{definition.group(1)}?")
        elif default and default.group(1).lower().split()[0] not in _STOP_SUBJECTS:
            questions.append(f"According to the text, what does {_lower_first(default.group(0).split(' defaults')[0])} "
                             "default to?")
        elif subject is not None and subject.match(sentence):
            questions.append(f"According to the passage, what does {passage.title} do?")
    return list(dict.fromkeys(questions))


def passage_qa_prompt(passage: Passage, rng: random.Random) -> str | None:
    """One question (or, sometimes, two or three) about a passage, in one of [`QA_FORMATS`]."""
    questions = passage_questions(passage)
    if not questions:
        return None
    rng.shuffle(questions)
    if len(questions) >= 2 and rng.random() < 0.3:
        question = "Answer these questions about the text:\n" + "\n".join(
            f"{index}. {text}" for index, text in enumerate(questions[:3], start=1))
    else:
        question = questions[0]
    return _qa_format(passage.text, question, passage.title, rng)


def _qa_format(passage: str, question: str, title: str, rng: random.Random) -> str:
    question_lower = question[0].lower() + question[1:]
    return rng.choice(QA_FORMATS).format(passage=passage, question=question, question_lower=question_lower,
                                         title=title)


def options_qa_prompt(page: ManPage, rng: random.Random, max_words: int = 350) -> str | None:
    """An excerpt of a page's OPTIONS (a run of consecutive options) and a question about one option in it."""
    if len(page.options) < 3 or page.language != "en":
        return None
    start = rng.randrange(len(page.options))
    excerpt, words = [], 0
    for tag, description in page.options[start:start + 8]:
        words += len(tag.split()) + len(description.split())
        if excerpt and words > max_words:
            break
        excerpt.append((tag, description))
    if len(excerpt) < 2:
        return None
    tag = rng.choice(excerpt)[0].split(",")[0].split()[0].split("=")[0]
    text = "\n".join(f"{option}\n    {description}" for option, description in excerpt)
    question = rng.choice([f"According to the manual excerpt, what does the `{tag}` option of {page.name} do?",
                           f"What is the effect of `{tag}` when running {page.name}?",
                           f"Which option in this excerpt would I use to {_lower_first(_purpose(excerpt, tag))}?"])
    return _qa_format(text, question, f"`{page.name}`", rng)


def _purpose(excerpt: list[tuple[str, str]], tag: str) -> str:
    """The first sentence of the description of the option `tag`, to ask which option does it."""
    description = next(description for option, description in excerpt if option.startswith(tag))
    return description.split(". ")[0].rstrip(".")


# --- rewriting -------------------------------------------------------------------------------------------------------

REWRITE_ASKS = ["Rewrite the following text in a more formal tone:",
                "Rewrite this so that a beginner can understand it:",
                "Simplify this text:", "Make this shorter while keeping the main points:",
                "Shorten the following paragraph to about half its length.",
                "Turn the following text into a list of bullet points:", "Paraphrase the following paragraph:",
                "Rewrite this in a friendly, casual tone:",
                "Rewrite this paragraph in the active voice where possible:",
                "Rewrite the following as a short email to my team:", "Make this text clearer and more concise:"]
GRAMMAR_ASKS = ["Fix the grammar and spelling mistakes in this text:",
                "Proofread the following paragraph and correct any errors:", "Correct the grammar:",
                "Can you fix the typos and grammar in this?"]
_SWAPPED_WORDS = {"its": "it's", "it's": "its", "their": "there", "there": "their", "is": "are", "are": "is",
                  "than": "then", "then": "than", "your": "you're", "affect": "effect", "effect": "affect"}


def corrupt_grammar(text: str, rng: random.Random, num_errors: int) -> str:
    """`text` with `num_errors` plausible mistakes: typos, confused words, dropped articles, doubled words."""
    words = text.split(" ")
    for _ in range(num_errors):
        index = rng.randrange(len(words))
        word = words[index]
        bare = word.strip(".,;:!?").lower()
        if bare in _SWAPPED_WORDS:
            words[index] = word.lower().replace(bare, _SWAPPED_WORDS[bare], 1)
        elif bare in ("the", "a", "an") and rng.random() < 0.7:
            words[index] = ""
        elif len(word) > 4 and word.isalpha():
            position = rng.randrange(1, len(word) - 2)
            words[index] = word[:position] + word[position + 1] + word[position] + word[position + 2:]
        elif word.isalpha():
            words[index] = f"{word} {word}"
    return re.sub(r" {2,}", " ", " ".join(words))


def rewriting_prompt(passage: Passage, rng: random.Random) -> str:
    if rng.random() < 0.25:
        num_errors = max(3, passage.num_words // 25)
        return f"{rng.choice(GRAMMAR_ASKS)}\n\n{corrupt_grammar(passage.text, rng, num_errors)}"
    return f"{rng.choice(REWRITE_ASKS)}\n\n{passage.text}"
