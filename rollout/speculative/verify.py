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

Where it pays: never while more than ``speculative_max_batch`` sequences decode, only for requests that
leave ``SamplingParams.speculative`` on, and then per sequence and step from two measurements — how the
sequence's guesses have done against the drafter's confidences (``_Acceptance``: accepted per expected,
shrunk towards the engine's at the same temperature; one that keeps failing rests a while) and what a
decode step of each row count costs on this machine now (``StepCosts``, from every decode and verify step
run): a sequence's guesses join the step only as far as the tokens they are expected to add raise the
step's tokens per second (``worth``; none proposed in a step where none could). Under overlap scheduling,
a step where guesses could pay first takes every result (guesses must follow the latest token) and runs
on its own: the tail gives up overlap only where it speculates.
"""

from __future__ import annotations

import bisect
import collections
from typing import Optional

from rollout.batch import ScoredPosition
from rollout.speculative.drafter import SuffixDrafter


class StepCosts:
    """Seconds of a decode step by its number of rows, as measured (every decode and verify step the
    scheduler runs), read between measured counts by interpolation. A count's cost is the least of its
    last ``window`` steps (a step is slowed by whatever else runs, never sped up: the least is its cost
    on this machine now), and a count counts as measured from ``settle`` steps on (a first step at a new
    count pays one-off costs: kernels chosen, buffers grown). A count below every measured one costs what
    the smallest does; above every one it is unknown (None): speculation there is tried, which measures it."""

    def __init__(self, window: int = 8, settle: int = 3):
        self.window, self.settle = window, settle
        self._seen: dict[int, collections.deque] = {}
        self._rows: list[int] = []  # the measured (settled) counts, sorted

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or not seconds > 0:
            return
        seen = self._seen.get(rows)
        if seen is None:
            seen = self._seen[rows] = collections.deque(maxlen=self.window)
        seen.append(seconds)
        if len(seen) == self.settle:
            bisect.insort(self._rows, rows)

    def _cost(self, rows: int) -> float:
        return min(self._seen[rows])

    def at(self, rows: int) -> Optional[float]:
        i = bisect.bisect_left(self._rows, rows)
        if i == len(self._rows):
            return None
        hi = self._rows[i]
        if hi == rows or i == 0:
            return self._cost(hi)
        lo = self._rows[i - 1]
        return self._cost(lo) + (self._cost(hi) - self._cost(lo)) * (rows - lo) / (hi - lo)


class _Acceptance:
    """How a source of guesses has done: guesses accepted against what the drafter's confidences led one
    to expect (the sum of each verified guess's confidence — the share of the drafter's matches that
    continue with the path up to it), both decaying with each verify. Their ratio calibrates the
    drafter: at temperature 1 its confident guesses are rarely the token drawn, greedy they nearly
    always are."""

    __slots__ = ("accepted", "expected")

    def __init__(self):
        self.accepted = self.expected = 0.0

    def add(self, accepted: int, expected: float, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.expected = decay * self.expected + expected

    def ratio(self, prior: float, weight: float = 2.0) -> float:
        """Accepted per expected, shrunk towards ``prior`` by ``weight`` expected guesses."""
        return (self.accepted + weight * prior) / (self.expected + weight)


def gains(ratio: float, confidences) -> list[float]:
    """Tokens that the first 1, 2, ... guesses are expected to add: the chance that guesses 1..j are all
    accepted is taken as ``ratio`` times guess j's confidence (at most 1)."""
    out, total = [], 0.0
    for c in confidences:
        total += min(1.0, ratio * c)
        out.append(total)
    return out


def worth(costs: StepCosts, rows: int, made: float, gain: list[float]) -> int:
    """How many guesses to add to a step of ``rows`` rows expected to make ``made`` tokens, where the first
    ``n`` add ``gain[n - 1]`` tokens: the number that gives the step the most tokens per second by the
    measured cost of its rows, 0 where none raises it. A row count above every one measured so far is
    tried (all of them): that measures it."""
    now = costs.at(rows)
    if now is None:
        return len(gain)
    best, best_speed = 0, made / now
    for n, g in enumerate(gain, start=1):
        cost = costs.at(rows + n)
        if cost is None:
            return len(gain)
        if (made + g) / cost > best_speed:
            best, best_speed = n, (made + g) / cost
    return best


class Speculator:
    """Owned by the scheduler, on the loop thread: the drafter fed with every sequence's text, the
    measurements the policy decides from, and the counts reported as SGLang's ``spec_*`` statistics."""

    def __init__(self, max_draft_tokens: int, max_batch: int, drafter: Optional[SuffixDrafter] = None,
                 always: bool = False):
        self.max_draft_tokens, self.max_batch = max_draft_tokens, max_batch
        self.always = always  # every proposal verified (no cost policy): the verify step's studies and tests
        # guessed rows a step may add at most (whatever the measurements say)
        self.max_guess_rows = 2 * max(1, max_batch)
        self.drafter = drafter or SuffixDrafter()
        self.costs = StepCosts()
        self._keys: dict[int, tuple] = {}  # seq id -> its prompt's key in the drafter
        self._acceptance: dict[int, _Acceptance] = {}  # seq id -> how its guesses have done
        self._by_temperature: dict[float, _Acceptance] = {}  # the engine's, by temperature (0: greedy)
        self._given: dict[int, tuple[list[float], float]] = {}  # seq id -> (its guesses' confidences, temperature)
        self._rest: dict[int, tuple[int, int]] = {}  # seq id -> (steps left without guessing, next rest)
        # the step being scheduled: its sequences (a row and a token each), the guesses given out, the tokens
        # they are expected to add
        self._step_decoding, self._step_guessed, self._step_gain = 0, 0, 0.0
        self._step_open = False  # whether any guess could pay in it (``may_pay``)
        self.num_verify_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_declined = 0  # guesses proposed that the cost policy left out

    def _key(self, seq) -> tuple:
        key = self._keys.get(seq.seq_id)
        if key is None:
            lora = seq.req.lora
            key = self._keys[seq.seq_id] = (None if lora is None else lora.name, tuple(seq.req.prompt_ids))
        return key

    def new_step(self, num_decoding: int) -> None:
        """A step is being scheduled with ``num_decoding`` sequences running (a row and a token each)."""
        self._step_decoding, self._step_guessed, self._step_gain = num_decoding, 0, 0.0
        self._step_open = self.may_pay(num_decoding)

    def observe(self, rows: int, seconds: float) -> None:
        """A decode (or verify) step of ``rows`` rows took ``seconds`` (its forward and sampling)."""
        self.costs.observe(rows, seconds)

    @staticmethod
    def _temperature(seq) -> float:
        return round(float(seq.params.temperature or 0.0), 1)

    def ratio(self, seq_id: int, temperature: float) -> float:
        """Accepted guesses per expected by the drafter's confidences, for this sequence: its own record
        shrunk towards the engine's at this temperature, and that towards 1 (the drafter taken at its
        word until measured)."""
        engine = self._by_temperature.get(temperature)
        prior = 1.0 if engine is None else engine.ratio(1.0)
        own = self._acceptance.get(seq_id)
        return prior if own is None else own.ratio(prior)

    def guesses(self, seq, num_decoding: int, room: int) -> list[int]:
        """Up to ``max_draft_tokens`` guesses for ``seq``, at most ``room`` (what its token limits leave
        after the next token), as many as pay (``worth``, their expected tokens from the drafter's
        confidences as this sequence's record calibrates them; none proposed where even certain guesses
        could not pay). None in a step where no guess could pay (``may_pay``: more than ``max_batch``
        sequences decode, or the measured costs say so), for a request that turned speculation off,
        once the step's guessed rows reach ``max_guess_rows``, or while the sequence rests: one whose
        guesses do under a quarter of what the drafter expects rests 1, 2, 4 ... 64 steps between tries."""
        k = min(self.max_draft_tokens, room, seq.params.max_new_tokens - seq.num_output_tokens - 1,
                self.max_guess_rows - self._step_guessed)
        if not self._step_open or k <= 0 or not seq.params.speculative:
            return []
        left, rest = self._rest.get(seq.seq_id, (0, 1))
        if left > 0:
            self._rest[seq.seq_id] = (left - 1, rest)
            return []
        temperature = self._temperature(seq)
        ratio = self.ratio(seq.seq_id, temperature)
        rows, made = self._step_decoding + self._step_guessed, self._step_decoding + self._step_gain
        if not self.always and worth(self.costs, rows, made, gains(ratio, [1.0] * k)) == 0:
            return []  # not even certain guesses would pay for their rows here: nothing proposed
        key = self._key(seq)
        self.drafter.update_live(key, seq.seq_id, seq.num_prompt_tokens, seq.token_ids)
        proposal = self.drafter.propose(key, seq.token_ids, k)
        if not proposal.tokens:
            return []
        gain = gains(ratio, proposal.confidences)
        n = len(gain) if self.always else worth(self.costs, rows, made, gain)
        self.num_declined += len(proposal.tokens) - n
        if n:
            self._given[seq.seq_id] = (proposal.confidences[:n], temperature)
            self._step_guessed += n
            self._step_gain += gain[n - 1]
        return proposal.tokens[:n]

    def may_pay(self, num_decoding: int) -> bool:
        """Whether a step of ``num_decoding`` sequences could gain from guesses at all (certain guesses,
        calibrated as the best record of a running sequence or a temperature says): a step where none
        could proposes nothing, and under overlap scheduling keeps its overlap."""
        if num_decoding > self.max_batch:
            return False
        if self.always:
            return True
        top = max((a.ratio(1.0) for a in self._by_temperature.values()), default=1.0)
        best = max([top] + [a.ratio(top) for a in self._acceptance.values()])
        return worth(self.costs, num_decoding, num_decoding, gains(best, [1.0] * self.max_draft_tokens)) > 0

    @staticmethod
    def views(seq, guesses: list[int]) -> list[ScoredPosition]:
        """The sampler's view of each verified position: the history before it, guesses taken as drawn."""
        return [ScoredPosition(seq.params, seq.token_ids + guesses[:j], seq.num_prompt_tokens, seq.req, seq.seed)
                for j in range(len(guesses) + 1)]

    def add_verify_rows(self, seq, start: int, q: int, rows: tuple, logits_rows: list, sample_idx: list,
                        samplers: list, verifies: list, row: int) -> int:
        """A verify chunk as ``q`` decode rows of one sequence, appended to the batch being built (``rows``:
        its input ids, block tables, LoRA slots, context and query lengths): its last token and each guess at
        their own positions over the same block table, each attending to the positions before it (every row's
        KV is written before any row attends), so the step stays a decode step (the decode kernels, the decode
        CUDA graphs); every row sampled as plain decoding samples that position. Returns the next row."""
        input_ids, tables, lora_slots, ctx_lens, q_lens = rows
        snapshot = list(seq.block_table)
        slot = -1 if seq.req.lora is None else seq.req.lora.slot
        verifies.append((seq, len(samplers), seq.spec_guesses))
        tokens = seq.token_ids[start:] + seq.spec_guesses
        for j, view in enumerate(self.views(seq, seq.spec_guesses)):
            input_ids.append(tokens[j])
            tables.append(snapshot)
            lora_slots.append(slot)
            ctx_lens.append(start + 1 + j)
            q_lens.append(1)
            logits_rows.append(row)
            sample_idx.append(len(logits_rows) - 1)
            samplers.append(view)
            row += 1
        seq.num_computed_tokens = start + q
        return row

    def take_verified(self, seq, first: int, guesses: list[int], tokens: list[int], append) -> None:
        """A verify chunk's rows (from sample row ``first``) onto ``seq`` through ``append(seq, row)`` (False:
        the sequence ended): each draw up to and including the first that differs from its guess, stopping
        where the sequence ends; only the guesses returned count as accepted."""
        n = self.accepted(seq.seq_id, guesses, tokens[first: first + len(guesses)])
        seq.spec_verify_ct += 1
        seq.spec_draft_token_num += len(guesses)
        kept = 0  # accepted guesses returned: none past a stop
        for j in range(n + 1):
            # the KV is valid up to the input of row j (every guess before it accepted); the KV of the token
            # row j draws is computed next step, and a rejected guess's is never kept — set before the
            # append, whose stop or length check may end the turn and hand its KV to the session
            seq.num_computed_tokens = len(seq.token_ids)
            going = append(seq, first + j)
            kept += j < n
            if not going:
                break
        seq.spec_accept_token_num += kept
        self.count_returned(kept)

    def accepted(self, seq_id: int, guesses: list[int], drawn: list[int]) -> int:
        """How many guesses the draws accept: while each equals the token drawn at its position."""
        n = 0
        while n < len(guesses) and drawn[n] == guesses[n]:
            n += 1
        confidences, temperature = self._given.pop(seq_id, ([1.0] * len(guesses), 0.0))
        expected = sum(confidences[:len(guesses)])
        own = self._acceptance.setdefault(seq_id, _Acceptance())
        own.add(n, expected, decay=0.7)
        self._by_temperature.setdefault(temperature, _Acceptance()).add(n, expected, decay=0.99)
        left, rest = self._rest.get(seq_id, (0, 1))
        if self.ratio(seq_id, temperature) < 0.25:
            self._rest[seq_id] = (rest, min(2 * rest, 64))
        elif 2 * n >= len(guesses):
            self._rest[seq_id] = (0, 1)
        self.num_verify_steps += 1
        self.num_draft_tokens += len(guesses)
        return n

    def count_returned(self, n: int) -> None:
        """``n`` accepted guesses went out as tokens (the scheduler's count: none after a stop)."""
        self.num_accepted_tokens += n

    def finished(self, seq, version: Optional[str]) -> None:
        """``seq`` ended: its text kept as a rollout of its prompt unless it was aborted or failed."""
        key = self._keys.pop(seq.seq_id, None)
        self._acceptance.pop(seq.seq_id, None)
        self._given.pop(seq.seq_id, None)
        self._rest.pop(seq.seq_id, None)
        keep = seq.finish_reason in ("stop", "length")
        if key is not None:
            self.drafter.finish_live(seq.seq_id, keep=keep, version=version)
        elif keep:
            self.drafter.add_finished(self._key(seq), seq.num_prompt_tokens, seq.token_ids, version)
            self._keys.pop(seq.seq_id, None)
