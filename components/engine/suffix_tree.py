"""A depth-limited suffix trie: exact occurrence counts of every token string of length ≤
``max_depth`` in a set of token sequences, grown a token at a time, sequences removable, each
count always equal to a brute-force count over the sequences it holds (``SuffixTree``; suffix
decoding's data structure, ``suffix.py``).

The trie is stored lazily so that memory and time follow the repeats, not ``max_depth``: a node
seen once stores no children, only where its one occurrence continues (``_Node.seq/pos``); it
grows children when a second occurrence arrives. Appending a token touches one node per repeated
suffix of the sequence, and a match of m tokens costs O(m log m) steps (galloping over the
length). In CPython the global tree costs about 0.2 KB per kept token on varied text and up to
~1 KB on text that repeats itself, hence the token bound (``max_cached_tokens``) beside vLLM's
count of responses. At most one sequence of a tree grows at a time here (a request's; a response
is added whole), though the tree stays exact if several do.

Knows token ids only; nothing about drafting, scores or the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class _Node:
    """The string spelled by the path to it: how many times it occurs (``count``), and either its
    children (token → node) or, while it occurs once, where that occurrence goes on
    (``seqs[seq][pos:]``, up to the tree's depth) with ``children`` None."""

    __slots__ = ("children", "count", "pos", "seq")

    def __init__(self, count: int, children: dict[int, _Node] | None, seq: int = -1, pos: int = 0):
        self.count, self.children, self.seq, self.pos = count, children, seq, pos


@dataclass
class Walk:
    """A greedy walk down the trie (``SuffixTree.draft``): per token, its estimated probability
    (the running product of count / total), the length of the string it was read after, and
    ``total``, how many occurrences of that string had a next token (the evidence behind the
    ratio: 1 along a continuation seen once); ``ran_out`` where nothing followed."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)
    ran_out: bool = False

    def add(self, tokens: Sequence[int], probs: Sequence[float], depths: Iterable[int], totals: Sequence[int]) -> None:
        self.tokens += tokens
        self.probs += probs
        self.depths += depths
        self.totals += totals


@dataclass
class _Place:
    """A string's place in the trie: the deepest stored node on its path and how many tokens
    further it reads along that node's one occurrence (``extra`` > 0 only below a lone node)."""

    node: _Node
    depth: int  # the string's length
    extra: int = 0


class SuffixTree:
    """Occurrence counts of every string of ≤ ``max_depth`` tokens in ``seqs`` (exact)."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be at least 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(0, {})  # count: tokens held (every token starts one suffix)
        self.seqs: dict[int, list[int]] = {}
        self._open: dict[int, list[tuple[_Node, int]]] = {}  # seq → (node, depth) of its repeated suffixes

    # ------------------------------------------------------------------ growing and shrinking
    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Appends ``tokens`` to sequence ``seq_id`` (a new one if unknown; not a closed one)."""
        if seq_id in self.seqs and seq_id not in self._open:
            raise ValueError(f"sequence {seq_id} is closed")
        seq = self.seqs.setdefault(seq_id, [])
        open_ = self._open.setdefault(seq_id, [])
        for token in tokens:
            seq.append(int(token))
            open_ = self._append(seq_id, seq, open_, int(token))
        self._open[seq_id] = open_

    def close(self, seq_id: int) -> None:
        """Sequence ``seq_id`` will not grow again (its bookkeeping for appends is dropped)."""
        self._open.pop(seq_id, None)

    def _append(self, seq_id: int, seq: list[int], open_: list[tuple[_Node, int]],
                token: int) -> list[tuple[_Node, int]]:
        """One more occurrence of every suffix that now ends in ``token`` (seq[-1]); returns the
        (node, depth) of those that occurred before, deepest last, the only ones to touch next."""
        self.root.count += 1
        grown: list[tuple[_Node, int]] = []
        for node, depth in [(self.root, 0)] + open_:  # suffixes that occurred before, shortest first
            child = node.children.get(token)  # type: ignore[union-attr]  # open nodes have children
            if child is None:  # a first occurrence: stored lone, read on from the sequence
                node.children[token] = _Node(1, None, seq_id, len(seq))  # type: ignore[index]
                continue
            if child.children is None:  # the second occurrence of a lone string: give it children
                self._split(child, depth + 1)
            child.count += 1
            if depth + 1 < self.max_depth:
                grown.append((child, depth + 1))
        return grown

    def _split(self, node: _Node, depth: int) -> None:
        """A lone node (one occurrence) gets its one child explicitly, if that occurrence goes on;
        if it ends where its sequence is still growing, that sequence's next appends extend it."""
        seq = self.seqs[node.seq]
        node.children = {}
        if depth < self.max_depth and node.pos < len(seq):
            node.children[seq[node.pos]] = _Node(1, None, node.seq, node.pos + 1)
        elif depth < self.max_depth and node.seq in self._open:
            self._open[node.seq].append((node, depth))
        node.seq = -1

    def remove(self, seq_id: int) -> None:
        """Drops sequence ``seq_id``: every string's count loses its occurrences there."""
        seq = self.seqs.pop(seq_id)
        self._open.pop(seq_id, None)
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for token in seq[start:start + self.max_depth]:
                child = node.children[token]  # type: ignore[index]  # a count ≥ 2 node has children
                if child.count == 1:  # only this occurrence: the whole branch below is its own
                    del node.children[token]  # type: ignore[union-attr]
                    break
                child.count -= 1
                node = child

    # ------------------------------------------------------------------ reading
    def find(self, string: Sequence[int]) -> _Place | None:
        """Where ``string`` (≤ max_depth tokens) is in the trie; None if it never occurred."""
        node, extra = self.root, 0
        for token in string:
            if node.children is not None:
                child = node.children.get(token)
                if child is None:
                    return None
                node = child
                continue
            seq, at = self.seqs[node.seq], node.pos + extra
            if at >= len(seq) or seq[at] != token:
                return None
            extra += 1
        return _Place(node, len(string), extra)

    def count(self, string: Sequence[int]) -> int:
        """Occurrences of ``string`` (1 ≤ length ≤ max_depth) in the sequences held."""
        place = self.find(string)
        return 0 if place is None else place.node.count

    def next_counts(self, place: _Place) -> dict[int, int]:
        """Next token → how many of the string's occurrences it follows (none at max_depth)."""
        node = place.node
        if place.depth >= self.max_depth:
            return {}
        if node.children is not None:
            return {token: child.count for token, child in node.children.items()}
        seq, at = self.seqs[node.seq], node.pos + place.extra
        return {seq[at]: 1} if at < len(seq) else {}

    def goes_on(self, place: _Place) -> bool:
        """Whether anything followed the string (``next_counts`` is not empty), without
        gathering the counts: a node near the root of a large tree has thousands of children."""
        node = place.node
        if place.depth >= self.max_depth:
            return False
        if node.children is not None:
            return bool(node.children)
        return node.pos + place.extra < len(self.seqs[node.seq])

    def longest_match(self, pattern: Sequence[int], max_len: int) -> _Place | None:
        """The longest suffix of ``pattern`` (≤ ``max_len`` tokens) that occurred with a next
        token, found by galloping over the length (having one is monotone: a suffix of a string
        that went on went on too); None when not even its last token did."""
        def place(m: int) -> _Place | None:
            found = self.find(pattern[len(pattern) - m:])
            return found if found is not None and self.goes_on(found) else None

        top = min(max_len, len(pattern), self.max_depth - 1)
        best, good, bad = None, 0, top + 1  # longest length known to match, shortest known to fail
        m = 1
        while good < top:  # gallop: 1, 2, 4, ..., top until a length fails
            found = place(m)
            if found is None:
                bad = m
                break
            best, good, m = found, m, min(2 * m, top)
        while bad - good > 1:  # bisect between them
            mid = (good + bad) // 2
            found = place(mid)
            best, good, bad = (found, mid, bad) if found is not None else (best, good, mid)
        return best

    def draft(self, place: _Place, max_tokens: int, min_prob: float, prob: float = 1.0) -> Walk:
        """The greedy walk from ``place``: the most frequent next token (ties: the smaller id)
        while the running product (from ``prob``) of count / total stays ≥ ``min_prob``, at most
        ``max_tokens``. It runs out where nothing followed (a sequence's end) or at ``max_depth``."""
        walk = Walk()
        node, depth, extra = place.node, place.depth, place.extra
        while len(walk.tokens) < max_tokens:
            if depth >= self.max_depth:
                walk.ran_out = True
                break
            if node.children is None:  # one occurrence: its continuation, probability unchanged
                seq, at = self.seqs[node.seq], node.pos + extra
                run = seq[at:at + min(max_tokens - len(walk.tokens), self.max_depth - depth)]
                walk.add(run, [prob] * len(run), range(depth, depth + len(run)), [1] * len(run))
                walk.ran_out = len(walk.tokens) < max_tokens
                break
            best, best_count, total = -1, 0, 0
            for token, child in node.children.items():
                total += child.count
                if child.count > best_count or (child.count == best_count and token < best):
                    best, best_count = token, child.count
            if total == 0:
                walk.ran_out = True
                break
            prob *= best_count / total
            if prob < min_prob:
                break
            walk.add([best], [prob], [depth], [total])
            node, depth, extra = node.children[best], depth + 1, 0
        return walk
