// Paged decode attention on CPU that reads K/V blocks where they lie in the cache.
//
// The torch path (rollout.layers.attention) gathers every decoding sequence's blocks into a
// dense copy for SDPA: at batch 256 and 140-token contexts that is ~0.8 GB written and read again
// per step on SmolLM2, a fifth of the step (benchmarks/NOTES.md). This kernel walks each
// sequence's block table instead, a block at a time: one work item per sequence (all its KV heads,
// which lie side by side in the cache) or, at batches too small to share the threads, per
// (sequence, KV head); bf16 rows widened in registers as they are read, in a paired lane order that
// needs one load and two integer operations per 2 vectors (other dtypes: a block's rows widened to
// fp32 once for all the query heads of their KV head; GQA without repeats either way), register
// kernels for head sizes of 2-32 vectors, scores and
// softmax in fp32 (max-subtracted, as SDPA), values accumulated in fp32, one rounding to the cache
// dtype at the end. Parallel over work items with
// at::parallel_for (the calling thread's OpenMP team, shared with torch's own runtime). Dot
// products, the exponentials (a polynomial of our own, within 2 ulp of expf) and the softmax and
// value sums are explicit vector code in a fixed order (no -ffast-math).
//
// It is C++ compiled on first use with the machine's compiler, for the CPU's instruction set and
// without -ffast-math (rollout.kernels.cpu.build); without a compiler the engine keeps the
// torch path and says so once in its log. Its precision is that of the gather path: both are
// within one bf16 rounding of an fp32 computation over the same bf16 K/V values (tested).

