
namespace {

// a linear's optional tensors arrive as empty tensors (pybind has no None for at::Tensor here)
inline c10::optional<at::Tensor> given(const at::Tensor& t) {
  return t.numel() == 0 ? c10::nullopt : c10::optional<at::Tensor>(t);
}

// torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") as rollout.kernels.cpu.packing.packed_linear calls it
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

// a linear's low-rank term for an adapter serving rows [start, start + n) of the step, op for op as
// rollout.layers.lora.LoraSlots.add computes it for a run of rows: t = linear(x in fp32, a), then
// y + t b^T in fp32, rounded once to y's dtype, in place; a and b empty: the linear has no adapter
void add_lora(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, int64_t start, int64_t n) {
  if (a.numel() == 0) return;
  at::Tensor ys = y.narrow(0, start, n);
  const at::Tensor t = aten_linear(x.narrow(0, start, n).to(at::kFloat), a, c10::nullopt);
  if (ys.scalar_type() == at::kFloat)
    ys.addmm_(t, b.t());
  else
    ys.copy_(ys.to(at::kFloat).addmm(t, b.t()));
}

}  // namespace

// hidden [T, H] -> the layer's output [T, H] for a plain decode step. t: input and post-attention norm
// weights, rotary cos and signed sin [T, 1, D], the layer's K and V caches, slots [T], block tables, context
// lengths, o_proj's and down_proj's biases (empty: none; added after the GEMM, as a row-parallel bias), then
// four tensors per linear (qkv, o, gate_up, down; see layer_linear), then per adapter of the step its a and b
// per linear (empty: none; add_lora); kinds: the plan's kernel per linear; lora_rows: each adapter's first
// row and its number of rows (one run each).
at::Tensor decode_layer(at::Tensor hidden, std::vector<at::Tensor> t, std::vector<int64_t> kinds, int64_t num_heads,
                        int64_t num_kv_heads, double eps, double scale, int64_t window, std::vector<int64_t> lora_rows) {
  const int64_t adapters = static_cast<int64_t>(lora_rows.size()) / 2;
  TORCH_CHECK(lora_rows.size() % 2 == 0 && static_cast<int64_t>(t.size()) == 27 + 8 * adapters && kinds.size() == 4,
              "decode_layer: 11 tensors, 4 per linear, 8 per adapter and 4 kernel kinds");
  for (int64_t g = 0; g < adapters; ++g)
    TORCH_CHECK(lora_rows[2 * g] >= 0 && lora_rows[2 * g + 1] >= 0 &&
                lora_rows[2 * g] + lora_rows[2 * g + 1] <= hidden.size(0), "decode_layer: adapter rows outside the step");
  const at::Tensor* lin = t.data() + 11;
  auto lora = [&](at::Tensor y, const at::Tensor& x, int64_t i) {
    for (int64_t g = 0; g < adapters; ++g)
      add_lora(y, x, t[27 + 8 * g + 2 * i], t[28 + 8 * g + 2 * i], lora_rows[2 * g], lora_rows[2 * g + 1]);
    return y;
  };
  const int64_t T = hidden.size(0);
  auto x = rms_norm(hidden, t[0], eps);
  auto qkv = lora(layer_linear(x, kinds[0], lin), x, 0);
  auto q = rope_and_cache(qkv, t[2], t[3], t[4], t[5], t[6], num_heads, num_kv_heads);
  auto attn = paged_decode(q.contiguous(), t[4], t[5], t[7], t[8], scale, window).view({T, -1});
  auto o = lora(layer_linear(attn, kinds[1], lin + 4), attn, 1);
  if (t[9].numel() > 0) o = o.add(t[9]);
  hidden = hidden.add(o);
  x = rms_norm(hidden, t[1], eps);
  auto act = silu_mul(lora(layer_linear(x, kinds[2], lin + 8), x, 2));
  auto down = lora(layer_linear(act, kinds[3], lin + 12), act, 3);
  if (t[10].numel() > 0) down = down.add(t[10]);
  return hidden.add(down);
}

