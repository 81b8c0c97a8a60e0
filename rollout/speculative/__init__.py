"""speculative/: exact speculative decoding from past rollouts.

- ``drafter.py``: ``SuffixDrafter``, guesses from a suffix index over the outputs already generated
  for the same prompt (earlier rollouts, the siblings in flight, the sequence's own text).

May import: the top-level modules only (plain data: no tensors, nothing of the engine's).
"""
