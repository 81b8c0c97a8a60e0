"""Guessing a sequence's next tokens without a draft model: a suffix index over what the engine has
already generated for the same prompt.

RL sends the same prompts back every epoch, the ``n`` samples of a group share long stretches, and a
sequence repeats itself. ``SuffixDrafter`` keeps, per prompt, the outputs it was given — finished
rollouts of earlier steps (``add_finished``; the oldest dropped past ``max_rollouts_per_prompt``, the
least recently used prompts' past ``max_tokens``) and sequences in flight (``update_live``: the
siblings of a group and the asking sequence itself). ``propose`` finds where the last ``min_match``
tokens of the asking context occurred before (through one hash per position), extends each match
backwards up to ``max_match`` tokens, keeps the longest matches, and follows them forward one token at
a time, taking the token most of the still-agreeing occurrences continue with. Each guess carries its
confidence — the share of the matched occurrences that continue with the proposed path so far — and
the proposal stops where that falls under ``min_confidence`` or after ``k`` tokens.

Memory: one list entry per indexed output token (prompts are not indexed but for their last
``max_match`` tokens: every rollout of a prompt starts with the same prompt) — up to ~200 bytes a
token in CPython (measured with distinct random tokens), so the default ``max_tokens`` of 500k holds
~100 MB. Dropped rollouts leave their entries behind until they outnumber the live ones, then the
prompt's index is rebuilt.

Nothing here touches tensors or decides correctness: a verifier accepts a guess only where it equals
the token the engine draws at that position (``rollout.layers.sampler``), so a wrong guess costs a
wasted position of a verify forward, never a different token. Weight versions only label what is
stored; which rollouts to keep across an update is the caller's rule (``drop_finished``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Optional

_SHIFT = 32  # an entry: (doc << _SHIFT) | end position


@dataclass
class Proposal:
    """Up to ``k`` guessed tokens and, for each, the share of matched occurrences agreeing up to it."""

    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    match_len: int = 0  # how many context tokens the occurrences matched (0: none)
    num_occurrences: int = 0


@dataclass(frozen=True)
class TreeNode:
    """A guessed token in a tree of guesses: its parent's index in the node list (-1: the root, right
    after the context), the token, its share of the matched occurrences, its depth (0: next token)."""

    parent: int
    token: int
    share: float
    depth: int


@dataclass
class _Doc:
    tokens: list[int]  # the prompt's indexed tail, then the output
    indexed: int  # positions whose n-gram entry is in the index
    version: Optional[str] = None
    finished: bool = False


class _PromptIndex:
    """The docs of one prompt and, per hash of ``min_match`` tokens, the positions that follow them."""

    def __init__(self):
        self.docs: dict[int, _Doc] = {}  # doc number -> doc
        self.finished: list[int] = []  # finished doc numbers, oldest first
        self.grams: dict[int, list[int]] = {}  # hash -> entries
        self.live_entries = 0
        self.dead_entries = 0
        self.next_doc = 0


class SuffixDrafter:
    """Suffix matching over one engine's past and live outputs, grouped by prompt. Not thread-safe: the
    engine loop's thread owns it."""

    def __init__(self, max_match: int = 16, min_match: int = 2, max_rollouts_per_prompt: int = 32,
                 max_tokens: int = 500_000, min_confidence: float = 0.2, max_scan: int = 128):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match} and {max_match}")
        if max_rollouts_per_prompt < 0 or max_tokens <= 0 or max_scan <= 0:
            raise ValueError("need max_rollouts_per_prompt >= 0, max_tokens > 0 and max_scan > 0")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence is a share in [0, 1], got {min_confidence}")
        self.max_match, self.min_match = max_match, min_match
        self.max_rollouts_per_prompt, self.max_tokens = max_rollouts_per_prompt, max_tokens
        self.min_confidence, self.max_scan = min_confidence, max_scan
        self._prompts: OrderedDict[Hashable, _PromptIndex] = OrderedDict()  # least recently used first
        self._live: dict[int, tuple[Hashable, int]] = {}  # seq id -> (prompt, doc number)
        self.num_tokens = 0  # tokens held by every doc (what ``max_tokens`` bounds)

    # ------------------------------------------------------------------ what is stored

    def update_live(self, prompt: Hashable, seq_id: int, prompt_len: int, tokens: Sequence[int]) -> None:
        """Sequence ``seq_id`` (in flight) now holds ``tokens``: its ``prompt_len`` prompt tokens, then its
        output so far. Only what was not indexed yet is indexed (a sequence only grows)."""
        where = self._live.get(seq_id)
        if where is None:
            index = self._index(prompt)
            doc_no = self._new_doc(index, tokens[max(0, prompt_len - self.max_match):prompt_len])
            self._live[seq_id] = (prompt, doc_no)
        else:
            index, doc_no = self._prompts[where[0]], where[1]
        doc = index.docs[doc_no]
        head = min(prompt_len, self.max_match)  # the prompt tail the doc starts with
        new = tokens[prompt_len + len(doc.tokens) - head:]
        doc.tokens.extend(new)
        self.num_tokens += len(new)
        self._index_doc(index, doc_no, doc)

    def finish_live(self, seq_id: int, keep: bool = True, version: Optional[str] = None) -> None:
        """Sequence ``seq_id`` ended: kept as a finished rollout of its prompt (``version``: the weights
        it was generated on), or dropped (aborted, failed)."""
        where = self._live.pop(seq_id, None)
        if where is None:
            return
        prompt, doc_no = where
        index = self._prompts.get(prompt)
        if index is None:
            return
        if keep and self.max_rollouts_per_prompt > 0:
            doc = index.docs[doc_no]
            doc.finished, doc.version = True, version
            index.finished.append(doc_no)
            self._trim(index)
        else:
            self._drop_doc(index, doc_no)
        self._evict()

    def add_finished(self, prompt: Hashable, prompt_len: int, tokens: Sequence[int],
                     version: Optional[str] = None) -> None:
        """A finished rollout of ``prompt``: ``prompt_len`` prompt tokens, then its output."""
        if self.max_rollouts_per_prompt == 0:
            return
        index = self._index(prompt)
        doc_no = self._new_doc(index, list(tokens[max(0, prompt_len - self.max_match):]))
        doc = index.docs[doc_no]
        doc.finished, doc.version = True, version
        self._index_doc(index, doc_no, doc)
        index.finished.append(doc_no)
        self._trim(index)
        self._evict()

    def drop_finished(self, keep_version: Optional[Callable[[Optional[str]], bool]] = None) -> int:
        """Forget the finished rollouts whose version ``keep_version`` rejects (every one without a rule);
        returns how many went. Live sequences stay."""
        dropped = 0
        for index in list(self._prompts.values()):
            for doc_no in [d for d in index.finished if keep_version is None or not keep_version(index.docs[d].version)]:
                index.finished.remove(doc_no)
                self._drop_doc(index, doc_no)
                dropped += 1
        for prompt in [p for p, index in self._prompts.items() if not index.docs]:
            del self._prompts[prompt]
        return dropped

    @property
    def num_prompts(self) -> int:
        return len(self._prompts)

    def num_rollouts(self, prompt: Hashable) -> int:
        index = self._prompts.get(prompt)
        return 0 if index is None else len(index.finished)

    # ------------------------------------------------------------------ guessing

    def propose(self, prompt: Hashable, context: Sequence[int], k: int) -> Proposal:
        """Up to ``k`` guesses for what follows ``context`` (the asking sequence's prompt and output so
        far), from the outputs stored for ``prompt`` — the asking sequence's own earlier text included."""
        best, occ = self._match(prompt, context) if k > 0 else (0, [])
        return self._follow(occ, k, best) if occ else Proposal()

    def propose_tree(self, prompt: Hashable, context: Sequence[int], k: int, max_nodes: int = 32) -> list[TreeNode]:
        """Every continuation of the matched occurrences as a token tree, ``k`` deep at most: the nodes
        whose share of the occurrences is at least ``min_confidence``, the ``max_nodes`` largest shares
        (a node's parent always before it). For a verifier that draws each position and follows the
        child equal to the drawn token: a draw is accepted if any branch guessed it."""
        best, occ = self._match(prompt, context) if k > 0 else (0, [])
        total, nodes = len(occ), []
        frontier = [(-1, occ)]  # (node index, the occurrences through it)
        for depth in range(k):
            grown = []
            for parent, through in frontier:
                by_token: dict[int, list] = {}
                for toks, e in through:
                    if e + depth < len(toks):
                        by_token.setdefault(toks[e + depth], []).append((toks, e))
                for token, group in by_token.items():
                    if len(group) / total >= self.min_confidence:
                        grown.append((len(group) / total, parent, token, group))
            grown.sort(key=lambda g: -g[0])
            frontier = []
            for share, parent, token, group in grown[:max_nodes - len(nodes)]:
                nodes.append(TreeNode(parent, token, share, depth))
                frontier.append((len(nodes) - 1, group))
            if not frontier:
                break
        return nodes

    def _match(self, prompt: Hashable, context: Sequence[int]) -> tuple[int, list[tuple[list[int], int]]]:
        """The longest backward match of ``context``'s end among the stored outputs of ``prompt`` with
        something after it, and every occurrence of that length (among the ``max_scan`` latest)."""
        index = self._prompts.get(prompt)
        end = len(context)
        if index is None or end < self.min_match:
            return 0, []
        self._prompts.move_to_end(prompt)
        found = index.grams.get(hash(tuple(context[end - self.min_match:])))
        if not found:
            return 0, []
        best, occ = 0, []
        for entry in found[-self.max_scan:]:
            doc_no, e = entry >> _SHIFT, entry & ((1 << _SHIFT) - 1)
            doc = index.docs.get(doc_no)
            if doc is None or e >= len(doc.tokens):
                continue  # dropped, or nothing after it yet (the asking sequence's own end)
            toks, n = doc.tokens, 0
            limit = min(self.max_match, e, end)
            while n < limit and toks[e - 1 - n] == context[end - 1 - n]:
                n += 1
            if n < self.min_match:
                continue  # a hash collision
            if n > best:
                best, occ = n, [(toks, e)]
            elif n == best:
                occ.append((toks, e))
        return best, occ

    def _follow(self, occ: list[tuple[list[int], int]], k: int, match_len: int) -> Proposal:
        out = Proposal(match_len=match_len, num_occurrences=len(occ))
        total = len(occ)
        for step in range(k):
            counts = Counter(toks[e + step] for toks, e in occ if e + step < len(toks))
            if not counts:
                break
            token, agree = counts.most_common(1)[0]
            if agree / total < self.min_confidence:
                break
            out.tokens.append(token)
            out.confidences.append(agree / total)
            occ = [(toks, e) for toks, e in occ if e + step < len(toks) and toks[e + step] == token]
        return out

    # ------------------------------------------------------------------ the index itself

    def _index(self, prompt: Hashable) -> _PromptIndex:
        index = self._prompts.get(prompt)
        if index is None:
            index = self._prompts[prompt] = _PromptIndex()
        self._prompts.move_to_end(prompt)
        return index

    def _new_doc(self, index: _PromptIndex, tokens: list[int]) -> int:
        doc_no, index.next_doc = index.next_doc, index.next_doc + 1
        index.docs[doc_no] = _Doc(list(tokens), 0)
        self.num_tokens += len(tokens)
        return doc_no

    def _index_doc(self, index: _PromptIndex, doc_no: int, doc: _Doc) -> None:
        """An entry for every position ``e`` not indexed yet: the ``min_match`` tokens before it, hashed
        (what follows them is ``doc.tokens[e]``, once it exists)."""
        n, toks = self.min_match, doc.tokens
        for e in range(max(doc.indexed, n), len(toks) + 1):
            index.grams.setdefault(hash(tuple(toks[e - n:e])), []).append((doc_no << _SHIFT) | e)
            index.live_entries += 1
        doc.indexed = max(doc.indexed, len(toks) + 1)

    def _drop_doc(self, index: _PromptIndex, doc_no: int) -> None:
        doc = index.docs.pop(doc_no)
        self.num_tokens -= len(doc.tokens)
        gone = max(0, doc.indexed - self.min_match)
        index.live_entries -= gone
        index.dead_entries += gone
        if index.dead_entries > max(index.live_entries, 1024):  # the index rebuilt from the docs left
            index.grams, index.live_entries, index.dead_entries = {}, 0, 0
            for no, d in index.docs.items():
                d.indexed = 0
                self._index_doc(index, no, d)

    def _trim(self, index: _PromptIndex) -> None:
        while len(index.finished) > self.max_rollouts_per_prompt:
            self._drop_doc(index, index.finished.pop(0))

    def _evict(self) -> None:
        """Finished rollouts of the least recently used prompts go first, while over ``max_tokens``."""
        for prompt in list(self._prompts):
            if self.num_tokens <= self.max_tokens:
                return
            index = self._prompts[prompt]
            while index.finished and self.num_tokens > self.max_tokens:
                self._drop_doc(index, index.finished.pop(0))
            if not index.docs:
                del self._prompts[prompt]
