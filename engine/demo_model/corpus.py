"""The demo model's training text: docstrings of the running interpreter's standard library.

Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` is parsed with ``ast`` in sorted
path order (tests, site-packages and a few code-heavy trees skipped; files that fail to parse
skipped), and the docstrings of its module, classes and functions are taken with
``ast.get_docstring``. Each is dedented and kept only if it reads as prose: doctest sessions
(``>>>`` lines) and indented code blocks are dropped, and a docstring left mostly without
letters is skipped. The result is a few MB of English, the same on every run of the same Python
patch version, with no network and no files outside the interpreter.
"""

from __future__ import annotations

import ast
import re
import sysconfig
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path

# Folders (any path component) whose docstrings are skipped: tests, third-party code, and trees
# that are mostly code samples or generated tables.
_SKIPPED_DIRS = frozenset(
    {
        "test",
        "tests",
        "site-packages",
        "dist-packages",
        "idlelib",
        "turtledemo",
        "lib2to3",
        "ensurepip",
        "__pycache__",
        "encodings",
        "pydoc_data",
        "config-3.11-x86_64-linux-gnu",
    }
)
_MIN_DOCSTRING_CHARS = 24
_MIN_LETTER_FRACTION = 0.6
_WORD = re.compile(r"[A-Za-z]+")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[Path]:
    """The stdlib ``.py`` files whose docstrings go into the corpus, in sorted order."""
    root = stdlib_dir() if root is None else root
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if any(part in _SKIPPED_DIRS or part.startswith("config-") for part in parts):
            continue
        files.append(path)
    return files


def file_docstrings(path: Path) -> Iterator[str]:
    """Raw docstrings of the module, classes and functions in one file, in source order."""
    try:
        source = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source, filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=True)
            if docstring:
                yield docstring


def clean_docstring(docstring: str) -> str | None:
    """Prose of one docstring, or None if too little of it is prose.

    Doctest sessions (a ``>>>`` line with the output lines after it) and indented blocks (code
    examples after ``::``) are dropped; runs of blank lines collapse to one.
    """
    kept: list[str] = []
    in_doctest = False
    for raw in docstring.expandtabs(4).splitlines():
        line = raw.rstrip()
        stripped = line.lstrip()
        if stripped.startswith((">>>", "...")):
            in_doctest = True
            continue
        if in_doctest:
            if not stripped:
                in_doctest = False
            continue
        if line.startswith("    "):
            continue  # an indented block: code, a table or a nested listing
        if not stripped and kept and not kept[-1]:
            continue
        kept.append(line)
    text = "\n".join(kept).strip()
    if len(text) < _MIN_DOCSTRING_CHARS:
        return None
    non_space = sum(not c.isspace() for c in text)
    letters = sum(c.isalpha() for c in text)
    if letters < _MIN_LETTER_FRACTION * non_space:
        return None
    return text


def iter_documents(root: Path | None = None) -> Iterator[str]:
    """Cleaned docstrings, one document each, in a fixed order."""
    for path in source_files(root):
        for docstring in file_docstrings(path):
            text = clean_docstring(docstring)
            if text is not None:
                yield text


@cache
def corpus_documents() -> tuple[str, ...]:
    """All documents of the corpus, cached per process; duplicates kept once, first wins."""
    seen: set[str] = set()
    documents = []
    for text in iter_documents():
        if text not in seen:
            seen.add(text)
            documents.append(text)
    return tuple(documents)


def corpus_words(min_length: int = 2) -> frozenset[str]:
    """Lowercased alphabetic words of the corpus with at least ``min_length`` letters."""
    return frozenset(
        word.lower()
        for text in corpus_documents()
        for word in _WORD.findall(text)
        if len(word) >= min_length
    )


if __name__ == "__main__":
    docs = corpus_documents()
    total = sum(len(d) for d in docs)
    print(f"{len(docs)} documents, {total / 1e6:.2f} M characters, {len(corpus_words())} words")
