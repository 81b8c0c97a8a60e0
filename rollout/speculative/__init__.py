"""speculative/: exact speculative decoding from past rollouts.

- ``drafter.py``: ``SuffixDrafter``, guesses from a suffix index over the outputs already generated
  for the same prompt (earlier rollouts, the siblings in flight, the sequence's own text);
- ``verify.py``: ``Speculator``, the scheduler's part: which sequences verify guesses this step, the
  sampler's view of each verified position, how many guesses the draws accept.

May import: the top-level modules and ``rollout/batch.py`` (the sampler's view of a position); the
drafter is plain data (no tensors, nothing of the engine's).
"""
