from pathlib import Path

import pytest

from components.target.corpus import (
    CorpusError,
    Document,
    conversations,
    is_heldout,
    load_documents,
    speeches,
    split_documents,
)

PLAY = """ACT 1
SCENE 1

[Enter a SHIPMASTER and a BOATSWAIN]

MASTER.
Boatswain! Where art thou, good fellow?

BOATSWAIN.
Here, master: what cheer? The wind is high.

[Exit]

MASTER.
Good! Speak to the mariners: fall to't yarely.

BOATSWAIN.
Heigh, my hearts! cheerly, cheerly, my hearts!
Take in the topsail.
"""


def test_speeches_and_conversations_from_a_play():
    said = speeches(PLAY)
    assert said[0] == "Boatswain! Where art thou, good fellow?"
    assert said[-1] == "Heigh, my hearts! cheerly, cheerly, my hearts! Take in the topsail."
    assert len(said) == 4
    convs = conversations(Document("shakespeare", "x", PLAY))
    assert [m["role"] for m in convs[0]] == ["user", "assistant", "user", "assistant"]
    assert convs[0][1]["content"].startswith("Here, master")


def test_split_is_deterministic_disjoint_and_keeps_every_source(tmp_path: Path):
    docs = [Document("a", f"doc{i}", "x" * 10) for i in range(50)] + [Document("b", "only1", "y"), Document("b", "only2", "z")]
    train, heldout = split_documents(docs, 0.1)
    assert {d.name for d in train}.isdisjoint({d.name for d in heldout})
    assert len(train) + len(heldout) == len(docs)
    assert {d.source for d in heldout} == {"a", "b"}
    assert split_documents(docs, 0.1) == (train, heldout)
    assert is_heldout(docs[0], 1.0) and not is_heldout(docs[0], 0.0)


def test_stdlib_source_is_available_offline(tmp_path: Path):
    docs = load_documents(["python_stdlib"], 200_000, tmp_path)
    assert docs and all(d.source == "python_stdlib" for d in docs)
    assert sum(len(d.text) for d in docs) <= 200_000


def test_unknown_source_is_a_clear_error(tmp_path: Path):
    with pytest.raises(CorpusError, match=r"unknown \['wikipedia'\]; known: \['python_stdlib', 'shakespeare'\]"):
        load_documents(["wikipedia"], 1000, tmp_path)