namespace {

// The threads of a team meeting between two kernels of decode_stack: the last to arrive releases the
// others. A waiter looks at the generation `spins` times (a pause per look; libgomp's own spin count,
// GOMP_SPINCOUNT, passed in: the gaps inside a step are microseconds), then sleeps on it (a futex, as
// libgomp's threads do): beside another process computing on the same cores the thread it waits for may
// be off its core for a whole time slice, and a spinning waiter would hold the core that thread needs.
struct Barrier {
  std::atomic<int32_t> arrived{0};
  std::atomic<int32_t> generation{0};
  std::atomic<int32_t> sleepers{0};
  void wait(int64_t team, int64_t spins) {
    if (team == 1) return;
    const int32_t g = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == team - 1) {
      arrived.store(0, std::memory_order_relaxed);
      generation.store(g + 1, std::memory_order_seq_cst);
      if (sleepers.load(std::memory_order_seq_cst) > 0) wake_all();
      return;
    }
    for (int64_t looks = 0; generation.load(std::memory_order_acquire) == g; ++looks) {
      if (looks < spins) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
        continue;
      }
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (generation.load(std::memory_order_seq_cst) == g) sleep_while(g);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
  // futex: sleep while the generation is g (returns at once if it moved); wake every sleeper
  void sleep_while(int32_t g) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<int32_t*>(&generation), FUTEX_WAIT_PRIVATE, g, nullptr, nullptr, 0);
#else
    std::this_thread::yield();
#endif
  }
  void wake_all() {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<int32_t*>(&generation), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
  }
};

template <typename T>
inline void widen_into(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = nwiden(src[i]);
}
// y = y + b, rounded as torch's add in T (b: one row of n, broadcast over m rows)
template <typename T>
inline void add_rows(T* y, const T* b, int64_t m, int64_t n, bool broadcast) {
  for (int64_t i = 0; i < m * n; ++i) nstore(y + i, nwiden(y[i]) + nwiden(b[broadcast ? i % n : i]));
}

template <typename T> struct Bits { using type = T; };                 // what the GEMM kernel reads and writes
template <> struct Bits<at::BFloat16> { using type = uint16_t; };
template <typename T>
inline typename Bits<T>::type* bits(T* p) { return reinterpret_cast<typename Bits<T>::type*>(p); }
template <typename T>
inline const typename Bits<T>::type* bits(const T* p) { return reinterpret_cast<const typename Bits<T>::type*>(p); }
template <typename T>
inline const T* ptr(const at::Tensor& t) { return t.numel() == 0 ? nullptr : t.data_ptr<T>(); }

// the bf16 bits of activations of type T (the dot products read them as they are), or none (fp32)
template <typename T>
inline const uint16_t* bf16_bits(const T* p) {
  return std::is_same<T, at::BFloat16>::value ? reinterpret_cast<const uint16_t*>(p) : nullptr;
}

// thread tid's share of y [M, N] = x W^T (+ bias), x given widened (xf) and as it is (xt): the GEMM
// kernel's units cut into team pieces (column ranges a multiple of 32 outputs apart where a unit is one
// output, so no two threads write one cache line)
template <typename T>
void gemm_share(const float* xf, const T* xt, const at::Tensor& w, const float* bias, T* y, int64_t M, int64_t K,
                int64_t tid, int64_t team) {
  const uint16_t* xh = bf16_bits(xt);
  const bool dot = takes_dot<typename Bits<T>::type>(M, xh);
  const int64_t N = w.size(0), units = gemm_units(M, N, dot), align = M <= 4 || dot ? 32 : 1;
  auto cut = [&](int64_t i) { return i == team ? units : std::min(units, (units * i / team + align - 1) / align * align); };
  const int64_t u0 = cut(tid), u1 = cut(tid + 1);
  if (u0 < u1) gemm_part(xf, xh, bits(ptr<T>(w)), bias, bits(y), M, N, K, u0, u1);
}

struct StackShape {
  int64_t M, H, I, Hq, Hkv, D, layers;
  float eps, scale;
  int64_t window, spins;
};

