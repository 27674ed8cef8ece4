"""Suffix decoding (SuffixDecoding, Oliaro et al.; vLLM's `suffix` method, Arctic Inference's algorithm):
drafts from a suffix tree of the request's own prompt + output and a global one of earlier requests' outputs.

Semantics (Arctic's, which vLLM calls): every substring of at most `max_tree_depth` tokens is counted once
per occurrence. For each match length m (1 .. depth - 1) at which the context's last m tokens occur, follow
the most frequent continuation (ties: the smaller token id) while its empirical probability -- the product
of count(x + c) / count(x) along the path -- stays >= min_token_prob, for at most min(k, m *
max_spec_factor) tokens; a draft scores the sum of its tokens' probabilities, the best score wins (the longer
match on a tie; the request's own tree over the global one unless the global scores higher).

Data structure: a trie of bounded depth whose single-occurrence subtrees are not materialized: a `_Tail`
stands for "the one occurrence continues as tokens[pos:]", so unique text (most of prose) costs one object
per position and grows for free as the request's tokens arrive. Each sequence keeps the suffixes that still
sit on materialized nodes (at most depth of them); one appended token steps only those. Requests' outputs
join the global trie when they finish; past `max_cached_requests` the oldest are removed (eviction in
insertion order, as Arctic's cache does).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

_STALE = -1  # a node's cached best child after a removal lowered a count: recomputed on use


class _Node:
    """A substring that occurs `count` >= 2 times (or did, before a removal)."""

    __slots__ = ("best", "children", "count")

    def __init__(self, count: int) -> None:
        self.count = count
        self.children: dict[int, _Node | _Tail] = {}
        self.best: int | None = None  # token of the child with the highest count (ties: smallest token)


class _Tail:
    """A substring with one occurrence: the path continues tokens[pos], tokens[pos + 1], ... up to `cap`
    (the occurrence's start + depth) or the end of its sequence, whichever comes first."""

    __slots__ = ("cap", "pos", "tokens")
    count = 1

    def __init__(self, tokens: list[int], pos: int, cap: int) -> None:
        self.tokens, self.pos, self.cap = tokens, pos, cap

    def chain(self) -> list[int]:
        return self.tokens[self.pos:min(len(self.tokens), self.cap)]


class _Sequence:
    """One indexed token sequence and its suffixes that still end on a materialized node."""

    __slots__ = ("frontier", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.frontier: list[tuple[_Node, int]] = []  # (node the suffix ends at, suffix start)


class SuffixTrie:
    """Occurrence counts of every substring of at most `depth` tokens of the sequences appended to it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(0)

    def append(self, seq: _Sequence, token: int) -> None:
        """Extend `seq` by one token: every suffix of its last `depth` positions grows by it."""
        pos = len(seq.tokens)
        seq.tokens.append(token)
        seq.frontier.append((self.root, pos))
        kept: list[tuple[_Node, int]] = []
        for node, start in seq.frontier:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Tail(seq.tokens, pos, start + self.depth)
                _raise_best(node, token, child)
                continue  # the suffix now lies in its own tail: it grows with seq.tokens at no cost
            if child.__class__ is _Tail:
                child = _split(node, token, child)
            else:
                child.count += 1
            _raise_best(node, token, child)
            if pos + 1 - start < self.depth:
                kept.append((child, start))
        seq.frontier = kept

    def remove(self, tokens: list[int]) -> None:
        """Forget every occurrence that a (finished) sequence with these tokens contributed."""
        for start in range(len(tokens)):
            node = self.root
            for pos in range(start, min(len(tokens), start + self.depth)):
                token = tokens[pos]
                child = node.children[token]
                node.best = _STALE
                if child.count == 1:  # this occurrence was the only one: drop the whole subtree
                    del node.children[token]
                    break
                child.count -= 1
                node = child

    def speculate(self, pattern: list[int], k: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float]:
        """The best-scoring draft (and its score) over all match lengths of `pattern`'s suffixes."""
        best: list[int] = []
        best_score = 0.0
        for m in range(1, len(pattern)):
            cursor = self._match(pattern, len(pattern) - m)
            if cursor is None:
                break  # a longer suffix cannot occur either
            node, rest = cursor
            if rest is not None and not rest:
                break  # one occurrence, nothing after it: longer matches are that same dead end
            draft, score = _follow(node, rest, min(k, int(m * max_spec_factor + 1e-6)), min_token_prob)
            if score >= best_score:
                best, best_score = draft, score
        return best, best_score

    def _match(self, pattern: list[int], start: int) -> tuple[_Node, list[int] | None] | None:
        """Where pattern[start:] ends: (node, None) on a node, (last node, chain left) inside a tail."""
        node = self.root
        for i in range(start, len(pattern)):
            child = node.children.get(pattern[i])
            if child is None:
                return None
            if child.__class__ is _Tail:
                chain, need = child.chain(), len(pattern) - i
                return (node, chain[need:]) if chain[:need] == pattern[i:] else None
            node = child
        return node, None


def _split(parent: _Node, token: int, tail: _Tail) -> _Node:
    """A second occurrence enters `tail`: its first position becomes a node of count 2."""
    node = _Node(2)
    parent.children[token] = node
    nxt = tail.pos + 1
    if nxt < min(len(tail.tokens), tail.cap):
        tail.pos = nxt
        node.children[tail.tokens[nxt]] = tail
        node.best = tail.tokens[nxt]
    return node


def _raise_best(node: _Node, token: int, child: _Node | _Tail) -> None:
    """Counts only grow between removals, so only the child that just grew can become the best."""
    best = node.best
    if best is None:
        node.best = token
    elif best != token and best != _STALE:
        rival = node.children[best].count
        if child.count > rival or (child.count == rival and token < best):
            node.best = token


def _best_child(node: _Node) -> int | None:
    if node.best == _STALE:
        node.best = min(node.children, key=lambda t: (-node.children[t].count, t), default=None)
    return node.best


def _follow(node: _Node, rest: list[int] | None, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """Greedy path from a match: the most frequent child while the path probability >= min_token_prob."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < max_tokens:
        if rest is not None:  # a single occurrence: every further token has conditional probability 1
            taken = rest[:max_tokens - len(draft)]
            draft += taken
            score += prob * len(taken)
            break
        token = _best_child(node)
        if token is None:
            break
        child = node.children[token]
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        if child.__class__ is _Tail:
            rest = child.chain()[1:]
        else:
            node = child
    return draft, score


class _LocalTree:
    """A running request's own trie over its prompt + verified output."""

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.seq = _Sequence()


class SuffixProposer:
    """vLLM's `suffix` speculative method (keys suffix_decoding_*)."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        if max_tree_depth < 1:
            raise ValueError(f"suffix_decoding_max_tree_depth must be >= 1, got {max_tree_depth}")
        if max_cached_requests < 0:
            raise ValueError(f"suffix_decoding_max_cached_requests must be >= 0, got {max_cached_requests}")
        self.depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _LocalTree] = {}
        self.global_trie = SuffixTrie(max_tree_depth)
        self._cached: OrderedDict[int, list[int]] = OrderedDict()  # insertion order = eviction order
        self._next_id = 0

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    def propose(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        if k <= 0:
            return []
        local = self._requests.get(req_id)
        done = len(local.seq.tokens) if local else 0
        if local is None or len(token_ids) < done or (done and token_ids[done - 1] != local.seq.tokens[-1]):
            local = self._requests[req_id] = _LocalTree(self.depth)  # new, or not an extension: rebuild
            done = 0
        for token in token_ids[done:]:
            local.trie.append(local.seq, token)
        pattern = list(token_ids[max(0, len(token_ids) - self.depth):])
        draft, score = local.trie.speculate(pattern, k, self.max_spec_factor, self.min_token_prob)
        if self._cached:
            other, other_score = self.global_trie.speculate(pattern, k, self.max_spec_factor, self.min_token_prob)
            if other_score > score:
                draft = other
        return draft

    def on_request_finished(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._requests.pop(req_id, None)
        output = list(token_ids[num_prompt_tokens:])
        if not output or self.max_cached_requests == 0:
            return
        seq = _Sequence()
        for token in output:
            self.global_trie.append(seq, token)
        self._cached[self._next_id] = seq.tokens
        self._next_id += 1
        while len(self._cached) > self.max_cached_requests:
            self.global_trie.remove(self._cached.popitem(last=False)[1])
