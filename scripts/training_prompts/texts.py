"""Natural-language text on the machine: rendered man pages, /usr/share/doc files and gettext message catalogs.

Man pages are rendered once by `man` (groff) at a width of 1000 columns, so that every filled paragraph is one line,
and cached as text; everything else is read directly. Nothing here is written into prompts yet: see `tasks.py`.
"""

from __future__ import annotations

import gettext
import gzip
import hashlib
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Passage:
    """Prose from one source unit.

    Attributes:
        source: the unit that decides the train / held-out side (a man page, a doc file, a Python file).
        title: what the passage is about (a command, a module, a package), for questions and instructions.
        text: paragraphs separated by blank lines.
        language: ISO 639-1 code of the text.
    """

    source: str
    title: str
    text: str
    language: str = "en"

    @property
    def num_words(self) -> int:
        return text_size(self.text, self.language)


@dataclass
class ManPage:
    """A rendered man page: `name - summary`, its sections as paragraphs, and its options as (tag, description)."""

    source: str
    name: str
    section: str
    summary: str
    language: str
    paragraphs: dict[str, list[str]] = field(default_factory=dict)
    options: list[tuple[str, str]] = field(default_factory=list)
    see_also: list[str] = field(default_factory=list)


# --- man pages -------------------------------------------------------------------------------------------------------

def render_man_page(path: Path, cache_dir: Path) -> str | None:
    """The plain text of a man page source file, one filled paragraph per line; `None` when `man` fails on it."""
    cached = cache_dir / (hashlib.sha1(str(path).encode()).hexdigest() + ".txt")
    if cached.is_file():
        return cached.read_text(encoding="utf-8") or None
    env = {**os.environ, "MANWIDTH": "1000", "LC_ALL": "C.UTF-8", "MAN_KEEP_FORMATTING": ""}
    try:
        result = subprocess.run(["man", "-E", "UTF-8", "-P", "cat", "-l", str(path)], capture_output=True,
                                env=env, timeout=30)
        text = result.stdout.decode("utf-8", errors="replace") if result.returncode == 0 else ""
    except (subprocess.TimeoutExpired, OSError):
        text = ""
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(text, encoding="utf-8")
    return text or None


_OPTION_TAG = re.compile(r"^-{1,2}\w")
_SEE_ALSO_ITEM = re.compile(r"([\w.:+-]+)\((\d\w*)\)")


def parse_man_page(text: str, source: str, section: str, language: str) -> ManPage | None:
    """Sections (the paragraphs at a section's base indent, 7 columns), options (a `-x` tag followed by a
    deeper-indented description) and the NAME line of a page rendered by [`render_man_page`]."""
    lines = text.splitlines()[1:-1]  # the header and footer lines
    page = ManPage(source=source, name="", section=section, summary="", language=language)
    header, base, index = None, None, 0
    while index < len(lines):
        line = lines[index]
        indent = len(line) - len(line.lstrip())
        stripped = line.strip()
        index += 1
        if not stripped or indent == 0:
            header, base = (stripped, None) if stripped else (header, base)
            continue
        if header is None or indent < 4:  # before the first section, or a subsection title
            continue
        base = indent if base is None else min(base, indent)
        following = lines[index] if index < len(lines) else ""
        following_indent = len(following) - len(following.lstrip())
        if _OPTION_TAG.match(stripped) and following.strip() and following_indent > indent:
            page.options.append((stripped, following.strip()))
            index += 1
        elif indent == base and (not following.strip() or following_indent != indent):
            page.paragraphs.setdefault(header, []).append(re.sub(r"\s+", " ", stripped))
        # deeper lines (an option's further paragraphs, nested lists, examples) and runs of lines at one indent
        # (no-fill blocks: code, tables) are not prose of the section
    name_lines = next(iter(page.paragraphs.values()), [])
    if not name_lines or " - " not in name_lines[0]:
        return None
    names, page.summary = (part.strip() for part in name_lines[0].split(" - ", 1))
    page.name = names.split(",")[0].strip()
    see_also = [paragraphs for title, paragraphs in page.paragraphs.items()
                if title.upper() in ("SEE ALSO", "SIEHE AUCH")]
    page.see_also = [name for paragraphs in see_also for text in paragraphs for name, _ in _SEE_ALSO_ITEM.findall(text)]
    return page


