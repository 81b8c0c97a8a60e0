"""weights/: getting weights into a rank, strictly (validate everything, then copy in place, or nothing).

- ``rank_weights.py``: ``RankWeights``, a rank's weight transaction (dispatch on the weight message,
  validate -> TP vote -> copy, update groups, release/resume, reads);
- ``loader.py``: ``plan_load`` / ``apply_load`` / ``load_named_tensors``, the one loading path;
- ``safetensors_io.py``: safetensors folders pinned as directory descriptors (``PinnedFolder``) and
  read only through them (index and header checks, files of the folder itself, lazy tensors).

May import: ``layers/``; ``rank_weights.py`` also the ``executor/``'s ``ModelRunner`` it writes into
and ``worker/``'s messages it answers. ``loader.py`` and ``safetensors_io.py`` import nothing of the
engine's but ``layers/`` (and ``config``'s ``InputError``).
"""
