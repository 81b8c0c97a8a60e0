// A mixture of experts' block on CPU in one C++ call (rollout.layers.moe.SparseMoe on the CPU kernel
// plan): the (token, slot) rows grouped by expert, each expert's two GEMMs over its rows, the results
// weighted and summed back per token — what the torch path does with ~8 Python-level operators per
// expert (a decode step of a Qwen3-MoE-shaped model runs a thousand small GEMMs, bound by their calls).
//
// x [T, H]; w13 [E, 2 I, H] (each expert's gate rows, then its up rows); w2 [E, H, I]; experts [T, k]
// (int64, a token's k distinct experts); weights [T, k] in x's dtype -> [T, H] in x's dtype.
//
// 1. The T k rows are sorted by expert with a stable counting sort (the torch path's stable argsort:
//    the same order) and gathered.
// 2. The experts that have rows run side by side over the threads (at::parallel_for over experts;
//    each expert's GEMMs on one thread: the bf16_linear and silu_mul calls inside run inline there):
//    gate/up = bf16_linear(rows, w13[e]), silu_mul, y = bf16_linear(act, w2[e]) — the wing's
//    small-batch GEMM and SiLU·up, each rounding to x's dtype where F.linear and F.silu(g) * u round.
// 3. Per token (side by side over tokens): its k results, each rounded y * weight (as y * scale
//    rounds), added to a zero row in ascending expert order with a rounding after each add (as
//    index_add_ expert by expert adds them: transformers' order). No FMA contraction here (an FMA
//    would skip the product's rounding).
//
// So the result is the per-expert loop of the same kernels (bf16_linear, silu_mul) bit for bit,
// whatever the threads; against the torch path's F.linear it differs only by the GEMMs' order of fp32
// additions and silu_mul's ulp (rollout.kernels.cpu.ops). A row's GEMM result depends on how many rows
// its expert has (bf16_linear's 1-4-row and 5+-row paths sum differently), so this block is not
// batch-invariant: the batch-invariant mode keeps the torch path.

namespace {

template <typename T>
__attribute__((optimize("fp-contract=off")))
void moe_combine(const T* y, const T* wts, const int64_t* pos, T* out, int64_t Tn, int64_t k, int64_t H) {
  at::parallel_for(0, Tn, 16, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> rows(k);
    std::vector<float> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < k; ++j) rows[j] = pos[t * k + j];
      std::vector<int64_t> slot(k);
      for (int64_t j = 0; j < k; ++j) slot[j] = j;
      // ascending expert order: the rows are sorted by expert, so by their sorted positions
      std::sort(slot.begin(), slot.end(), [&](int64_t a, int64_t b) { return rows[a] < rows[b]; });
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j : slot) {
        const T* yr = y + rows[j] * H;
        const float w = nwiden(wts[t * k + j]);
        for (int64_t h = 0; h < H; ++h) {
          const float p = nround(nwiden(yr[h]) * w, static_cast<T*>(nullptr));
          acc[h] = nround(acc[h] + p, static_cast<T*>(nullptr));
        }
      }
      T* o = out + t * H;
      for (int64_t h = 0; h < H; ++h) nstore(o + h, acc[h]);
    }
  });
}

template <typename T>
void gather_rows(const T* x, const int64_t* token, T* dst, int64_t n, int64_t H) {
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::memcpy(dst + r * H, x + token[r] * H, H * sizeof(T));
  });
}

}  // namespace

at::Tensor moe_experts(at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor experts, at::Tensor weights,
                       int64_t linear_rows) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts: x [T, H], fp32 or bf16");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
              w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "moe_experts: w13 [E, 2I, H] and w2 [E, H, I], contiguous, in x's dtype");
  const int64_t Tn = x.size(0), H = x.size(1), E = w13.size(0), I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H,
              "moe_experts: w13 [E, 2I, H] and w2 [E, H, I] disagree with x [T, H]");
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == Tn && experts.scalar_type() == at::kLong,
              "moe_experts: experts [T, k] int64");
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == x.scalar_type(),
              "moe_experts: weights [T, k] in x's dtype");
  const int64_t k = experts.size(1), n = Tn * k;
  auto out = x.new_empty({Tn, H});
  if (Tn == 0) return out;
  auto xc = x.contiguous();
  auto ec = experts.contiguous();
  auto wc = weights.contiguous();
  const int64_t* ex = ec.data_ptr<int64_t>();
  // 1. a stable counting sort of the rows by expert: order[p] is the row at sorted position p, pos its inverse
  std::vector<int64_t> start(E + 1, 0), order(n), pos(n);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(ex[r] >= 0 && ex[r] < E, "moe_experts: expert ", ex[r], " out of range [0, ", E, ")");
    ++start[ex[r] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t p = fill[ex[r]]++;
      order[p] = r / k;  // the token of the row at p
      pos[r] = p;
    }
  }
  auto rows = x.new_empty({n, H});
  auto y = x.new_empty({n, H});
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  AT_DISPATCH_SWITCH(x.scalar_type(), "moe_experts",
    AT_DISPATCH_CASE(at::kFloat, [&] { gather_rows(xc.data_ptr<float>(), order.data(), rows.data_ptr<float>(), n, H); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      gather_rows(xc.data_ptr<at::BFloat16>(), order.data(), rows.data_ptr<at::BFloat16>(), n, H); }));
  // 2. each expert's GEMMs, the experts side by side
  at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t e = active[a], s = start[e], m = start[e + 1] - s;
      const bool own = m < linear_rows;
      const auto xs = rows.narrow(0, s, m);
      auto gate_up = own ? bf16_linear(xs, w13.select(0, e), c10::nullopt) : aten_linear(xs, w13.select(0, e), c10::nullopt);
      const auto act = silu_mul(gate_up);
      auto part = own ? bf16_linear(act, w2.select(0, e), c10::nullopt) : aten_linear(act, w2.select(0, e), c10::nullopt);
      // (bytes, not copy_: a worker thread is outside the caller's inference mode)
      std::memcpy(static_cast<char*>(y.data_ptr()) + s * H * y.element_size(), part.data_ptr(),
                  m * H * y.element_size());
    }
  });
  // 3. weighted and summed back per token, in ascending expert order
  AT_DISPATCH_SWITCH(x.scalar_type(), "moe_experts",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      moe_combine(y.data_ptr<float>(), wc.data_ptr<float>(), pos.data(), out.data_ptr<float>(), Tn, k, H); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      moe_combine(y.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), pos.data(), out.data_ptr<at::BFloat16>(),
                  Tn, k, H); }));
  return out;
}
