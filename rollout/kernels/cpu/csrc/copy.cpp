// Received tensors into their places on CPU in one C++ call: scatter_scaled copies many 2-D
// pieces of a byte buffer (fp32, bf16 or fp16) into an fp32 buffer, each multiplied by its own fp32
// scale, and counts the non-finite values it wrote (a piece that already lies in its place, received
// there, is only counted) — what a LoRA adapter's bucket needs on arrival
// (rollout.weights.lora: A copied, B scaled into its block of b, finiteness checked) in
// one pass over the bytes instead of a copy, a scale and a check, with no Python per tensor.
//
// Each product is the IEEE fp32 product of the value (widened exactly) and its scale, as
// dst.copy_(src); dst.mul_(scale) computes it: the same bits.

namespace {

// a piece received in place (fp32, unscaled): only counted (rows back to back read as one run), whole
// vectors compared at once, the rest one by one
int64_t count_piece(const float* d, int64_t rows, int64_t cols, int64_t ds) {
  if (ds == cols) {
    cols *= rows;
    rows = 1;
  }
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* dr = d + r * ds;
    int64_t c = 0;
#if ROLLOUT_LANES == 16
    for (; c + 16 <= cols; c += 16) {
      const __mmask16 ok = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(dr + c)),
                                              _mm512_set1_ps(3.4028234663852886e38f), _CMP_LE_OQ);
      bad += 16 - __builtin_popcount(static_cast<unsigned>(ok));  // NaN compares false
    }
#elif ROLLOUT_LANES == 8
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; c + 8 <= cols; c += 8) {
      const __m256 ok = _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(dr + c), magnitude),
                                      _mm256_set1_ps(3.4028234663852886e38f), _CMP_LE_OQ);
      bad += 8 - __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(ok)));
    }
#endif
    for (; c < cols; ++c) bad += !(std::fabs(dr[c]) <= 3.4028234663852886e38f);
  }
  return bad;
}

template <typename T>
int64_t scatter_piece(const T* s, float* d, int64_t rows, int64_t cols, int64_t ss, int64_t ds, float scale) {
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const T* sr = s + r * ss;
    float* dr = d + r * ds;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = static_cast<float>(sr[c]) * scale;
      dr[c] = v;
      bad += !(std::fabs(v) <= 3.4028234663852886e38f);  // NaN compares false
    }
  }
  return bad;
}

// fp32 pieces whose places are whole aligned vectors (every row): streamed out, so that no line of the
// place is read before it is written — a piece of a fused linear's ``b`` block writes its rank's columns
// of every row, and an ordinary store reads each line it writes into first (a rank-16 piece of a q/k/v
// block: 2.3x faster here). The same products and the same count as scatter_piece; the caller fences once.
int64_t scatter_piece_f32(const float* s, float* d, int64_t rows, int64_t cols, int64_t ss, int64_t ds, float scale) {
#if ROLLOUT_LANES == 16 || ROLLOUT_LANES == 8
  constexpr int64_t W = ROLLOUT_LANES;
  if (cols % W == 0 && ds % W == 0 && reinterpret_cast<uintptr_t>(d) % (W * sizeof(float)) == 0) {
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const float* sr = s + r * ss;
      float* dr = d + r * ds;
      for (int64_t c = 0; c < cols; c += W) {
#if ROLLOUT_LANES == 16
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sr + c), _mm512_set1_ps(scale));
        _mm512_stream_ps(dr + c, v);
        const __mmask16 ok = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(3.4028234663852886e38f), _CMP_LE_OQ);
        bad += W - __builtin_popcount(static_cast<unsigned>(ok));  // NaN compares false
#else
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(sr + c), _mm256_set1_ps(scale));
        _mm256_stream_ps(dr + c, v);
        const __m256 mag = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
        const __m256 ok = _mm256_cmp_ps(mag, _mm256_set1_ps(3.4028234663852886e38f), _CMP_LE_OQ);
        bad += W - __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(ok)));
#endif
      }
    }
    return bad;
  }
#endif
  return scatter_piece(s, d, rows, cols, ss, ds, scale);
}

}  // namespace