// every layer of decode_layer's plain decode step (same kernels, same order, same roundings) with one
// team of threads for the whole stack: the first thread runs the small kernels (norms, rotary and
// cache write, SiLU, the adds) while the others wait at a barrier; all share the GEMMs and attention
template <typename T>
void stack_rows(T* hidden, const std::vector<at::Tensor>& t, const std::vector<std::vector<float>>& col_bias,
                const T* cos, const T* sin, const int64_t* slots, const at::Tensor& blocks, const int64_t* lens,
                const StackShape& s) {
  const int64_t M = s.M, H = s.H, I = s.I, Q = s.Hq * s.D, QKV = (s.Hq + 2 * s.Hkv) * s.D;
  std::vector<float> xf(M * std::max({H, I, Q}));
  std::vector<T> x(M * H), qkv(M * QKV), q(M * Q), att(M * Q), o(M * H), gu(M * 2 * I), act(M * I), dn(M * H);
  const int64_t* tables = blocks.data_ptr<int64_t>();
  // hidden += y (+ a row-parallel bias, added to y first), each add rounded as torch's
  auto residual = [&](T* y, const at::Tensor& bias) {
    if (bias.numel() > 0) add_rows(y, ptr<T>(bias), M, H, true);
    add_rows(hidden, y, M, H, false);
  };
  // the dot products read the bf16 activations themselves: nothing to widen
  const bool widen = !takes_dot<typename Bits<T>::type>(M, bf16_bits(x.data()));
  Barrier bar;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int64_t team = omp_get_num_threads(), tid = omp_get_thread_num();
    for (int64_t l = 0; l < s.layers; ++l) {
      const at::Tensor* lt = t.data() + l * 12;
      const at::Tensor &kc = lt[2], &vc = lt[3];
      const float* qkv_bias = col_bias[2 * l].empty() ? nullptr : col_bias[2 * l].data();
      const float* gu_bias = col_bias[2 * l + 1].empty() ? nullptr : col_bias[2 * l + 1].data();
      if (tid == 0) {
        rms_rows<T>(hidden, ptr<T>(lt[0]), x.data(), M, H, s.eps);
        if (widen) widen_into(x.data(), xf.data(), M * H);
      }
      bar.wait(team, s.spins);
      gemm_share(xf.data(), x.data(), lt[4], qkv_bias, qkv.data(), M, H, tid, team);
      bar.wait(team, s.spins);
      if (tid == 0)
        rope_rows<T>(qkv.data(), QKV, cos, sin, q.data(), kc.data_ptr<T>(), vc.data_ptr<T>(), slots, M, s.Hq, s.Hkv, s.D);
      bar.wait(team, s.spins);
      decode<T>(q.data(), kc.data_ptr<T>(), vc.data_ptr<T>(), tables, lens, att.data(), M, s.Hq, s.Hkv, s.D, kc.size(1),
                blocks.size(1), kc.stride(0), kc.stride(1), kc.stride(2), s.scale, s.window, team, tid);
      bar.wait(team, s.spins);
      if (widen) {  // else the GEMM reads att itself, complete since the barrier above
        if (tid == 0) widen_into(att.data(), xf.data(), M * Q);
        bar.wait(team, s.spins);
      }
      gemm_share(xf.data(), att.data(), lt[6], nullptr, o.data(), M, Q, tid, team);
      bar.wait(team, s.spins);
      if (tid == 0) {
        residual(o.data(), lt[7]);
        rms_rows<T>(hidden, ptr<T>(lt[1]), x.data(), M, H, s.eps);
        if (widen) widen_into(x.data(), xf.data(), M * H);
      }
      bar.wait(team, s.spins);
      gemm_share(xf.data(), x.data(), lt[8], gu_bias, gu.data(), M, H, tid, team);
      bar.wait(team, s.spins);
      if (tid == 0) {
        silu_mul_rows<T>(gu.data(), act.data(), M, I);
        if (widen) widen_into(act.data(), xf.data(), M * I);
      }
      bar.wait(team, s.spins);
      gemm_share(xf.data(), act.data(), lt[10], nullptr, dn.data(), M, I, tid, team);
      bar.wait(team, s.spins);
      if (tid == 0) residual(dn.data(), lt[11]);
    }
  }
}

