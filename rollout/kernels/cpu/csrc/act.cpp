// The Llama MLP's activation on CPU in one C++ call: silu(gate) * up from the fused gate/up
// projection, without the two operators and the intermediate tensor of the torch path.
//
// F.silu(gate) * up rounds the SiLU to the activation dtype, then the product; so does this kernel
// (round to nearest even). SiLU is g / (1 + exp(-g)) as torch computes it, exp by Cephes' polynomial
// (vec.h's sexp_clamped: within 2 ulp, its argument clamped to [-87.3, 88.3], so below a
// gate of -88.3 the SiLU is ~1e-37 where torch's is -0): the torch path's values to within an ulp or
// two of fp32 before the rounding, so a bf16 result differs from it in rare elements by one bf16 ulp,
// an fp32 one by fp32 ulps. Elementwise: a row's result does not depend on the batch it came in.

namespace {

// vf / vu / widen / bf16_round_bits / putv / svf / sexp_clamped: vec.h

inline svf aload(const float* p) { return sload(p); }
inline svf aload(const at::BFloat16* p) { return widen(reinterpret_cast<const uint16_t*>(p)); }
inline svf around(svf v, const float*) { return v; }
inline svf around(svf v, const at::BFloat16*) {  // to bf16 and back, as putv rounds
  const vu u = bf16_round_bits(v) & 0xffff0000u;
  svf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void astore(float* p, svf v) { putv(p, v); }
inline void astore(at::BFloat16* p, svf v) { putv(reinterpret_cast<uint16_t*>(p), v); }

inline svf silu(svf g) { return g / (ssplat(1.f) + sexp_clamped(-g)); }  // vec.h's exp

constexpr int64_t ACHUNK = 512;  // values of a row per work item
// work items per thread at least: torch's own grain for elementwise operators (32768 values), so a
// decode step of a few rows runs on the calling thread and wakes no other (a sleeping thread's
// wake-up costs more than the work)
constexpr int64_t AGRAIN = 32768 / ACHUNK;

template <typename T>
void silu_mul_rows(const T* gu, T* y, int64_t M, int64_t I) {
  const int64_t chunks = (I + ACHUNK - 1) / ACHUNK;
  at::parallel_for(0, M * chunks, AGRAIN, [&](int64_t w0, int64_t w1) {
    T gbuf[SL], ubuf[SL], ybuf[SL];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t m = w / chunks, j0 = (w % chunks) * ACHUNK, j1 = std::min(I, j0 + ACHUNK);
      const T* g = gu + m * 2 * I;
      const T* u = g + I;
      T* out = y + m * I;
      int64_t j = j0;
      for (; j + SL <= j1; j += SL) {
        const svf s = around(silu(aload(g + j)), g);
        astore(out + j, s * aload(u + j));
      }
      if (j < j1) {  // the tail through the same vector code
        const int64_t n = j1 - j;
        for (int64_t i = 0; i < SL; ++i) { gbuf[i] = i < n ? g[j + i] : T(0.f); ubuf[i] = i < n ? u[j + i] : T(0.f); }
        const svf s = around(silu(aload(gbuf)), g);
        astore(ybuf, s * aload(ubuf));
        for (int64_t i = 0; i < n; ++i) out[j + i] = ybuf[i];
      }
    }
  });
}

}  // namespace

// gate_up [..., 2 I] (gate then up) -> silu(gate) * up [..., I], rounded where F.silu(gate) * up rounds
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 &&
              (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "silu_mul: gate_up [..., 2 I], fp32 or bf16");
  auto x = gate_up.contiguous();
  const int64_t I = x.size(-1) / 2, M = I == 0 ? 0 : x.numel() / (2 * I);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto y = x.new_empty(sizes);
  if (M == 0) return y;
  if (x.scalar_type() == at::kFloat)
    silu_mul_rows<float>(x.data_ptr<float>(), y.data_ptr<float>(), M, I);
  else
    silu_mul_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), M, I);
  return y;
}
