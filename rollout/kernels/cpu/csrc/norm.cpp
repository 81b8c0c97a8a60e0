// RMSNorm on CPU in one C++ call, as Hugging Face's Llama family computes it.
//
// weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype): the torch path is five or more
// operators per norm (a widening copy, the fused norm's own reductions, a rounding copy, the
// multiply), ~60 norms a decode step, each dispatched and allocated for a few hundred values per
// row. Here each row is widened once, its squares summed in fp32 in a fixed vector order, and the
// result rounded exactly where the torch path rounds (to the activation dtype before the weight,
// then after it, round to nearest even) — the same values up to the order of that one sum.

namespace {

typedef float nvf __attribute__((vector_size(ROLLOUT_LANES * 4)));
constexpr int NL = ROLLOUT_LANES;

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t M, int64_t H, float eps) {
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / std::max<int64_t>(H, 1)), [&](int64_t m0, int64_t m1) {
    std::vector<float> row(H);
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = x + m * H;
      for (int64_t d = 0; d < H; ++d) row[d] = nwiden(xr[d]);
      nvf acc = {};
      int64_t d = 0;
      for (; d + NL <= H; d += NL) { nvf v; std::memcpy(&v, row.data() + d, sizeof v); acc += v * v; }
      float s = 0.f;
      for (int i = 0; i < NL; ++i) s += acc[i];
      for (; d < H; ++d) s += row[d] * row[d];
      const float r = 1.f / std::sqrt(s / static_cast<float>(H) + eps);
      T* yr = y + m * H;
      for (int64_t k = 0; k < H; ++k) nstore(yr + k, nwiden(w[k]) * nround(row[k] * r, yr));
    }
  });
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: x [..., H] and weight [H] of one dtype");
  auto rows = x.contiguous();
  auto w = weight.contiguous();
  auto y = rows.new_empty(rows.sizes());
  const int64_t H = w.size(0), M = rows.numel() / std::max<int64_t>(H, 1);
  if (x.scalar_type() == at::kFloat)
    rms_rows<float>(rows.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, H, static_cast<float>(eps));
  else if (x.scalar_type() == at::kBFloat16)
    rms_rows<at::BFloat16>(rows.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), M,
                           H, static_cast<float>(eps));
  else
    TORCH_CHECK(false, "rms_norm: fp32 or bf16 only");
  return y;
}