// src: uint8 bytes; dst: fp32; plan: int64 [n, 7] (src byte offset, dtype 0 fp32 / 1 bf16 / 2 fp16, rows,
// cols, src row stride, dst offset, dst row stride; strides and dst offset in elements); scales: fp32 [n].
// Returns the number of non-finite values written (an int64 scalar).
at::Tensor scatter_scaled(at::Tensor src, at::Tensor dst, at::Tensor plan, at::Tensor scales) {
  TORCH_CHECK(src.scalar_type() == at::kByte && src.is_contiguous() && dst.scalar_type() == at::kFloat &&
              dst.is_contiguous() && plan.scalar_type() == at::kLong && plan.dim() == 2 && plan.size(1) == 7 &&
              plan.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == plan.size(0),
              "scatter_scaled: uint8 src, fp32 dst, int64 plan [n, 7], fp32 scales [n]");
  const int64_t n = plan.size(0), src_bytes = src.numel(), dst_len = dst.numel();
  const int64_t* p = plan.data_ptr<int64_t>();
  const float* sc = scales.data_ptr<float>();
  const uint8_t* sb = src.data_ptr<uint8_t>();
  float* db = dst.data_ptr<float>();
  const int64_t item[3] = {4, 2, 2};
  for (int64_t i = 0; i < n; ++i) {  // every piece inside both buffers, before anything is written
    const int64_t* q = p + i * 7;
    TORCH_CHECK(q[1] >= 0 && q[1] <= 2 && q[2] >= 0 && q[3] >= 0 && q[4] >= q[3] && q[6] >= q[3] && q[0] >= 0 &&
                q[5] >= 0, "scatter_scaled: plan row ", i, " is malformed");
    if (q[2] == 0 || q[3] == 0) continue;
    TORCH_CHECK(q[0] % item[q[1]] == 0 && q[0] + ((q[2] - 1) * q[4] + q[3]) * item[q[1]] <= src_bytes &&
                q[5] + (q[2] - 1) * q[6] + q[3] <= dst_len, "scatter_scaled: plan row ", i, " lies outside a buffer");
  }
  // pieces split between the threads torch allows (one while a transfer still runs: the caller's choice), as
  // runs of whole pieces of about equal bytes; each piece is written by one thread, so the bits never depend on it
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += p[i * 7 + 2] * p[i * 7 + 3];
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total >> 17));
  std::vector<int64_t> cut(parts + 1, n), bad(parts, 0);
  cut[0] = 0;
  for (int64_t i = 0, k = 1, acc = 0; i < n && k < parts; ++i) {
    acc += p[i * 7 + 2] * p[i * 7 + 3];
    if (acc * parts >= total * k) cut[k++] = i + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      int64_t b = 0;
      for (int64_t i = cut[k]; i < cut[k + 1]; ++i) {
        const int64_t* q = p + i * 7;
        const uint8_t* s = sb + q[0];
        float* d = db + q[5];
        if (q[1] == 0 && static_cast<const void*>(s) == static_cast<const void*>(d) && q[4] == q[6] && sc[i] == 1.0f)
          b += count_piece(d, q[2], q[3], q[6]);  // received in place: already what a copy would write
        else if (q[1] == 0)
          b += scatter_piece_f32(reinterpret_cast<const float*>(s), d, q[2], q[3], q[4], q[6], sc[i]);
        else if (q[1] == 1)
          b += scatter_piece(reinterpret_cast<const at::BFloat16*>(s), d, q[2], q[3], q[4], q[6], sc[i]);
        else
          b += scatter_piece(reinterpret_cast<const at::Half*>(s), d, q[2], q[3], q[4], q[6], sc[i]);
      }
      bad[k] = b;
    }
#if ROLLOUT_LANES >= 8
    _mm_sfence();  // this thread's streamed rows are visible before anyone reads the buffer
#endif
  });
  auto out = plan.new_empty({});
  int64_t sum = 0;
  for (int64_t b : bad) sum += b;
  *out.data_ptr<int64_t>() = sum;
  return out;
}
