"""executor/: tensor work on one rank.

- ``model_runner.py``: ``ModelRunner`` (forward, sample, scoring; parameter buffers and the KV pool
  it allocates today);
- ``cuda_graph_runner.py``: decode CUDA graphs (static buffers, capture and recapture).

May import: the top-level modules (``batch``, ``config``), ``weights/``'s loader and safetensors
checks, ``models/``, ``layers/`` and ``kernels/``.
"""
