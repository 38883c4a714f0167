"""Incremental detokenization: deltas add up to the decoded text; a stop string is matched
across token boundaries and no part of it ever reaches a delta; split characters come whole."""

from __future__ import annotations

from components.serving.detokenizer import TextStream


def _feed(stream: TextStream, tokens: list[int], per_push: int = 1) -> list[str]:
    deltas = [stream.push(tokens[i:i + per_push]) for i in range(0, len(tokens), per_push)]
    return deltas + [stream.finish()]


def test_deltas_add_up_to_the_text(tiny_target):
    tok = tiny_target.tokenizer
    ids = tok.encode("def read(path):\n    return open(path).read()\n")
    for per_push in (1, 3):
        stream = TextStream(tok)
        assert "".join(_feed(stream, ids, per_push)) == tok.decode(ids, skip_special_tokens=True) == stream.text


def test_stop_string_across_tokens_never_leaks(tiny_target):
    tok = tiny_target.tokenizer
    text = "def read(path):\n    return open(path).read()\n"
    ids = tok.encode(text)
    stop = "n open("  # spans several tokens
    assert stop in text
    stream = TextStream(tok, stop=[stop, "never there"])
    deltas = _feed(stream, ids)
    assert "".join(deltas) == text[:text.index(stop)]
    assert stream.stopped == stop and stream.stop_at_token < len(ids)
    assert all(not stop.startswith(d) or not d for d in deltas[-3:])  # held back, then dropped
    assert tok.decode(ids[:stream.stop_at_token]).find(stop) >= 0  # stopped at the token that completed it
    included = TextStream(tok, stop=[stop], include_stop=True)
    assert "".join(_feed(included, ids)) == text[:text.index(stop) + len(stop)]


def test_held_back_prefix_is_released_when_no_stop_follows(tiny_target):
    tok = tiny_target.tokenizer
    ids = tok.encode("return x\n")
    stream = TextStream(tok, stop=["x\nEND"])
    deltas = _feed(stream, ids)
    assert "".join(deltas) == "return x\n" and stream.stopped is None
    assert "x" not in "".join(deltas[:-1])  # "x\n" waited: it could have begun the stop string


def test_split_utf8_character_comes_out_whole(tiny_target):
    tok = tiny_target.tokenizer
    ids = tok.encode("é€")  # byte-level BPE: rare characters are several tokens
    stream = TextStream(tok)
    deltas = _feed(stream, ids)
    assert "".join(deltas) == "é€"
    assert all("\ufffd" not in d for d in deltas)
