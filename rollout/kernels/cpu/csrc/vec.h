// The vector helpers every kernel family shares: ROLLOUT_LANES fp32 lanes (the build's ISA variant:
// 4 generic, 8 AVX2, 16 AVX-512), GCC vector types, loads and stores, bf16 <-> fp32 conversions that
// round as torch rounds (to nearest even, a NaN kept quiet), and a vectorised exp. Each translation
// unit includes this first, inside its ISA's namespace (rollout.kernels.cpu.build).

namespace {

constexpr int L = ROLLOUT_LANES;
typedef float vf __attribute__((vector_size(L * 4)));
typedef uint16_t vh __attribute__((vector_size(L * 2)));
typedef uint32_t vu __attribute__((vector_size(L * 4)));

inline vf loadf(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf widen(const uint16_t* p) {        // bf16 -> fp32: the 16 bits become the top half
  vh h; std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf f; std::memcpy(&f, &u, sizeof f); return f;
}
inline float widen1(uint16_t h) { uint32_t u = static_cast<uint32_t>(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline vf widen(const float* p) { return loadf(p); }  // fp32 weights (an fp32 engine's small batches)
inline float widen1(float h) { return h; }
// a vector of fp32 values stored as they are, or as bf16 rounded as put() rounds each (the top halves
// of the rounded words, picked by one shuffle)
typedef uint16_t vh2 __attribute__((vector_size(L * 4)));
// v rounded to bf16 (nearest even; a NaN kept quiet): the bf16 values are the words' top halves
inline vu bf16_round_bits(vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) : u + 0x7fffu + ((u >> 16) & 1u);
}
// v rounded to bf16: the top halves of bf16_round_bits' words, picked by one shuffle
inline vh bf16_halves(vf v) {
  const vu r = bf16_round_bits(v);
  vh2 w;
  std::memcpy(&w, &r, sizeof w);
#if ROLLOUT_LANES == 4
  return __builtin_shufflevector(w, w, 1, 3, 5, 7);
#elif ROLLOUT_LANES == 8
  return __builtin_shufflevector(w, w, 1, 3, 5, 7, 9, 11, 13, 15);
#elif ROLLOUT_LANES == 16
  return __builtin_shufflevector(w, w, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#endif
}
inline void putv(float* y, vf v) { storef(y, v); }
inline void putv(uint16_t* y, vf v) {
  const vh h = bf16_halves(v);
  std::memcpy(y, &h, sizeof h);
}

inline void put(float* y, int64_t i, float v) { y[i] = v; }
inline void put(uint16_t* y, int64_t i, float v) {  // fp32 -> bf16, round to nearest even (as torch)
  uint32_t u; std::memcpy(&u, &v, 4);
  y[i] = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                         : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// scalars: widened from T, rounded to T and back, stored as T
inline float nwiden(float v) { return v; }
inline float nwiden(at::BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.x) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline float nround(float v, float*) { return v; }
inline float nround(float v, at::BFloat16*) {  // to bf16 and back: round to nearest even, as torch
  uint32_t u; std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return v;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  float f; std::memcpy(&f, &u, 4); return f;
}
inline void nstore(float* p, float v) { *p = v; }
inline void nstore(at::BFloat16* p, float v) {  // round to nearest even, as torch
  uint32_t u; std::memcpy(&u, &v, 4);
  p->x = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                        : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}


// the lanes' exps
typedef float svf __attribute__((vector_size(ROLLOUT_LANES * 4)));
typedef int32_t svi __attribute__((vector_size(ROLLOUT_LANES * 4)));
constexpr int SL = ROLLOUT_LANES;
inline svf sload(const float* p) { svf v; std::memcpy(&v, p, sizeof v); return v; }
inline svf ssplat(float f) { svf v; for (int i = 0; i < SL; ++i) v[i] = f; return v; }

// exp(x) by Cephes' expf polynomial (within 2 ulp), x clamped to [-87.34, 88.38] (exp's normal floats)
inline svf sexp_clamped(svf x) {
  const svf lo = ssplat(-87.33654f), hi = ssplat(88.3762626647949f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const svf magic = ssplat(12582912.f);                // 1.5 * 2^23: adding it rounds to an integer
  const svf n = (x * ssplat(1.44269504088896341f) + magic) - magic;
  svf r = x - n * ssplat(0.693359375f);
  r = r - n * ssplat(-2.12194440e-4f);
  svf p = ssplat(1.9875691500e-4f);
  p = p * r + ssplat(1.3981999507e-3f);
  p = p * r + ssplat(8.3334519073e-3f);
  p = p * r + ssplat(4.1665795894e-2f);
  p = p * r + ssplat(1.6666665459e-1f);
  p = p * r + ssplat(5.0000001201e-1f);
  p = p * (r * r) + r + ssplat(1.f);
  const svi bits = (__builtin_convertvector(n, svi) + 127) << 23;
  svf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp(x) for x <= 0 (x: a logit less the row's max), exactly 0 below -87.33654
inline svf sexp(svf x) {
  const svi under = x < ssplat(-87.33654f);
  const svf y = sexp_clamped(x);
  return under ? ssplat(0.f) : y;
}

}  // namespace
