"""weights/: getting weights into a rank, strictly (validate everything, then copy in place, or nothing).

- ``lora.py``: LoRA adapters read, checked and written into the linears' slots;
- ``loader.py``: ``plan_load`` / ``apply_load`` / ``load_named_tensors``, the one loading path;
- ``safetensors_io.py``: safetensors folders pinned as directory descriptors (``PinnedFolder``) and
  read only through them (index and header checks, files of the folder itself, lazy tensors).

The rank's weight transaction that drives them (``RankWeights``) is ``worker/rank_weights.py``.

May import: ``layers/``, ``kernels/`` and the top-level ``config`` (``InputError``); nothing above
(executor, worker, scheduler, engine).
"""