void check_stack(const at::Tensor& hidden, const std::vector<at::Tensor>& t, const StackShape& s) {
  const auto dt = hidden.scalar_type();
  const int64_t Q = s.Hq * s.D, KV = s.Hkv * s.D;
  auto is = [&](const at::Tensor& x, std::initializer_list<int64_t> shape) {
    return x.scalar_type() == dt && x.is_contiguous() && x.sizes().equals(shape);
  };
  auto bias = [&](const at::Tensor& b, int64_t n) { return b.numel() == 0 || is(b, {n}); };
  for (int64_t l = 0; l < s.layers; ++l) {
    const at::Tensor* lt = t.data() + l * 12;
    TORCH_CHECK(is(lt[0], {s.H}) && is(lt[1], {s.H}), "decode_stack: layer ", l, ": norm weights [H] in the hidden dtype");
    TORCH_CHECK(lt[2].dim() == 4 && lt[2].scalar_type() == dt && lt[2].is_contiguous() && lt[3].sizes() == lt[2].sizes() &&
                lt[3].strides() == lt[2].strides() && lt[3].scalar_type() == dt && lt[2].size(2) == s.Hkv &&
                lt[2].size(3) == s.D, "decode_stack: layer ", l, ": contiguous caches [blocks, bs, Hkv, D]");
    TORCH_CHECK(is(lt[4], {Q + 2 * KV, s.H}) && bias(lt[5], Q + 2 * KV) && is(lt[6], {s.H, Q}) && bias(lt[7], s.H) &&
                is(lt[8], {2 * s.I, s.H}) && bias(lt[9], 2 * s.I) && is(lt[10], {s.H, s.I}) && bias(lt[11], s.H),
                "decode_stack: layer ", l, ": q/k/v, o, gate/up and down weights (and biases) of the model's shapes");
  }
}

}  // namespace

// hidden [M, H] -> every layer's output for a plain decode step, each layer as decode_layer computes it
// where all four linears take the small-batch kernel (kind 0), with one team of threads for the whole
// stack. t: 12 tensors per layer (input and post-attention norm weights, K and V caches, then weight and
// bias of q/k/v, o, gate/up and down; an empty bias: none); cos / signed sin [M, 1, D], slots [M], block
// tables [M, max_blocks], context lengths [M]: the step's, shared by every layer; spins: how long a
// thread waiting at a barrier looks before it sleeps.
at::Tensor decode_stack(at::Tensor hidden, std::vector<at::Tensor> t, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                        at::Tensor blocks, at::Tensor lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                        double scale, int64_t window, int64_t spins) {
  TORCH_CHECK(hidden.dim() == 2 && !t.empty() && t.size() % 12 == 0, "decode_stack: hidden [M, H], 12 tensors per layer");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16, "decode_stack: fp32 or bf16");
  const int64_t M = hidden.size(0), H = hidden.size(1), D = t[2].dim() == 4 ? t[2].size(3) : 0;
  TORCH_CHECK(D > 0 && D % 2 == 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0, "decode_stack: bad head layout");
  const StackShape s{M, H, t[10].dim() == 2 ? t[10].size(1) : 0, num_heads, num_kv_heads, D,
                     static_cast<int64_t>(t.size() / 12), static_cast<float>(eps), static_cast<float>(scale), window,
                     std::max<int64_t>(spins, 0)};
  check_stack(hidden, t, s);
  auto c = cos.reshape({M, D}).contiguous(), sn = sin.reshape({M, D}).contiguous();
  auto sl = slots.to(at::kLong).contiguous(), tb = blocks.to(at::kLong).contiguous(), ln = lens.to(at::kLong).contiguous();
  TORCH_CHECK(c.scalar_type() == hidden.scalar_type() && sn.scalar_type() == hidden.scalar_type() && sl.numel() == M &&
              tb.dim() == 2 && tb.size(0) == M && ln.numel() == M,
              "decode_stack: one rotary row, slot, table and length per row");
  const int64_t num_slots = t[2].size(0) * t[2].size(1);
  for (int64_t i = 0; i < M; ++i)
    TORCH_CHECK(sl.data_ptr<int64_t>()[i] >= 0 && sl.data_ptr<int64_t>()[i] < num_slots, "decode_stack: slot out of range");
  std::vector<std::vector<float>> col_bias;  // q/k/v's and gate/up's biases widened, as bf16_linear widens them
  for (size_t l = 0; l < t.size(); l += 12) {
    col_bias.push_back(widened_bias(given(t[l + 5]), t[l + 4].size(0)));
    col_bias.push_back(widened_bias(given(t[l + 9]), t[l + 8].size(0)));
  }
  auto out = hidden.contiguous().clone();
  if (out.scalar_type() == at::kFloat)
    stack_rows<float>(out.data_ptr<float>(), t, col_bias, c.data_ptr<float>(), sn.data_ptr<float>(), sl.data_ptr<int64_t>(),
                      tb, ln.data_ptr<int64_t>(), s);
  else
    stack_rows<at::BFloat16>(out.data_ptr<at::BFloat16>(), t, col_bias, c.data_ptr<at::BFloat16>(),
                             sn.data_ptr<at::BFloat16>(), sl.data_ptr<int64_t>(), tb, ln.data_ptr<int64_t>(), s);
  return out;
}
