"""The Triton kernels: ``paged_decode`` (decode attention from the block cache) and ``lora`` (the LoRA
term of a mixed batch in one launch per linear). Importing a module here imports Triton."""