namespace {

// Vectors of ROLLOUT_LANES floats (the build's ISA: AVX-512 16, AVX2 8) through GCC's vector
// extensions; every sum runs in a fixed order (no -ffast-math).
constexpr int PL = ROLLOUT_LANES;
typedef float pvf __attribute__((vector_size(PL * 4)));
typedef int32_t pvi __attribute__((vector_size(PL * 4)));

inline pvf pload(const float* p) { pvf v; std::memcpy(&v, p, sizeof v); return v; }
inline void pstore(float* p, pvf v) { std::memcpy(p, &v, sizeof v); }
// the lanes of v summed (halves, then quarters ...): a fixed order, a short dependency chain
inline float psum(pvf v) {
  float t[PL];
  std::memcpy(t, &v, sizeof v);
  for (int w = PL / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

// a . b over n floats: two vector chains (even and odd vectors), a scalar tail
inline float dot(const float* a, const float* b, int64_t n) {
  pvf acc = {}, acc2 = {};
  int64_t d = 0;
  for (; d + 2 * PL <= n; d += 2 * PL) {
    acc += pload(a + d) * pload(b + d);
    acc2 += pload(a + d + PL) * pload(b + d + PL);
  }
  for (; d + PL <= n; d += PL) acc += pload(a + d) * pload(b + d);
  float s = psum(acc + acc2);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// exp(x) for x <= 0 (scores minus their maximum): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes'
// degree-6 polynomial, 2^n put into the exponent bits. Within 2 ulp of expf on [-87, 0]; below that
// it returns exp(-87.3) ~ 1e-38 (nothing next to the maximum's 1).
inline pvf pexp(pvf x) {
  const pvf lo = pvf{} - 87.3f;
  x = x < lo ? lo : x;
  const pvf fx = x * 1.44269504088896341f + 0.5f;
  pvi n = __builtin_convertvector(fx, pvi);
  n += (pvi)(__builtin_convertvector(n, pvf) > fx);  // truncation -> floor (the comparison is -1 where true)
  const pvf nf = __builtin_convertvector(n, pvf);
  const pvf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  pvf p = pvf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const pvi bits = (n + 127) << 23;
  pvf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// s[0:n] = exp(s - m), returns their sum
inline float exp_sum(float* s, int64_t n, float m) {
  pvf acc = {};
  int64_t t = 0;
  for (; t + PL <= n; t += PL) {
    const pvf e = pexp(pload(s + t) - m);
    pstore(s + t, e);
    acc += e;
  }
  float sum = psum(acc);
  if (t < n) {  // the tail through the same vector exp: every score by one formula
    float tail[PL];
    for (int i = 0; i < PL; ++i) tail[i] = t + i < n ? s[t + i] : m - 100.f;
    const pvf e = pexp(pload(tail) - m);
    for (int64_t i = 0; t + i < n; ++i) { s[t + i] = e[i]; sum += e[i]; }
  }
  return sum;
}

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

typedef uint16_t pvh __attribute__((vector_size(PL * 2)));
typedef uint32_t pvu __attribute__((vector_size(PL * 4)));

inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {  // bf16 is fp32's top half
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t d = 0;
  for (; d + PL <= n; d += PL) {
    pvh h;
    std::memcpy(&h, s + d, sizeof h);
    const pvu u = __builtin_convertvector(h, pvu) << 16;
    std::memcpy(dst + d, &u, sizeof u);
  }
  for (; d < n; ++d) {
    const uint32_t bits = static_cast<uint32_t>(s[d]) << 16;
    std::memcpy(dst + d, &bits, sizeof(float));
  }
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// bf16 rows widened in "paired" order: each run of 2 PL values, read as PL 32-bit words, becomes its
// even elements (the word shifted up) then its odd ones (the word's top half): one load and two
// integer operations per 2 PL values. Query, keys and values of a head all take this order, so
// dot products see the same pairs; the value sums are put back in order at the end (store_unpaired).
inline void to_float_paired(const at::BFloat16* src, float* dst, int64_t n) {  // n: a multiple of 2 PL
  const pvu top = pvu{} + 0xffff0000u;
  for (int64_t d = 0; d < n; d += 2 * PL) {
    pvu w;
    std::memcpy(&w, reinterpret_cast<const uint16_t*>(src) + d, sizeof w);
    const pvu even = w << 16, odd = w & top;
    std::memcpy(dst + d, &even, sizeof even);
    std::memcpy(dst + d + PL, &odd, sizeof odd);
  }
}

// The lanes' sums of PL vectors as one vector (lane j: the sum of a[j]'s lanes) in psum's order —
// each lane with the one half a vector away, then a quarter, ... — so a dot product here is bit for
// bit dot()'s: fold<S>(a, b) adds, within a and within b, each group of S lanes to the group after it
// (the two results side by side); PL / 2, PL / 4, ..., 1 (the shuffles: fold_shuffles()).
#if ROLLOUT_LANES == 4
template <int S> inline std::enable_if_t<S == 2, pvf> fold(pvf a, pvf b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7);
}
template <int S> inline std::enable_if_t<S == 1, pvf> fold(pvf a, pvf b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6) + __builtin_shufflevector(a, b, 1, 3, 5, 7);
}
#elif ROLLOUT_LANES == 8
template <int S> inline std::enable_if_t<S == 4, pvf> fold(pvf a, pvf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
template <int S> inline std::enable_if_t<S == 2, pvf> fold(pvf a, pvf b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
}
template <int S> inline std::enable_if_t<S == 1, pvf> fold(pvf a, pvf b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
#elif ROLLOUT_LANES == 16
template <int S> inline std::enable_if_t<S == 8, pvf> fold(pvf a, pvf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
template <int S> inline std::enable_if_t<S == 4, pvf> fold(pvf a, pvf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
template <int S> inline std::enable_if_t<S == 2, pvf> fold(pvf a, pvf b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) + __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
template <int S> inline std::enable_if_t<S == 1, pvf> fold(pvf a, pvf b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif
template <int S>
inline void fold_levels(pvf* a, int n) {
  for (int j = 0; j < n / 2; ++j) a[j] = fold<S>(a[2 * j], a[2 * j + 1]);
  if constexpr (S > 1) fold_levels<S / 2>(a, n / 2);
}
inline pvf lane_sums(pvf* a) {  // overwrites a[0 .. PL)
  fold_levels<PL / 2>(a, PL);
  return a[0];
}

// Scores of one query head against cnt K rows (fp32, D apart): out[t] = (q . k_t) * scale.
// ND > 0: D = ND vectors, q held in registers, PL rows at a time, each dot in two chains (even and
// odd vectors, as dot()) whose lanes lane_sums adds up; ND == 0: any D, one dot() per row.
template <int ND>
inline void block_scores(const float* q, const float* k, int64_t cnt, int64_t D, float scale, float* out) {
  if constexpr (ND == 0) {
    for (int64_t t = 0; t < cnt; ++t) out[t] = dot(q, k + t * D, D) * scale;
  } else {
    pvf qv[ND];
    for (int d = 0; d < ND; ++d) qv[d] = pload(q + d * PL);
    for (int64_t t0 = 0; t0 < cnt; t0 += PL) {
      pvf a[PL];
      const int rows = static_cast<int>(std::min<int64_t>(PL, cnt - t0));
      for (int j = rows; j < PL; ++j) a[j] = pvf{};
      for (int j = 0; j < rows; ++j) {
        const float* kr = k + (t0 + j) * D;
        pvf c0 = {}, c1 = {};
        for (int d = 0; d + 1 < ND; d += 2) {
          c0 += qv[d] * pload(kr + d * PL);
          c1 += qv[d + 1] * pload(kr + (d + 1) * PL);
        }
        if (ND & 1) c0 += qv[ND - 1] * pload(kr + (ND - 1) * PL);
        a[j] = c0 + c1;
      }
      const pvf sc = lane_sums(a) * scale;
      if (t0 + PL <= cnt) {
        pstore(out + t0, sc);
      } else {
        for (int64_t j = 0; t0 + j < cnt; ++j) out[t0 + j] = sc[j];
      }
    }
  }
}

// acc[0:D] += sum over t of p[t] * v_t (rows fp32, D apart), in t's order; ND > 0: the
// accumulator in registers for the block
template <int ND>
inline void block_values(float* acc, const float* v, int64_t cnt, int64_t D, const float* p) {
  if constexpr (ND == 0) {
    for (int64_t t = 0; t < cnt; ++t) {
      const float w = p[t];
      const pvf wv = pvf{} + w;
      const float* vr = v + t * D;
      int64_t d = 0;
      for (; d + PL <= D; d += PL) pstore(acc + d, pload(acc + d) + wv * pload(vr + d));
      for (; d < D; ++d) acc[d] += w * vr[d];
    }
  } else {
    pvf a[ND];
    for (int d = 0; d < ND; ++d) a[d] = pload(acc + d * PL);
    for (int64_t t = 0; t < cnt; ++t) {
      const pvf wv = pvf{} + p[t];
      const float* vr = v + t * D;
      for (int d = 0; d < ND; ++d) a[d] += wv * pload(vr + d * PL);
    }
    for (int d = 0; d < ND; ++d) pstore(acc + d * PL, a[d]);
  }
}


// the largest of s[0:n] (n >= 1), vector lanes then the tail (the maximum whatever the order; a
// scalar std::max_element was 7 % of the kernel)
inline float max_of(const float* s, int64_t n) {
  int64_t t = 0;
  float m = s[0];
  if (n >= PL) {
    pvf v = pload(s);
    for (t = PL; t + PL <= n; t += PL) {
      const pvf x = pload(s + t);
      v = x > v ? x : v;
    }
    for (int i = 0; i < PL; ++i) m = std::max(m, v[i]);
  }
  for (; t < n; ++t) m = std::max(m, s[t]);
  return m;
}

// x rounded to bf16 as c10::BFloat16 does (nearest even; NaN -> 0x7fc0), in the low half of 32-bit lanes
inline pvu bf16_bits(pvf x) {
  pvu u;
  std::memcpy(&u, &x, sizeof u);
  const pvu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return x != x ? pvu{} + 0x7fc0u : r;
}

// out[0:n] = acc[0:n] / div in bf16, acc in paired order (n: a multiple of 2 PL) put back in order:
// each run of 2 PL values becomes PL 32-bit words, its even element in the low half, the odd one above
inline void store_unpaired(const float* acc, float div, at::BFloat16* out, int64_t n) {
  for (int64_t d = 0; d < n; d += 2 * PL) {
    const pvu w = bf16_bits(pload(acc + d) / div) | (bf16_bits(pload(acc + d + PL) / div) << 16);
    std::memcpy(reinterpret_cast<uint16_t*>(out) + d, &w, sizeof w);
  }
}

// The paired-order kernels reading a block's bf16 rows where they lie (tok_stride apart), widened in
// registers: the same arithmetic, in the same order, as widening the rows to fp32 first and calling
// block_scores / block_values, without writing and reading the widened copy.
template <int ND>
inline void widen_row(const at::BFloat16* src, pvf* out) {  // ND vectors, paired order
  const pvu top = pvu{} + 0xffff0000u;
  for (int c = 0; c < ND / 2; ++c) {
    pvu w;
    std::memcpy(&w, reinterpret_cast<const uint16_t*>(src) + c * 2 * PL, sizeof w);
    const pvu even = w << 16, odd = w & top;
    std::memcpy(&out[2 * c], &even, sizeof even);
    std::memcpy(&out[2 * c + 1], &odd, sizeof odd);
  }
}

template <int ND>
inline void block_scores_bf16(const float* q, const at::BFloat16* k, int64_t cnt, int64_t stride, float scale,
                              float* out) {
  pvf qv[ND];
  for (int d = 0; d < ND; ++d) qv[d] = pload(q + d * PL);
  for (int64_t t0 = 0; t0 < cnt; t0 += PL) {
    pvf a[PL];
    const int rows = static_cast<int>(std::min<int64_t>(PL, cnt - t0));
    for (int j = rows; j < PL; ++j) a[j] = pvf{};
    for (int j = 0; j < rows; ++j) {
      pvf kv[ND];
      widen_row<ND>(k + (t0 + j) * stride, kv);
      pvf c0 = {}, c1 = {};
      for (int d = 0; d + 1 < ND; d += 2) {
        c0 += qv[d] * kv[d];
        c1 += qv[d + 1] * kv[d + 1];
      }
      a[j] = c0 + c1;
    }
    const pvf sc = lane_sums(a) * scale;
    if (rows == PL) {
      pstore(out + t0, sc);
    } else {
      for (int j = 0; j < rows; ++j) out[t0 + j] = sc[j];
    }
  }
}

// acc[i * ND * PL ...] += sum over t of p_i[t] * v_t for the G query heads i of one KV head (p_i = p + i * n)
template <int ND, int G>
inline void block_values_bf16(float* acc, const at::BFloat16* v, int64_t cnt, int64_t stride, const float* p,
                              int64_t n) {
  pvf a[G][ND];
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) a[i][d] = pload(acc + (i * ND + d) * PL);
  for (int64_t t = 0; t < cnt; ++t) {
    pvf vv[ND];
    widen_row<ND>(v + t * stride, vv);
    for (int i = 0; i < G; ++i) {
      const pvf wv = pvf{} + p[i * n + t];
      for (int d = 0; d < ND; ++d) a[i][d] += wv * vv[d];
    }
  }
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) pstore(acc + (i * ND + d) * PL, a[i][d]);
}

// One work item is a sequence and a range of its KV heads: all of them where there are enough
// sequences to share the threads, one each at small batches. A token's K (or V) values of all its
// heads lie side by side in the cache, so an item reads each block it touches as one contiguous run,
// in the cache's order (the hardware prefetcher follows it; a head at a time, strided, was 1.3x
// slower); bf16 rows are widened in registers where they are used, other dtypes to fp32 rows once for
// every query head of their KV head. Blocks lie anywhere, so the loops ask for the next block while
// one is used, and (bf16) for a block's values while its keys are scored. Measured on AVX2 (AMD
// EPYC): one sequence per item 2-3x faster than one head per item at batch 64+; the in-order block
// copies and register kernels another 1.2-1.3x at batch 224. On Zen 4 (AVX-512) random 6 KB blocks
// read at ~9.5 GB/s a thread against ~30 streaming, and this kernel reaches about half of that at
// grpo-short's contexts: memory bounds it there (benchmarks/NOTES.md).
// The prefetch is an asm statement: GCC 12 judged a helper holding only __builtin_prefetch free of
// side effects and deleted its calls, so the kernel asked for nothing until 2026-12-03.
inline void prefetch_bytes(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < n; off += 64) {
#if defined(__x86_64__)
    asm volatile("prefetcht0 %0" : : "m"(c[off]));
#else
    __builtin_prefetch(c + off, 0, 3);
#endif
  }
}

// team == 0: every work item through at::parallel_for; else the share of thread tid of a team of that
// many that runs this same call (rollout.kernels.cpu.fused's decode_stack). An item's output is the same
// whatever the thread or the split.
template <typename T, int ND>
void decode_nd(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
               int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks,
               int64_t blk_stride, int64_t tok_stride, int64_t head_stride, float scale, int64_t window,
               int64_t team, int64_t tid) {
  constexpr bool paired = std::is_same_v<T, at::BFloat16> && ND > 0 && ND % 2 == 0;
  auto widen = [](const T* src, float* dst, int64_t n) {
    if constexpr (paired) to_float_paired(src, dst, n); else to_float(src, dst, n);
  };
  const int64_t g = Hq / Hkv;
  const int64_t per_item = B >= 2 * (team > 0 ? team : at::get_num_threads()) ? Hkv : 1;  // KV heads per work item
  const int64_t groups = (Hkv + per_item - 1) / per_item;
  auto work = [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_item * g * D), acc(per_item * g * D), rows(paired ? 0 : per_item * bs * D), scores,
        total(per_item * g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / groups, h0 = (item % groups) * per_item, nh = std::min(per_item, Hkv - h0);
      const int64_t hq = nh * g;  // query heads of this item, h0 * g onwards
      const int64_t len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      const int64_t* table = tables + b * max_blocks;
      const int64_t run = ((nh - 1) * head_stride + D) * static_cast<int64_t>(sizeof(T));  // bytes per token
      // ask for the tokens of the block holding pos, from pos to the block's end
      auto prefetch_block = [&](const T* cache, int64_t pos) {
        if (pos >= len) return;
        const T* p = cache + table[pos / bs] * blk_stride + (pos % bs) * tok_stride + h0 * head_stride;
        for (int64_t j = 0; j < std::min(bs - pos % bs, len - pos); ++j) prefetch_bytes(p + j * tok_stride, run);
      };
      // g(t, base, cnt) for each run of cnt context tokens from t that lies in one block (base: its first
      // token's row of KV head h0); the next block of cache (and this one of also) asked for first
      auto each_block = [&](const T* cache, const T* also, auto&& g) {
        for (int64_t pos = start; pos < len;) {
          const int64_t off = pos % bs, cnt = std::min(bs - off, len - pos);
          prefetch_block(cache, pos + cnt);
          if (also != nullptr) prefetch_block(also, pos);
          g(pos - start, cache + table[pos / bs] * blk_stride + off * tok_stride + h0 * head_stride, cnt);
          pos += cnt;
        }
      };
      // f(t, hh, KV head hh's rows as fp32 (D apart), cnt) for each block run
      auto blocks = [&](const T* cache, auto&& f) {
        each_block(cache, nullptr, [&](int64_t t, const T* base, int64_t cnt) {
          for (int64_t j = 0; j < cnt; ++j)  // in the cache's order: token by token, its heads side by side
            for (int64_t hh = 0; hh < nh; ++hh)
              widen(base + j * tok_stride + hh * head_stride, rows.data() + (hh * bs + j) * D, D);
          for (int64_t hh = 0; hh < nh; ++hh) f(t, hh, static_cast<const float*>(rows.data() + hh * bs * D), cnt);
        });
      };
      // f(t, hh, KV head hh's rows where they lie (tok_stride apart), cnt): the paired bf16 kernels
      auto raw_blocks = [&](const T* cache, const T* also, auto&& f) {
        each_block(cache, also, [&](int64_t t, const T* base, int64_t cnt) {
          for (int64_t hh = 0; hh < nh; ++hh) f(t, hh, base + hh * head_stride, cnt);
        });
      };
      prefetch_block(kc, start);
      for (int64_t i = 0; i < hq; ++i) widen(q + (b * Hq + h0 * g + i) * D, qf.data() + i * D, D);
      scores.resize(hq * n);
      if constexpr (paired) {
        raw_blocks(kc, vc, [&](int64_t t, int64_t hh, const T* k, int64_t cnt) {
          for (int64_t i = hh * g; i < (hh + 1) * g; ++i)
            block_scores_bf16<ND>(qf.data() + i * D, k, cnt, tok_stride, scale, scores.data() + i * n + t);
        });
      } else {
        blocks(kc, [&](int64_t t, int64_t hh, const float* k, int64_t cnt) {
          for (int64_t i = hh * g; i < (hh + 1) * g; ++i)
            block_scores<ND>(qf.data() + i * D, k, cnt, D, scale, scores.data() + i * n + t);
        });
      }
      for (int64_t i = 0; i < hq; ++i) {
        float* s = scores.data() + i * n;
        total[i] = exp_sum(s, n, max_of(s, n));
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      if constexpr (paired) {  // the query heads of a KV head four at a time (accumulators in registers)
        raw_blocks(vc, nullptr, [&](int64_t t, int64_t hh, const T* v, int64_t cnt) {
          for (int64_t i = hh * g; i < (hh + 1) * g; i += 4) {
            float* a = acc.data() + i * D;
            const float* p = scores.data() + i * n + t;
            switch (std::min<int64_t>(4, (hh + 1) * g - i)) {
              case 1: block_values_bf16<ND, 1>(a, v, cnt, tok_stride, p, n); break;
              case 2: block_values_bf16<ND, 2>(a, v, cnt, tok_stride, p, n); break;
              case 3: block_values_bf16<ND, 3>(a, v, cnt, tok_stride, p, n); break;
              default: block_values_bf16<ND, 4>(a, v, cnt, tok_stride, p, n);
            }
          }
        });
      } else {
        blocks(vc, [&](int64_t t, int64_t hh, const float* v, int64_t cnt) {
          for (int64_t i = hh * g; i < (hh + 1) * g; ++i)
            block_values<ND>(acc.data() + i * D, v, cnt, D, scores.data() + i * n + t);
        });
      }
      T* o = out + (b * Hq + h0 * g) * D;
      for (int64_t i = 0; i < hq; ++i)
        if constexpr (paired) {
          store_unpaired(acc.data() + i * D, total[i], o + i * D, D);
        } else {
          for (int64_t d = 0; d < D; ++d) o[i * D + d] = static_cast<T>(acc[i * D + d] / total[i]);
        }
    }
  };
  if (team == 0) {
    at::parallel_for(0, B * groups, 1, work);
  } else {
    const int64_t items = B * groups, begin = items * tid / team, end = items * (tid + 1) / team;
    if (begin < end) work(begin, end);
  }
}

// the register kernels for head sizes of 2 - 32 vectors (D = 64 or 128 on every ISA), the general
// loops for any other
template <typename T>
void decode(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
            int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks,
            int64_t blk_stride, int64_t tok_stride, int64_t head_stride, float scale, int64_t window,
            int64_t team = 0, int64_t tid = 0) {
  auto run = [&](auto nd) {
    decode_nd<T, decltype(nd)::value>(q, kc, vc, tables, lens, out, B, Hq, Hkv, D, bs, max_blocks, blk_stride,
                                      tok_stride, head_stride, scale, window, team, tid);
  };
  const int64_t nd = D % PL == 0 ? D / PL : 0;
  switch (nd) {
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 8: run(std::integral_constant<int, 8>{}); break;
    case 16: run(std::integral_constant<int, 16>{}); break;
    case 32: run(std::integral_constant<int, 32>{}); break;
    default: run(std::integral_constant<int, 0>{});
  }
}

}  // namespace

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                           at::Tensor lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(), "bad cache strides");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  q = q.contiguous();
  tables = tables.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == D, "bad head layout");
  auto out = q.new_empty(q.sizes());  // q is contiguous
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, Hq, Hkv, D,
                     bs, tables.size(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     static_cast<float>(scale), window);
  });
  return out;
}
