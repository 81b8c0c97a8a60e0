"""A Llama-family decoder layer's CPU decode step in one C++ call (its C++: ``csrc/layer.cpp``).

A decode step on CPU at 1-8 rows spends a third of its time or more between its kernels, not in
them: each layer is a dozen operators (two RMSNorms, four linears with the plan's kernel choice,
rotary and the K/V write, paged attention, SiLU·up, two residual adds), each reached through the
module tree, the plan lookup, pybind or the dispatcher, and the allocator (profile in
``benchmarks/NOTES.md``). ``decode_layer`` runs the same kernels in the same order on the same
tensors from C++ — the project's kernels directly, oneDNN's and ``aten::linear`` through the
dispatcher exactly as the Python path calls them — so its output is the module path's bit for bit
(tested), with one crossing from Python per layer instead of a few dozen.

At the fewest rows (1-3 on most CPUs, up to 8 on those with AVX512-BF16, whose small-batch kernel
takes dot products from five rows: where the plan gives every linear the small-batch kernel, which
reads the weights themselves) ``decode_stack`` runs every layer in one call: one OpenMP team
for the whole stack, whose threads split each GEMV and the attention and meet at spin barriers
between kernels while the first runs the small ones. Layer by layer, each kernel's parallel region
woke the second thread from its sleep (``GOMP_SPINCOUNT`` bounds libgomp's spin, ``rollout.openmp``)
and Python rebuilt 30 argument lists a step; measured on AMD EPYC Zen 4 (SmolLM2 bf16, batch 1):
``benchmarks/NOTES.md``. A thread waiting at a barrier spins as long as libgomp's threads would
(``spin_count``), then sleeps on a futex, so beside another computing process it gives its core up as
they do (a barrier that only yielded after its spin cost the step 1.5x beside a busy neighbour). Its
bits are ``decode_layer``'s (tested on every ISA variant, 1 and 2 threads).

It serves a plain decode step only: every row a decode token, the paged kernel and the fused
rotary/cache write on, no q/k norms, one TP rank, and no adapter rows in the batch — except, layer by
layer (not the stack), adapters each on one run of rows with the torch LoRA backend, whose low-rank terms
it adds with the ops ``LoraSlots.add`` runs; anything else takes the module path (``LlamaModel.forward``
decides per forward).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from rollout.kernels.cpu import build

KINDS = {"own": 0, "tiled": 1, "onednn": 2, "fp32": 3, "linear": 4}
_NONE = torch.empty(0)


def _linear_tensors(linear, rows: int, bias: Optional[torch.Tensor], out: list, kinds: list) -> bool:
    """Append one linear's four tensors and its kernel kind for ``rows`` rows; False: a copy the plan's
    kernel reads is not built (the module path asserts instead)."""
    packed = linear.packed_weight
    kernel = "linear" if packed is None else packed.plan.kernel_for(rows)
    copy, copy_bias = _NONE, _NONE
    if kernel == "onednn":
        copy = packed.narrow
    elif kernel == "fp32":
        copy, copy_bias = packed.wide, packed.wide_bias
    elif kernel == "tiled":
        copy = packed.panels
    if copy is None or kernel not in KINDS:  # chunked: the module path
        return False
    out += (linear.weight, _NONE if bias is None else bias, copy, _NONE if copy_bias is None else copy_bias)
    kinds.append(KINDS[kernel])
    return True


def decode_layer(layer, rope, hidden: torch.Tensor, kv_cache, meta, lora_runs: tuple = ()) -> Optional[torch.Tensor]:
    """``layer`` (a ``LlamaDecoderLayer``) over a plain decode step in one C++ call; None where a
    copy its plan reads is missing (the caller takes the module path). ``lora_runs``: (slot, first row,
    rows) of each adapter of the step, each on one run of rows (every linear's low-rank terms added as
    ``LoraSlots.add`` adds them)."""
    attn, mlp = layer.self_attn, layer.mlp
    rows = hidden.shape[0]
    tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, rope[0], rope[1], kv_cache[0],
               kv_cache[1], meta.slot_mapping, meta.decode_blocks, meta.decode_ctx_lens,
               _NONE if attn.o_proj.bias is None else attn.o_proj.bias,
               _NONE if mlp.down_proj.bias is None else mlp.down_proj.bias]
    kinds: list[int] = []
    for linear, bias in ((attn.qkv_proj, attn.qkv_proj.bias), (attn.o_proj, None), (mlp.gate_up_proj, mlp.gate_up_proj.bias),
                         (mlp.down_proj, None)):
        if not _linear_tensors(linear, rows, bias, tensors, kinds):
            return None
    rows = []
    for slot, first, n in lora_runs:
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            tensors += linear.lora.adapters.get(slot, (_NONE, _NONE))
        rows += (first, n)
    return build.kernels().decode_layer(hidden, tensors, kinds, attn.num_heads, attn.num_kv_heads,
                                            float(layer.input_layernorm.eps), float(attn.attn.scale),
                                            int(meta.sliding_window or 0), rows)


LIBGOMP_SPINS = 300_000  # libgomp's spin count where neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY says otherwise
FOREVER = 1 << 62


def spin_count(environ=os.environ) -> int:
    """How many times a thread waiting at one of ``decode_stack``'s barriers looks before it sleeps:
    libgomp's own spin count, read as libgomp reads it (``GOMP_SPINCOUNT``: a number, or ``infinite``;
    unset, ``OMP_WAIT_POLICY=active`` spins forever, ``passive`` not at all, neither 300,000), so the
    stack's threads wait as torch's do: ``rollout.openmp`` bounds both at 2000 beside other computing
    processes, a process alone on its cores may lift both."""
    value = environ.get("GOMP_SPINCOUNT", "").strip().lower()
    if value in ("infinite", "infinity"):
        return FOREVER
    if value:
        scale = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}.get(value[-1], 1)
        try:
            return min(FOREVER, int(value[:-1] if scale > 1 else value) * scale)
        except ValueError:
            pass  # libgomp ignores what it cannot read
    policy = environ.get("OMP_WAIT_POLICY", "").strip().lower()
    return {"active": FOREVER, "passive": 0}.get(policy, LIBGOMP_SPINS)


@functools.lru_cache(maxsize=1)
def _spins() -> int:
    """spin_count() of this process, read once (libgomp reads it once too)."""
    return spin_count()


def _stack_tensors(layers, kv_caches, rows: int) -> Optional[list]:
    """``decode_stack``'s 12 tensors per layer, or None where a linear's plan does not choose the
    small-batch kernel (kind 0, which reads the weights themselves: no copy to go stale) at ``rows``."""
    out: list = []
    for layer, (k_cache, v_cache) in zip(layers, kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        out += (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, k_cache, v_cache)
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            packed = linear.packed_weight
            if packed is None or packed.plan.kernel_for(rows) != "own":
                return None
            out += (linear.weight, _NONE if linear.bias is None else linear.bias)
    return out


def decode_stack(model, rope, hidden: torch.Tensor, kv_caches, meta) -> Optional[torch.Tensor]:
    """Every decoder layer of ``model`` (a ``LlamaModel``) over a plain decode step in one C++ call with
    one team of threads, where each linear's plan takes the small-batch kernel at these rows (a decode
    step of 1-3 rows on most CPUs, up to 8 with AVX512-BF16); None otherwise (the caller goes layer by
    layer). The tensor list is built once per row count and KV pool (``model.stack_tensors``; the runner
    empties it whenever the weights or their copies change)."""
    key = (hidden.shape[0], id(kv_caches))
    cached = model.stack_tensors.get(key)
    if cached is None:
        cached = model.stack_tensors[key] = (kv_caches, _stack_tensors(model.layers, kv_caches, hidden.shape[0]))
    if cached[1] is None:
        return None
    layer = model.layers[0]
    attn = layer.self_attn
    return build.kernels().decode_stack(hidden, cached[1], rope[0], rope[1], meta.slot_mapping, meta.decode_blocks,
                                            meta.decode_ctx_lens, attn.num_heads, attn.num_kv_heads,
                                            float(layer.input_layernorm.eps), float(attn.attn.scale),
                                            int(meta.sliding_window or 0), _spins())

