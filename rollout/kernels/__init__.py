"""kernels/: the project's own compute kernels, apart from the layers that call them.

- ``cpu/``: the C++ CPU kernels (``csrc/``: one file per kernel family and ``vec.h``, the vector helpers
  they share), their build (one unit per instruction set, the variant chosen at run time by the CPU),
  their Python faces (``ops.py``, ``fused.py``: a decoder layer or the whole stack in one call), the
  processor's capability (``capability.py``) and the GEMM plan with its weight copies (``plan.py``,
  ``packing.py``);
- ``triton/``: the Triton kernels (paged decode attention, the LoRA term of a mixed batch), run on CUDA
  and tested on CPU under ``TRITON_INTERPRET=1``.

May import: torch and Triton, and nothing of the engine's (``layers/`` and everything above call down
into this package, never the other way). ``fused.py`` reads a decoder layer's modules by their
attributes, importing none of them.
"""
