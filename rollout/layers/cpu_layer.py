"""A Llama-family decoder layer's CPU decode step in one C++ call.

A decode step on CPU at 1-8 rows spends a third of its time or more between its kernels, not in
them: each layer is a dozen operators (two RMSNorms, four linears with the plan's kernel choice,
rotary and the K/V write, paged attention, SiLU·up, two residual adds), each reached through the
module tree, the plan lookup, pybind or the dispatcher, and the allocator (profile in
``benchmarks/NOTES.md``). ``decode_layer`` runs the same kernels in the same order on the same
tensors from C++ — the project's kernels directly, oneDNN's and ``aten::linear`` through the
dispatcher exactly as the Python path calls them — so its output is the module path's bit for bit
(tested), with one crossing from Python per layer instead of a few dozen.

It serves a plain decode step only: every row a decode token, the paged kernel and the fused
rotary/cache write on, no q/k norms, no adapter rows in the batch, one TP rank; anything else takes
the module path (``LlamaDecoderLayer.forward`` decides per forward).
"""

from __future__ import annotations

from typing import Optional

import torch

SOURCE = r"""
namespace {

// a linear's optional tensors arrive as empty tensors (pybind has no None for at::Tensor here)
inline c10::optional<at::Tensor> given(const at::Tensor& t) {
  return t.numel() == 0 ? c10::nullopt : c10::optional<at::Tensor>(t);
}

// torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") as rollout.layers.linear.packed_linear calls it
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, b.has_value() ? c10::IValue(*b) : c10::IValue(), c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// F.linear(x, w, b)
at::Tensor aten_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::linear", "");
  std::vector<c10::IValue> stack{x, w, b.has_value() ? c10::IValue(*b) : c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// packed_linear's kernels by the plan's choice: 0 own, 1 tiled, 2 onednn, 3 fp32, 4 linear; t: the
// weight, its bias (a column-parallel one; empty: none), the copy the kernel reads and that copy's bias
at::Tensor layer_linear(const at::Tensor& x, int64_t kind, const at::Tensor* t) {
  const at::Tensor& w = t[0];
  const c10::optional<at::Tensor> bias = given(t[1]);
  switch (kind) {
    case 0: return bf16_linear(x, w, bias);
    case 1: return tiled_linear(x, t[2], w.size(0), bias);
    case 2: return onednn_linear(x.contiguous(), t[2], bias);
    case 3: return onednn_linear(x.contiguous().to(at::kFloat), t[2], given(t[3])).to(x.scalar_type());
    default: return aten_linear(x, w, bias);
  }
}

}  // namespace

// hidden [T, H] -> the layer's output [T, H] for a plain decode step. t: input and post-attention norm
// weights, rotary cos and signed sin [T, 1, D], the layer's K and V caches, slots [T], block tables, context
// lengths, o_proj's and down_proj's biases (empty: none; added after the GEMM, as a row-parallel bias), then
// four tensors per linear (qkv, o, gate_up, down; see layer_linear); kinds: the plan's kernel per linear.
at::Tensor decode_layer(at::Tensor hidden, std::vector<at::Tensor> t, std::vector<int64_t> kinds, int64_t num_heads,
                        int64_t num_kv_heads, double eps, double scale, int64_t window) {
  TORCH_CHECK(t.size() == 27 && kinds.size() == 4, "decode_layer: 11 tensors, 4 per linear and 4 kernel kinds");
  const at::Tensor* lin = t.data() + 11;
  const int64_t T = hidden.size(0);
  auto x = rms_norm(hidden, t[0], eps);
  auto qkv = layer_linear(x, kinds[0], lin);
  auto q = rope_and_cache(qkv, t[2], t[3], t[4], t[5], t[6], num_heads, num_kv_heads);
  auto attn = paged_decode(q.contiguous(), t[4], t[5], t[7], t[8], scale, window);
  auto o = layer_linear(attn.view({T, -1}), kinds[1], lin + 4);
  if (t[9].numel() > 0) o = o.add(t[9]);
  hidden = hidden.add(o);
  x = rms_norm(hidden, t[1], eps);
  auto act = silu_mul(layer_linear(x, kinds[2], lin + 8));
  auto down = layer_linear(act, kinds[3], lin + 12);
  if (t[10].numel() > 0) down = down.add(t[10]);
  return hidden.add(down);
}
"""

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
    if copy is None:
        return False
    out += (linear.weight, _NONE if bias is None else bias, copy, _NONE if copy_bias is None else copy_bias)
    kinds.append(KINDS[kernel])
    return True


def decode_layer(layer, rope, hidden: torch.Tensor, kv_cache, meta) -> Optional[torch.Tensor]:
    """``layer`` (a ``LlamaDecoderLayer``) over a plain decode step in one C++ call; None where a
    copy its plan reads is missing (the caller takes the module path)."""
    from rollout.layers import cpu_build

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
    return cpu_build.kernels().decode_layer(hidden, tensors, kinds, attn.num_heads, attn.num_kv_heads,
                                            float(layer.input_layernorm.eps), float(attn.attn.scale),
                                            int(meta.sliding_window or 0))