def man_page_files(man_root: Path, folder: str = "", max_per_prefix: int = 200) -> list[tuple[Path, str]]:
    """(file, section) of the pages of `man_root` (or of its language `folder`, e.g. "de"), sorted, with at most
    `max_per_prefix` pages per leading name part (the 16,000 generated `gcloud_*` pages would drown the rest)."""
    root = man_root / folder if folder else man_root
    files, per_prefix = [], {}
    for section_folder in sorted(root.glob("man[1-8]")):
        for path in sorted(section_folder.iterdir()):
            if not path.is_file():
                continue
            prefix = re.split(r"[_.-]", path.name, maxsplit=1)[0]
            per_prefix[prefix] = per_prefix.get(prefix, 0) + 1
            if per_prefix[prefix] <= max_per_prefix:
                files.append((path, section_folder.name[3:]))
    return files


def man_pages(man_root: Path, cache_dir: Path, folder: str = "", language: str = "en") -> Iterator[ManPage]:
    """Every page of [`man_page_files`] that renders and has a NAME line; `language` is its ISO 639-1 code."""
    for path, section in man_page_files(man_root, folder):
        text = render_man_page(path, cache_dir)
        if text:
            page = parse_man_page(text, f"man:{folder or 'en'}:{path.name}", section, language)
            if page is not None:
                yield page


# --- prose -----------------------------------------------------------------------------------------------------------

_STOPWORDS = {
    "en": "the of and to is in that it for be are with as this by on not or which an if can from",
    "fr": "le la les de des du et est un une pour que dans sur pas par qui avec ce au sont être",
    "es": "el la los las de del y es un una para que en por con no se su al como",
    "de": "der die das und ist ein eine zu den nicht mit von für auf des dem sich werden wird",
    "it": "il lo la gli le di del della e è un una per che non con su sono al come",
    "pt": "o a os as de do da e é um uma para que em não com por se no na",
}
_STOPWORDS = {language: set(words.split()) for language, words in _STOPWORDS.items()}


def language_score(text: str, language: str) -> float:
    """Fraction of the words of `text` that are common function words of `language` (CJK characters for "zh")."""
    if language == "zh":
        return sum("\u4e00" <= char <= "\u9fff" for char in text) / max(1, len(text.replace(" ", "")))
    words = re.findall(r"[^\W\d_]+", text.lower())
    return sum(word in _STOPWORDS[language] for word in words) / max(1, len(words))


def is_language(text: str, language: str) -> bool:
    """Whether `text` reads as `language` rather than English (or, for "en", as English)."""
    if language == "zh":
        return language_score(text, "zh") > 0.3
    if language == "en":
        return language_score(text, "en") > 0.12 and all(language_score(text, other) < language_score(text, "en")
                                                          for other in ("fr", "es", "de", "it", "pt"))
    return language_score(text, language) > 0.12 and language_score(text, language) > 1.5 * language_score(text, "en")


def is_prose(paragraph: str, language: str = "en") -> bool:
    """Whether a paragraph is running text (sentences of words) rather than code, a table, a list of names or a URL."""
    words = paragraph.split()
    if language != "zh" and len(words) < 8:
        return False
    symbols = sum(char in "{}[]<>|=;$\\#*_@/" for char in paragraph)
    alphabetic = sum(word.strip(".,;:()'\"!?“”«»").isalpha() for word in words) / max(1, len(words))
    return (symbols / len(paragraph) < 0.03 and (alphabetic > 0.7 or language == "zh")
            and paragraph.rstrip()[-1] in ".!?:)\"”。" and is_language(paragraph, language))


def text_size(text: str, language: str = "en") -> int:
    """Words of `text`; for Chinese, which has no spaces, half its characters (about the same reading length)."""
    return len(text) // 2 if language == "zh" else len(text.split())


def group_paragraphs(paragraphs: list[str], min_words: int, max_words: int, language: str = "en") -> list[str]:
    """Consecutive paragraphs joined (blank-line separated) into passages of `min_words..max_words` words
    ([`text_size`]); a paragraph longer than `max_words` is cut at a sentence end."""
    passages, current = [], []
    for paragraph in paragraphs:
        paragraph = _cut_words(paragraph, max_words) if language != "zh" else paragraph
        if current and sum(text_size(p, language) for p in current + [paragraph]) > max_words:
            passages.append(current)
            current = []
        current.append(paragraph)
    passages.append(current)
    texts = ["\n\n".join(group) for group in passages if group]
    return [text for text in texts if min_words <= text_size(text, language) <= max_words]


def _cut_words(paragraph: str, max_words: int) -> str:
    words = paragraph.split()
    if len(words) <= max_words:
        return paragraph
    cut = " ".join(words[:max_words])
    end = max(cut.rfind(". "), cut.rfind("? "), cut.rfind("! "))
    return cut[:end + 1] if end > 0 else cut


_NOT_PROSE_SECTIONS = ("SYNOPSIS", "ÜBERSICHT", "SINOPSIS", "SYNTAXE", "COPYRIGHT", "AUTHOR", "SEE ALSO")


