// Rotary embedding and the KV cache write of a decode step in one C++ call (CPU).
//
// The torch path rotates q and k with four operators (x * cos + x.roll(D / 2) * signed_sin: two
// multiplies, a roll, an add, each rounded to the activation dtype), then writes k and v into their
// cache slots with two index_copy_ calls, around a handful of views and a copy of q — about a dozen
// dispatches a layer for a few hundred values a row at decode. rope_and_cache does all of it
// from the fused qkv projection: q rotated into a new tensor, rotated k and v written into their
// slots. It rounds exactly where the torch path rounds (each product, then the sum, to the activation
// dtype; round to nearest even), with no contraction into FMAs, so its values are the torch path's
// bit for bit (tested).

namespace {

// nwiden / nround / nstore: vec.h.
// A product or sum rounded to T, as torch rounds each operator's result; for fp32 the empty asm keeps
// a product from being contracted into an FMA with the sum (torch rounds both).
inline float rround(float v, const float*) { asm volatile("" : "+x"(v)); return v; }
inline float rround(float v, const at::BFloat16*) { return nround(v, static_cast<at::BFloat16*>(nullptr)); }

// out = x * cos + roll(x, D / 2) * signed_sin, each product and the sum rounded to T
template <typename T>
inline void rotate(const T* x, const T* c, const T* s, T* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float a = rround(nwiden(x[d]) * nwiden(c[d]), x);
    const float b = rround(nwiden(x[d < half ? d + half : d - half]) * nwiden(s[d]), x);
    nstore(out + d, a + b);
  }
}

template <typename T>
void rope_rows(const T* qkv, int64_t row_stride, const T* cos, const T* sin, T* q, T* kc, T* vc, const int64_t* slots,
               int64_t rows, int64_t Hq, int64_t Hkv, int64_t D) {
  at::parallel_for(0, rows, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* x = qkv + t * row_stride;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < Hq; ++h) rotate(x + h * D, c, s, q + (t * Hq + h) * D, D);
      T* kd = kc + slots[t] * Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) rotate(x + (Hq + h) * D, c, s, kd + h * D, D);
      std::memcpy(vc + slots[t] * Hkv * D, x + (Hq + Hkv) * D, Hkv * D * sizeof(T));
    }
  });
}

}  // namespace

at::Tensor rope_and_cache(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                             at::Tensor v_cache, at::Tensor slots, int64_t Hq, int64_t Hkv) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_and_cache: qkv [T, (Hq + 2 Hkv) D] with unit column stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.dim() == 4 && k_cache.size(2) == Hkv, "rope_and_cache: contiguous caches [blocks, bs, Hkv, D]");
  const int64_t T = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (Hq + 2 * Hkv) * D && D % 2 == 0, "rope_and_cache: qkv width is not (Hq + 2 Hkv) D");
  auto c = cos.reshape({T, D}).contiguous(), s = sin.reshape({T, D}).contiguous();
  auto sl = slots.to(at::kLong).contiguous();
  TORCH_CHECK(sl.numel() == T && c.scalar_type() == qkv.scalar_type() && s.scalar_type() == qkv.scalar_type() &&
              k_cache.scalar_type() == qkv.scalar_type(), "rope_and_cache: one slot per row, one dtype throughout");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "rope_and_cache: slot out of range");
  auto q = qkv.new_empty({T, Hq, D});
  if (qkv.scalar_type() == at::kFloat)
    rope_rows<float>(qkv.data_ptr<float>(), qkv.stride(0), c.data_ptr<float>(), s.data_ptr<float>(), q.data_ptr<float>(),
                     k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sp, T, Hq, Hkv, D);
  else if (qkv.scalar_type() == at::kBFloat16)
    rope_rows<at::BFloat16>(qkv.data_ptr<at::BFloat16>(), qkv.stride(0), c.data_ptr<at::BFloat16>(),
                            s.data_ptr<at::BFloat16>(), q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                            v_cache.data_ptr<at::BFloat16>(), sp, T, Hq, Hkv, D);
  else
    TORCH_CHECK(false, "rope_and_cache: fp32 or bf16 only");
  return q;
}
