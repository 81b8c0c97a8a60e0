"""layers/: the tensor-parallel building blocks a model is made of — linear layers (column, row, merged
QKV and gate/up), the vocabulary embedding and LM head, RMSNorm, rotary embedding, paged attention, the
sampler and the LoRA slots — and the TP state they share (``parallel_state.py``). Only this package
knows about tensor parallelism; the kernels a layer runs are ``kernels/``'s.

May import: ``kernels/`` and the top-level vocabulary modules.
"""