def man_page_passages(page: ManPage, min_words: int, max_words: int) -> list[Passage]:
    """Prose passages of each section of a page (NAME and SYNOPSIS left out)."""
    passages = []
    for title, paragraphs in list(page.paragraphs.items())[1:]:
        if title.upper().startswith(_NOT_PROSE_SECTIONS):
            continue
        prose = [p for p in paragraphs if is_prose(p, page.language)]
        passages += [Passage(page.source, page.name, text, page.language)
                     for text in group_paragraphs(prose, min_words, max_words, page.language)]
    return passages


# --- /usr/share/doc --------------------------------------------------------------------------------------------------

_DOC_NAMES = re.compile(r"^(readme|news|faq|intro|overview|history|usage|manual|tutorial|howto|metadata|"
                        r".*\.(txt|md|rst))(\.(md|txt|rst))?(\.gz)?$", re.IGNORECASE)
_NOT_DOCS = ("copyright", "changelog", "license", "licence", "copying", "notice", "authors", "requirements")
_MARKUP = re.compile(r"(^#+\s*|`+|\*\*|__|\[([^\]]*)\]\([^)]*\))")


def doc_files(doc_root: Path, max_bytes: int = 2_000_000) -> list[Path]:
    """README / NEWS / FAQ / *.txt / *.md / *.rst files (gzipped or not) and the METADATA of installed Python packages
    (their README) under `doc_root`, sorted; licences and change logs left out."""
    return sorted(path for path in doc_root.rglob("*")
                  if path.is_file() and _DOC_NAMES.match(path.name) and not any(
                      word in path.name.lower() for word in _NOT_DOCS) and path.stat().st_size < max_bytes)


def read_text_file(path: Path) -> str | None:
    """A (possibly gzipped) UTF-8 text file, `None` when it is not one."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def text_paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs with their lines joined, Markdown emphasis and links reduced to their words;
    indented blocks (code, tables) and headings with underlines are left out."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or lines[0].startswith(("    ", "\t", "```", ">", "|")):
            continue
        lines = [line for line in lines if not re.fullmatch(r"\s*[=\-~^*#]{3,}\s*", line)]
        joined = _MARKUP.sub(lambda match: match.group(2) or "", " ".join(line.strip() for line in lines))
        paragraphs.append(re.sub(r"\s+", " ", joined).strip())
    return [paragraph for paragraph in paragraphs if paragraph]


def paragraph_key(paragraph: str) -> str:
    """A paragraph's letters and digits, lower-cased: the same key however its lines were wrapped or marked up."""
    return re.sub(r"\W+", "", paragraph.lower())


def doc_passages(doc_root: Path, min_words: int, max_words: int, exclude: set[str]) -> list[Passage]:
    """Prose passages of [`doc_files`]; paragraphs whose [`paragraph_key`] is in `exclude` (used by an earlier prompt
    set) are left out."""
    passages = []
    for path in doc_files(doc_root) if doc_root.is_dir() else []:
        text = read_text_file(path)
        if text is None:
            continue
        relative = path.relative_to(doc_root)
        prose = [p for p in text_paragraphs(text) if paragraph_key(p) not in exclude and is_prose(p)]
        title = re.sub(r"-\d[^-]*\.(dist|egg)-info$", "", relative.parts[0])
        passages += [Passage(f"doc:{relative}", title, passage)
                     for passage in group_paragraphs(prose, min_words, max_words)]
    return passages


# --- gettext catalogs ------------------------------------------------------------------------------------------------

def catalog_messages(locale_root: Path, language: str, min_words: int = 6) -> list[tuple[str, str, str]]:
    """(catalog name, English msgid, translated msgstr) of the compiled catalogs of `language` (e.g. "fr", "pt_BR"),
    keeping sentence-like messages of at least `min_words` English words whose translation reads as that language."""
    messages = []
    for path in sorted((locale_root / language / "LC_MESSAGES").glob("*.mo")):
        try:
            with path.open("rb") as handle:
                catalog = gettext.GNUTranslations(handle)._catalog
        except (OSError, UnicodeDecodeError, ValueError, KeyError, IndexError):  # not a readable catalog
            continue
        for msgid, msgstr in sorted(catalog.items(), key=str):
            if not isinstance(msgid, str) or not msgid or not isinstance(msgstr, str) or msgstr == msgid:
                continue
            english = re.sub(r"\s+", " ", msgid.replace("&", "").replace("_", "")).strip()
            translated = re.sub(r"\s+", " ", msgstr.replace("&", "").replace("_", "")).strip()
            if (len(english.split()) >= min_words and "%" not in english and "<" not in english
                    and is_language(translated, language.split("_")[0]) and is_prose(english)):
                messages.append((path.stem, english, translated))
    return messages
