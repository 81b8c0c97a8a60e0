"""Exact speculation in the scheduler: which running sequences verify guesses this step, the sampler's
view of every verified position, and how many guesses a step's draws accept.

A sequence whose next step is a plain decode (its last token's KV not computed yet) may instead run its
last token followed by up to ``speculative_num_draft_tokens`` guesses from the ``SuffixDrafter``, each as
a decode row of its own position over the sequence's paged KV (the scheduler's ``_add_verify_rows``: the
step stays a decode step), one logits row per position. Each row is sampled as plain decoding would
sample there — the history before it (the guesses before it taken as drawn), its own (seed, position)
uniform, every processor — so row ``j``'s token is the token plain decoding draws at that position if
the guesses before it were right. Guesses are accepted while equal to the token drawn at their
position; the tokens kept are the draws up to and including the first that differs from its guess (or
the one after the last guess), each exactly what plain decoding gives there, with its logprob, top
logprobs and sampling mask. The KV written for rejected positions is simply not counted as computed: the
next step overwrites it.

Speculation runs only while at most ``speculative_max_batch`` sequences decode (a small batch is bound by
reading the weights, so a chunk of a few positions costs about one). Under overlap scheduling the
scheduler then takes every result before scheduling (guesses must follow the latest token) and runs a
step that verifies on its own: the tail gives up overlap where it speculates.
"""

from __future__ import annotations

from typing import Optional

from rollout.scheduler.batch import ScoredPosition
from rollout.speculative.drafter import SuffixDrafter


class Speculator:
    """Owned by the scheduler, on the loop thread: the drafter fed with every sequence's text, and the
    counts reported as SGLang's ``spec_*`` statistics."""

    def __init__(self, max_draft_tokens: int, max_batch: int, drafter: Optional[SuffixDrafter] = None):
        self.max_draft_tokens, self.max_batch = max_draft_tokens, max_batch
        # guessed rows a step may add: up to here a step stays bound by reading the weights (CPU and GPU
        # alike at these counts), past it every row costs its GEMM share
        self.max_guess_rows = 2 * max(1, max_batch)
        self.drafter = drafter or SuffixDrafter()
        self._keys: dict[int, tuple] = {}  # seq id -> its prompt's key in the drafter
        self._rate: dict[int, float] = {}  # seq id -> its recent acceptance (moving average)
        self._rest: dict[int, tuple[int, int]] = {}  # seq id -> (steps left without guessing, next rest)
        self._step_rows = 0  # guessed rows given out in the step being scheduled
        self.num_verify_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def _key(self, seq) -> tuple:
        key = self._keys.get(seq.seq_id)
        if key is None:
            lora = seq.req.lora
            key = self._keys[seq.seq_id] = (None if lora is None else lora.name, tuple(seq.req.prompt_ids))
        return key

    def new_step(self) -> None:
        self._step_rows = 0

    def guesses(self, seq, num_decoding: int, room: int) -> list[int]:
        """Up to ``max_draft_tokens`` guesses for ``seq``, at most ``room`` (what its token limits leave
        after the next token). None while more than ``max_batch`` sequences decode, once the step's guessed
        rows reach ``max_guess_rows``, or while the sequence rests: a sequence whose recent guesses were
        mostly rejected (moving average under a quarter) rests 1, 2, 4 ... 64 steps before guessing again."""
        k = min(self.max_draft_tokens, room, seq.params.max_new_tokens - seq.num_output_tokens - 1,
                self.max_guess_rows - self._step_rows)
        if num_decoding > self.max_batch or k <= 0:
            return []
        left, rest = self._rest.get(seq.seq_id, (0, 1))
        if left > 0:
            self._rest[seq.seq_id] = (left - 1, rest)
            return []
        key = self._key(seq)
        self.drafter.update_live(key, seq.seq_id, seq.num_prompt_tokens, seq.token_ids)
        out = self.drafter.propose(key, seq.token_ids, k).tokens
        self._step_rows += len(out)
        return out

    @staticmethod
    def views(seq, guesses: list[int]) -> list[ScoredPosition]:
        """The sampler's view of each verified position: the history before it, guesses taken as drawn."""
        return [ScoredPosition(seq.params, seq.token_ids + guesses[:j], seq.num_prompt_tokens, seq.req, seq.seed)
                for j in range(len(guesses) + 1)]

    def accepted(self, seq_id: int, guesses: list[int], drawn: list[int]) -> int:
        """How many guesses the draws accept: while each equals the token drawn at its position."""
        n = 0
        while n < len(guesses) and drawn[n] == guesses[n]:
            n += 1
        rate = 0.7 * self._rate.get(seq_id, 0.5) + 0.3 * n / len(guesses)
        self._rate[seq_id] = rate
        left, rest = self._rest.get(seq_id, (0, 1))
        if rate < 0.25:
            self._rest[seq_id] = (rest, min(2 * rest, 64))
        elif 2 * n >= len(guesses):
            self._rest[seq_id] = (0, 1)
        self.num_verify_steps += 1
        self.num_draft_tokens += len(guesses)
        self.num_accepted_tokens += n
        return n

    def finished(self, seq, version: Optional[str]) -> None:
        """``seq`` ended: its text kept as a rollout of its prompt unless it was aborted or failed."""
        key = self._keys.pop(seq.seq_id, None)
        self._rate.pop(seq.seq_id, None)
        self._rest.pop(seq.seq_id, None)
        keep = seq.finish_reason in ("stop", "length")
        if key is not None:
            self.drafter.finish_live(seq.seq_id, keep=keep, version=version)
        elif keep:
            self.drafter.add_finished(self._key(seq), seq.num_prompt_tokens, seq.token_ids, version)
            self._keys.pop(seq.seq_id, None)
