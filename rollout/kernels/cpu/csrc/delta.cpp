// Delta weight pushes (weight_sync.delta) in one pass over the weights' bits, on every core:
//
//   delta_fingerprint  a tensor's fingerprint (or a TP rank's part of it): the sum over its elements of the
//                      element's bits times the odd multiplier m(salt, g) of its full-tensor flat index g,
//                      mod 2^64. The elements lie as [outer, length, inner] of a full [outer, size, inner]
//                      tensor, starting at ``start`` of its middle dimension (a whole tensor: 1, n, 1, n, 0).
//   delta_diff_many    for each (now, base) pair, the flat indices at which ``now``'s bits differ from
//                      ``base``'s (increasing), the new words there, and how far the fingerprint moves from base to
//                      now, (now - base) * m summed over them. ``now`` may be fp32 values against a bf16 base: each
//                      rounded to bf16 as torch rounds it (to nearest even; a NaN as a quiet NaN — torch's own
//                      scalar and vector casts differ there, and an engine refuses NaN) while compared, in vector
//                      registers, the cast never written out. One call for a whole model: one parallel region over
//                      chunks of every tensor (a call per tensor cost ~0.1 ms of thread wake-ups: 30 ms over a
//                      272-tensor model). The found entries come out laid as a weight bucket lays tensors (each at
//                      a multiple of ``align``), so they go on the wire from where they lie; ``in_place`` writes
//                      the new words into the base as they are found (the old ones come back, to undo it).
//   delta_apply_many   sparse entries written where a TP rank holds them: for each (full-tensor flat index,
//                      value) whose index falls in the rank's run, the old word kept, the new one written, and
//                      the fingerprint's move summed; applied again with the old words, they undo themselves.
//   delta_check_many   whether sparse entries can apply: indices in range and increasing, values finite.
//   delta_fingerprint_at  the fingerprint's terms of some elements at given full-tensor flat indices.
//
// m(salt, g) = ((g ^ salt) * K1 + K2) | 1 in wrapping 64-bit arithmetic, as weight_sync.delta.multipliers
// computes it in int64 tensors: the same sums, bit for bit (a sum mod 2^64 is the same in any order).
// Bits are the elements' unsigned patterns: uint16 for bf16 and fp16, uint32 for fp32.

namespace {

constexpr uint64_t DELTA_K1 = 0x9E3779B97F4A7C15ull, DELTA_K2 = 0x2545F4914F6CDD1Dull;

inline uint64_t multiplier(uint64_t g, uint64_t salt) { return ((g ^ salt) * DELTA_K1 + DELTA_K2) | 1ull; }

// sum of bits[k] * m(salt, g0 + k) for k < n: g runs on with k (a contiguous run of the full tensor)
template <typename B>
uint64_t run_terms(const B* bits, int64_t n, uint64_t g0, uint64_t salt) {
  uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) acc[j] += static_cast<uint64_t>(bits[k + j]) * multiplier(g0 + k + j, salt);
  uint64_t total = 0;
  for (int j = 0; j < 8; ++j) total += acc[j];
  for (; k < n; ++k) total += static_cast<uint64_t>(bits[k]) * multiplier(g0 + k, salt);
  return total;
}

template <typename B>
uint64_t fingerprint_rows(const B* bits, int64_t outer, int64_t length, int64_t inner, int64_t size, int64_t start,
                          uint64_t salt) {
  const int64_t run = length * inner;  // one outer index's elements: contiguous in the full tensor too
  const int64_t n = outer * run;
  // the elements cut into chunks anywhere (a chunk may start and end inside a run): each walks its own, run by run
  const int64_t chunk = std::max<int64_t>(1 << 16, (n + 63) / 64);
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::vector<uint64_t> parts(static_cast<size_t>(chunks), 0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t k = c * chunk;
    const int64_t end = std::min(n, k + chunk);
    uint64_t total = 0;
    while (k < end) {
      const int64_t o = k / run, r = k % run, take = std::min(end - k, run - r);
      const uint64_t g = static_cast<uint64_t>(o * size * inner + start * inner + r);
      total += run_terms(bits + k, take, g, salt);
      k += take;
    }
    parts[static_cast<size_t>(c)] = total;
  }
  uint64_t total = 0;
  for (uint64_t p : parts) total += p;
  return total;
}

// fp32 -> bf16 bits as torch's cast gives them: to nearest even (any NaN as 0x7FC0, torch's scalar cast's)
inline uint16_t torch_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if ROLLOUT_LANES == 16
// torch_bf16 of 16 fp32 values at once, each word in a 32-bit lane (the same integer arithmetic, lane by lane)
inline __m512i torch_bf16_lanes(const float* p) {
  const __m512i u = _mm512_loadu_si512(p);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}
#elif ROLLOUT_LANES == 8
// torch_bf16 of 16 fp32 values at once, as 16 words in order
inline __m256i torch_bf16x16(const float* p) {
  auto eight = [](const float* q) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));  // (both sides below 2^31: signed is right)
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  };
  // packus interleaves 128-bit halves: [a0-3 b0-3 a4-7 b4-7]; the permute puts them back in order
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(eight(p), eight(p + 8)), 0xD8);
}
#endif

// The changes a diff finds, kept by each thread in an arena of its own that lives as long as the thread
// (OpenMP's workers and the caller's): most pushes find about as many as the last, and fresh memory each call
// costs a page fault every 4 KiB. Per change its offset in its chunk (below 2^32), its new word and its old one,
// in three arrays (a vector's worth of changes is stored at once). An arena past ARENA_KEEP changes (a first
// step's) is let go after the call.
struct Arena {
  std::vector<uint32_t> off, now, old;
  size_t size = 0;
  // room for n more changes and a vector's slack past them (a vector store writes all its lanes)
  void room(size_t n) {
    if (size + n + 32 > off.size()) {
      const size_t cap = std::max(size + n + 32, 2 * off.size());
      off.resize(cap);
      now.resize(cap);
      old.resize(cap);
    }
  }
};
constexpr size_t ARENA_KEEP = size_t{1} << 22;
inline Arena& arena() {
  static thread_local Arena mine;
  return mine;
}

// what one chunk of a diff found: where its changes lie (an arena and the range in it)
struct Found {
  const Arena* in = nullptr;
  size_t begin = 0, end = 0;
};

#if ROLLOUT_LANES == 16
// the lanes of mask m appended at n: their offsets (from ``at``), new words and old words; the new count
inline size_t keep16(__mmask16 m, uint32_t at, __m512i words, __m512i olds, Arena& a, size_t n) {
  const __m512i iota = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(at)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  _mm512_storeu_si512(a.off.data() + n, _mm512_maskz_compress_epi32(m, iota));
  _mm512_storeu_si512(a.now.data() + n, _mm512_maskz_compress_epi32(m, words));
  _mm512_storeu_si512(a.old.data() + n, _mm512_maskz_compress_epi32(m, olds));
  return n + static_cast<size_t>(__builtin_popcount(m));
}

inline __m512i lanes_lo(__m512i w16) { return _mm512_cvtepu16_epi32(_mm512_castsi512_si256(w16)); }
inline __m512i lanes_hi(__m512i w16) { return _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w16, 1)); }

// A block of 32 elements at chunk offset ``at``: its changes appended at n (no branch per change: the changed
// lanes compressed and stored whole); the new count. ``in_place``: the changed base words replaced (masked store).
template <typename N, typename B>
inline size_t scan32(const N* now, B* base, uint32_t at, bool in_place, Arena& a, size_t n) {
  if constexpr (sizeof(B) == 4) {  // fp32 words against fp32 words
    const __m512i w0 = _mm512_loadu_si512(now), w1 = _mm512_loadu_si512(now + 16);
    const __m512i b0 = _mm512_loadu_si512(base), b1 = _mm512_loadu_si512(base + 16);
    const __mmask16 m0 = _mm512_cmpneq_epi32_mask(w0, b0), m1 = _mm512_cmpneq_epi32_mask(w1, b1);
    if (!(m0 | m1)) return n;
    if (in_place) {
      _mm512_mask_storeu_epi32(base, m0, w0);
      _mm512_mask_storeu_epi32(base + 16, m1, w1);
    }
    return keep16(m1, at + 16, w1, b1, a, keep16(m0, at, w0, b0, a, n));
  } else {
    __m512i w, l0, l1;  // 32 words, and as 32-bit lanes
    if constexpr (std::is_same<N, B>::value) {
      w = _mm512_loadu_si512(now);
      l0 = lanes_lo(w);
      l1 = lanes_hi(w);
    } else {
      l0 = torch_bf16_lanes(now);
      l1 = torch_bf16_lanes(now + 16);
      w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(l0)), _mm512_cvtepi32_epi16(l1), 1);
    }
    const __m512i b = _mm512_loadu_si512(base);
    const __mmask32 m = _mm512_cmpneq_epi16_mask(w, b);
    if (!m) return n;
    if (in_place) _mm512_mask_storeu_epi16(base, m, w);
    n = keep16(static_cast<__mmask16>(m), at, l0, lanes_lo(b), a, n);
    return keep16(static_cast<__mmask16>(m >> 16), at + 16, l1, lanes_hi(b), a, n);
  }
}
#else
// A block of 32 elements: now's words (as they lie, or fp32 values rounded to bf16 words) into ``words``, and
// bit j set where words[j] != base[j]. Most blocks differ nowhere: the words are then not written out.
template <typename N, typename B>
inline uint32_t block32(const N* now, const B* base, B* words) {
  if constexpr (std::is_same<N, B>::value) {
    B any = 0;
    for (int j = 0; j < 32; ++j) any |= now[j] ^ base[j];  // vectorised
    if (!any) return 0;
    uint32_t mask = 0;
    for (int j = 0; j < 32; ++j) mask |= static_cast<uint32_t>(now[j] != base[j]) << j;
    std::memcpy(words, now, 32 * sizeof(B));
    return mask;
  } else {
#if ROLLOUT_LANES == 8
    const __m256i lo = torch_bf16x16(now), hi = torch_bf16x16(now + 16);
    const uint32_t same_lo = static_cast<uint32_t>(_mm256_movemask_epi8(
        _mm256_cmpeq_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base)))));
    const uint32_t same_hi = static_cast<uint32_t>(_mm256_movemask_epi8(
        _mm256_cmpeq_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 16)))));
    if ((same_lo & same_hi) == 0xFFFFFFFFu) return 0;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + 16), hi);
    uint32_t mask = 0;  // a word differs where its two bytes' bits are not both set
    for (int j = 0; j < 16; ++j) {
      mask |= static_cast<uint32_t>(((same_lo >> (2 * j)) & 3u) != 3u) << j;
      mask |= static_cast<uint32_t>(((same_hi >> (2 * j)) & 3u) != 3u) << (16 + j);
    }
    return mask;
#else
    uint16_t any = 0;
    for (int j = 0; j < 32; ++j) {  // vectorised
      words[j] = torch_bf16(now[j]);
      any |= static_cast<uint16_t>(words[j] ^ base[j]);
    }
    if (!any) return 0;
    uint32_t mask = 0;
    for (int j = 0; j < 32; ++j) mask |= static_cast<uint32_t>(words[j] != base[j]) << j;
    return mask;
#endif
  }
}
#endif

// now's words (as they lie, N = B; or fp32 values rounded to bf16 words on the way, N = float, B = uint16_t)
// against base's over [lo, hi), the changes into this thread's arena; ``in_place``: each changed base word
// replaced by the new one (the old kept)
template <typename N, typename B>
void diff_range(const N* now, B* base, int64_t lo, int64_t hi, bool in_place, Found& f) {
  Arena& a = arena();
  a.room(static_cast<size_t>(hi - lo));  // at most every element changed: no check per block
  f.in = &a;
  f.begin = a.size;
  size_t n = a.size;
  auto take = [&](int64_t k, B word) {
    a.off[n] = static_cast<uint32_t>(k - lo);
    a.now[n] = word;
    a.old[n] = base[k];
    ++n;
    if (in_place) base[k] = word;
  };
  int64_t i = lo;
#if ROLLOUT_LANES == 16
  for (; i + 32 <= hi; i += 32) n = scan32(now + i, base + i, static_cast<uint32_t>(i - lo), in_place, a, n);
#else
  alignas(64) B block[32];
  for (; i + 32 <= hi; i += 32)
    for (uint32_t mask = block32(now + i, base + i, block); mask; mask &= mask - 1) {
      const int j = __builtin_ctz(mask);
      take(i + j, block[j]);
    }
#endif
  for (; i < hi; ++i) {
    B word;
    if constexpr (std::is_same<N, B>::value) word = now[i];
    else word = torch_bf16(now[i]);
    if (word != base[i]) take(i, word);
  }
  a.size = f.end = n;
}

template <typename B>
uint64_t terms_at(const B* bits, const int64_t* g, int64_t n, uint64_t salt) {
  uint64_t total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static) if (n > (1 << 16))
  for (int64_t k = 0; k < n; ++k) total += static_cast<uint64_t>(bits[k]) * multiplier(static_cast<uint64_t>(g[k]), salt);
  return total;
}

inline void check_bits(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), what, ": a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kShort || t.scalar_type() == at::kInt, what,
              ": the bits of bf16/fp16 (int16) or fp32 (int32) weights");
}

}  // namespace

// bits: int16 (bf16, fp16) or int32 (fp32) words laid as [outer, length, inner]; out: int64 [1] (the sum)
at::Tensor delta_fingerprint(const at::Tensor& bits, int64_t salt, int64_t outer, int64_t length, int64_t inner,
                             int64_t size, int64_t start, at::Tensor out) {
  check_bits(bits, "delta_fingerprint");
  TORCH_CHECK(bits.numel() == outer * length * inner, "delta_fingerprint: outer * length * inner elements");
  const uint64_t s = static_cast<uint64_t>(salt);
  const uint64_t total = bits.scalar_type() == at::kShort
      ? fingerprint_rows(reinterpret_cast<const uint16_t*>(bits.data_ptr()), outer, length, inner, size, start, s)
      : fingerprint_rows(reinterpret_cast<const uint32_t*>(bits.data_ptr()), outer, length, inner, size, start, s);
  out.data_ptr<int64_t>()[0] = static_cast<int64_t>(total);
  return out;
}

namespace {

// indices [k0, k1) of one sparse entry into dst (see delta_apply_many): {the fingerprint's move, the words written}
template <typename W, typename I>
std::pair<uint64_t, int64_t> apply_range(W* d, const I* idx, const W* v, W* o, int64_t k0, int64_t k1, uint64_t salt,
                                         int64_t length, int64_t inner, int64_t size, int64_t start) {
  const bool whole = start == 0 && length == size;  // the rank holds all of it: a full index is its own
  uint64_t moved = 0;
  int64_t wrote = 0;
  for (int64_t k = k0; k < k1; ++k) {
    // the places lie scattered through the tensor (each a cache miss of its own): each fetched a few ahead
    if (whole && k + 16 < k1) __builtin_prefetch(d + static_cast<int64_t>(idx[k + 16]), 1);
    const int64_t g = static_cast<int64_t>(idx[k]);
    int64_t loc = g;
    if (!whole) {  // where the rank holds part of the tensor: (outer, mid, b) around the split dimension
      const int64_t outer = g / (size * inner), rest = g % (size * inner), mid = rest / inner, b = rest % inner;
      if (mid < start || mid >= start + length) {
        o[k] = v[k];
        continue;
      }
      loc = (outer * length + (mid - start)) * inner + b;
    }
    o[k] = d[loc];
    d[loc] = v[k];
    moved += (static_cast<uint64_t>(v[k]) - static_cast<uint64_t>(o[k])) * multiplier(static_cast<uint64_t>(g), salt);
    ++wrote;
  }
  return {moved, wrote};
}

std::pair<uint64_t, int64_t> apply_range(at::Tensor& dst, const at::Tensor& indices, const at::Tensor& values,
                                         at::Tensor& old, int64_t k0, int64_t k1, const int64_t* p) {
  const uint64_t salt = static_cast<uint64_t>(p[0]);
  auto words = [&](auto* d) {
    using W = std::remove_pointer_t<decltype(d)>;
    const W* v = reinterpret_cast<const W*>(values.data_ptr());
    W* o = reinterpret_cast<W*>(old.data_ptr());
    return indices.scalar_type() == at::kLong
        ? apply_range(d, indices.data_ptr<int64_t>(), v, o, k0, k1, salt, p[1], p[2], p[3], p[4])
        : apply_range(d, indices.data_ptr<int32_t>(), v, o, k0, k1, salt, p[1], p[2], p[3], p[4]);
  };
  return dst.scalar_type() == at::kShort ? words(reinterpret_cast<uint16_t*>(dst.data_ptr()))
                                         : words(reinterpret_cast<uint32_t*>(dst.data_ptr()));
}

void check_apply(const at::Tensor& dst, const at::Tensor& indices, const at::Tensor& values, const at::Tensor& old) {
  check_bits(dst, "delta_apply_many");
  TORCH_CHECK(values.scalar_type() == dst.scalar_type() && old.scalar_type() == dst.scalar_type() &&
              values.is_contiguous() && old.is_contiguous() && values.numel() == indices.numel() &&
              old.numel() == indices.numel(), "delta_apply_many: values and old words of dst's type, one per index");
  TORCH_CHECK(indices.is_contiguous() && (indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong),
              "delta_apply_many: int32 or int64 indices");
}

}  // namespace

// Sparse entries written where a rank holds them, in one call: each dst the rank's contiguous words, laid as
// [outer, length, inner] of a full [outer, size, inner] tensor from ``start`` of its middle dimension; indices:
// full-tensor flat indices (int32 or int64); values: words as many; olds: words as many (written: the old word
// where the rank holds the index, the value elsewhere); params: int64 [k, 6] (salt, length, inner, size, start,
// counts: whether the moves count — a replicated tensor counts on one rank); out: int64 [k, 2] (each entry's
// fingerprint move, the words it wrote). One parallel region over runs of at most 2^15 indices of every entry
// (one large entry — an embedding's — spread over the cores like many small ones).
at::Tensor delta_apply_many(std::vector<at::Tensor> dsts, const std::vector<at::Tensor>& indices,
                            const std::vector<at::Tensor>& values, std::vector<at::Tensor> olds,
                            const at::Tensor& params, at::Tensor out) {
  const int64_t k = static_cast<int64_t>(dsts.size());
  TORCH_CHECK(static_cast<int64_t>(indices.size()) == k && static_cast<int64_t>(values.size()) == k &&
              static_cast<int64_t>(olds.size()) == k && params.is_contiguous() && params.scalar_type() == at::kLong &&
              params.numel() == 6 * k && out.scalar_type() == at::kLong && out.numel() == 2 * k,
              "delta_apply_many: k entries, params [k, 6], out [k, 2]");
  for (int64_t i = 0; i < k; ++i) check_apply(dsts[i], indices[i], values[i], olds[i]);
  const int64_t* p = params.data_ptr<int64_t>();
  constexpr int64_t RUN = int64_t{1} << 15;
  struct Item { int64_t entry, k0, k1; };
  std::vector<Item> items;
  for (int64_t i = 0; i < k; ++i)
    for (int64_t k0 = 0, n = indices[static_cast<size_t>(i)].numel(); k0 < n; k0 += RUN)
      items.push_back({i, k0, std::min(n, k0 + RUN)});
  std::vector<std::pair<uint64_t, int64_t>> sums(items.size());
#pragma omp parallel for schedule(dynamic, 1) if (items.size() > 1)
  for (int64_t j = 0; j < static_cast<int64_t>(items.size()); ++j) {
    const Item it = items[static_cast<size_t>(j)];
    const size_t e = static_cast<size_t>(it.entry);
    sums[static_cast<size_t>(j)] = apply_range(dsts[e], indices[e], values[e], olds[e], it.k0, it.k1, p + 6 * it.entry);
  }
  int64_t* o = out.data_ptr<int64_t>();
  std::fill(o, o + 2 * k, 0);
  for (size_t j = 0; j < items.size(); ++j) {
    const int64_t i = items[j].entry;
    o[2 * i] = static_cast<int64_t>(static_cast<uint64_t>(o[2 * i]) + (p[6 * i + 5] ? sums[j].first : 0));
    o[2 * i + 1] += sums[j].second;
  }
  return out;
}

// nows[i] against bases[i] (each contiguous on CPU: words of one type, or fp32 values against bf16 words),
// salts: int64 [k]; moved: int64 [k] and blocks: int64 [k, 4] (each tensor's count of changes and the byte offsets
// of its index, word and old-word blocks), written; ``align``: where each block starts (a power of two: the
// weight buckets' alignment, so that a delta's tensors go on the wire from this memory as they lie); ``in_place``:
// each changed base word replaced by the new one as it is found (the trainer's base staged for the next delta).
// Returns bytes: for each tensor in turn, its changed flat indices (int32 below 2^31 elements, else int64) and the
// new words at them, each block at a multiple of ``align``; then, from the next multiple, each tensor's old words
// (the base's there before), each block 8-byte aligned.
at::Tensor delta_diff_many(const std::vector<at::Tensor>& nows, const std::vector<at::Tensor>& bases,
                           const at::Tensor& salts, at::Tensor moved, at::Tensor blocks, int64_t align,
                           int64_t in_place) {
  const int64_t k = static_cast<int64_t>(nows.size());
  TORCH_CHECK(static_cast<int64_t>(bases.size()) == k && salts.numel() == k && moved.numel() == k &&
              blocks.numel() == 4 * k && blocks.is_contiguous() && salts.scalar_type() == at::kLong &&
              moved.scalar_type() == at::kLong && blocks.scalar_type() == at::kLong,
              "delta_diff_many: as many bases, salts and moved as tensors, blocks [k, 4]");
  TORCH_CHECK(align >= 8 && (align & (align - 1)) == 0, "delta_diff_many: align a power of two, at least 8");
  enum Kind { F32_BF16, W16, W32 };
  std::vector<Kind> kinds(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) {
    const at::Tensor &now = nows[static_cast<size_t>(i)], &base = bases[static_cast<size_t>(i)];
    check_bits(base, "delta_diff_many");
    TORCH_CHECK(now.numel() == base.numel() && now.is_contiguous() && now.device().is_cpu(),
                "delta_diff_many: each tensor contiguous on CPU, as large as its base");
    if (now.scalar_type() == at::kFloat) {
      TORCH_CHECK(base.scalar_type() == at::kShort, "delta_diff_many: fp32 values against bf16 words only");
      kinds[static_cast<size_t>(i)] = F32_BF16;
    } else {
      TORCH_CHECK(now.scalar_type() == base.scalar_type(), "delta_diff_many: now and base of one word type");
      kinds[static_cast<size_t>(i)] = base.scalar_type() == at::kShort ? W16 : W32;
    }
  }
  constexpr int64_t CHUNK = int64_t{1} << 18;  // elements an item (a multiple of 32)
  struct Item { int64_t tensor, lo, hi; };
  std::vector<Item> items;
  for (int64_t i = 0; i < k; ++i)
    for (int64_t lo = 0, n = nows[static_cast<size_t>(i)].numel(); lo < n; lo += CHUNK)
      items.push_back({i, lo, std::min(n, lo + CHUNK)});
  std::vector<Found> found(items.size());
  const int64_t* salt = salts.data_ptr<int64_t>();
#pragma omp parallel
  {
  arena().size = 0;  // (each thread its own, before any of its chunks)
#pragma omp for schedule(dynamic, 1)
  for (int64_t j = 0; j < static_cast<int64_t>(items.size()); ++j) {
    const Item it = items[static_cast<size_t>(j)];
    const at::Tensor &now = nows[static_cast<size_t>(it.tensor)], &base = bases[static_cast<size_t>(it.tensor)];
    Found& f = found[static_cast<size_t>(j)];  // each item's own slot
    switch (kinds[static_cast<size_t>(it.tensor)]) {
      case F32_BF16:
        diff_range(reinterpret_cast<const float*>(now.data_ptr()), reinterpret_cast<uint16_t*>(base.data_ptr()),
                   it.lo, it.hi, in_place != 0, f);
        break;
      case W16:
        diff_range(reinterpret_cast<const uint16_t*>(now.data_ptr()), reinterpret_cast<uint16_t*>(base.data_ptr()),
                   it.lo, it.hi, in_place != 0, f);
        break;
      case W32:
        diff_range(reinterpret_cast<const uint32_t*>(now.data_ptr()), reinterpret_cast<uint32_t*>(base.data_ptr()),
                   it.lo, it.hi, in_place != 0, f);
        break;
    }
  }
  }
  std::vector<int64_t> count(static_cast<size_t>(k), 0);
  for (size_t j = 0; j < items.size(); ++j)
    count[static_cast<size_t>(items[j].tensor)] += static_cast<int64_t>(found[j].end - found[j].begin);
  // each tensor's index, word and old-word blocks at their offsets; its items from first[i]; packed on every core
  auto up = [](int64_t x, int64_t a) { return (x + a - 1) & ~(a - 1); };
  std::vector<int64_t> at_index(static_cast<size_t>(k)), at_words(static_cast<size_t>(k)), at_old(static_cast<size_t>(k));
  std::vector<size_t> first(static_cast<size_t>(k) + 1, items.size());
  for (size_t j = items.size(); j-- > 0;) first[static_cast<size_t>(items[j].tensor)] = j;
  int64_t end = 0;
  for (int64_t i = 0; i < k; ++i) {
    const size_t u = static_cast<size_t>(i);
    const int64_t isize = nows[u].numel() < (int64_t{1} << 31) ? 4 : 8;
    at_index[u] = up(end, align);
    at_words[u] = up(at_index[u] + count[u] * isize, align);
    end = at_words[u] + count[u] * bases[u].element_size();
  }
  end = up(end, align);
  for (int64_t i = 0; i < k; ++i) {
    const size_t u = static_cast<size_t>(i);
    at_old[u] = end;
    end = up(end + count[u] * bases[u].element_size(), 8);
    int64_t* const b = blocks.data_ptr<int64_t>() + 4 * i;  // where the caller finds them
    b[0] = count[u];
    b[1] = at_index[u];
    b[2] = at_words[u];
    b[3] = at_old[u];
  }
  at::Tensor out = salts.new_empty({end}, at::kByte);
  uint8_t* const raw = out.data_ptr<uint8_t>();
  // the padding between blocks zeroed (it goes on the wire with them)
  for (int64_t i = 0; i < k; ++i) {
    const size_t u = static_cast<size_t>(i);
    const int64_t isize = nows[u].numel() < (int64_t{1} << 31) ? 4 : 8;
    const int64_t index_end = at_index[u] + count[u] * isize, words_end = at_words[u] + count[u] * bases[u].element_size();
    const int64_t next = i + 1 < k ? at_index[u + 1] : at_old[0];
    std::memset(raw + index_end, 0, static_cast<size_t>(at_words[u] - index_end));
    std::memset(raw + words_end, 0, static_cast<size_t>(next - words_end));
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < k; ++i) {
    const size_t u = static_cast<size_t>(i);
    const bool narrow = nows[u].numel() < (int64_t{1} << 31);
    const int64_t wsize = bases[u].element_size();
    const uint64_t s = static_cast<uint64_t>(salt[i]);
    uint64_t move = 0;  // the fingerprint's move: (new - old) * m summed over the changes
    int64_t at = 0;
    for (size_t j = first[u]; j < items.size() && items[j].tensor == i; ++j) {
      const Found& f = found[j];
      for (size_t q = f.begin; q < f.end; ++q) {
        const int64_t g = items[j].lo + static_cast<int64_t>(f.in->off[q]);
        const uint32_t w = f.in->now[q], o = f.in->old[q];
        move += (static_cast<uint64_t>(w) - static_cast<uint64_t>(o)) * multiplier(static_cast<uint64_t>(g), s);
        if (narrow) {
          const int32_t v = static_cast<int32_t>(g);
          std::memcpy(raw + at_index[u] + at * 4, &v, 4);
        } else {
          std::memcpy(raw + at_index[u] + at * 8, &g, 8);
        }
        if (wsize == 2) {
          const uint16_t w16 = static_cast<uint16_t>(w), o16 = static_cast<uint16_t>(o);
          std::memcpy(raw + at_words[u] + at * 2, &w16, 2);
          std::memcpy(raw + at_old[u] + at * 2, &o16, 2);
        } else {
          std::memcpy(raw + at_words[u] + at * 4, &w, 4);
          std::memcpy(raw + at_old[u] + at * 4, &o, 4);
        }
        ++at;
      }
    }
    moved.data_ptr<int64_t>()[i] = static_cast<int64_t>(move);
  }
#pragma omp parallel
  if (arena().off.size() > ARENA_KEEP) arena() = Arena();
  return out;
}

// bits: words at the full-tensor flat indices ``positions`` (int64, as many); out: int64 [1]
at::Tensor delta_fingerprint_at(const at::Tensor& bits, const at::Tensor& positions, int64_t salt, at::Tensor out) {
  check_bits(bits, "delta_fingerprint_at");
  TORCH_CHECK(positions.is_contiguous() && positions.scalar_type() == at::kLong && positions.numel() == bits.numel(),
              "delta_fingerprint_at: int64 positions, one per word");
  const uint64_t s = static_cast<uint64_t>(salt);
  const int64_t* g = positions.data_ptr<int64_t>();
  const uint64_t total = bits.scalar_type() == at::kShort
      ? terms_at(reinterpret_cast<const uint16_t*>(bits.data_ptr()), g, bits.numel(), s)
      : terms_at(reinterpret_cast<const uint32_t*>(bits.data_ptr()), g, bits.numel(), s);
  out.data_ptr<int64_t>()[0] = static_cast<int64_t>(total);
  return out;
}

// Why each sparse entry cannot apply to its tensor, in one call: indices (int32 or int64) and values (words) per
// entry; params: int64 [k, 2] (the tensor's elements, ``numel``, and the values' exponent bits, ``exponent``: 0 where
// any value may pass); out: int64 [k, 2] = [code, position] per entry, code 0 (it can), 1 (an index outside [0,
// numel)), 2 (indices not strictly increasing), 3 (a value NaN or infinite: its exponent bits all set); position:
// the first offending element
at::Tensor delta_check_many(const std::vector<at::Tensor>& indices, const std::vector<at::Tensor>& values,
                            const at::Tensor& params, at::Tensor out) {
  const int64_t k = static_cast<int64_t>(indices.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == k && params.is_contiguous() && params.scalar_type() == at::kLong &&
              params.numel() == 2 * k && out.scalar_type() == at::kLong && out.numel() == 2 * k,
              "delta_check_many: k entries, params [k, 2], out [k, 2]");
  for (int64_t i = 0; i < k; ++i) {
    check_bits(values[static_cast<size_t>(i)], "delta_check_many");
    const at::Tensor& idx = indices[static_cast<size_t>(i)];
    TORCH_CHECK(idx.is_contiguous() && (idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong) &&
                idx.numel() == values[static_cast<size_t>(i)].numel(),
                "delta_check_many: int32 or int64 indices, one per value");
  }
  const int64_t* p = params.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(dynamic, 1) if (k > 1)
  for (int64_t i = 0; i < k; ++i) {
    const at::Tensor &idx = indices[static_cast<size_t>(i)], &val = values[static_cast<size_t>(i)];
    const bool wide = idx.scalar_type() == at::kLong;
    const int32_t* i32 = wide ? nullptr : idx.data_ptr<int32_t>();
    const int64_t* i64 = wide ? idx.data_ptr<int64_t>() : nullptr;
    const uint32_t* w32 = val.scalar_type() == at::kInt ? reinterpret_cast<const uint32_t*>(val.data_ptr()) : nullptr;
    const uint16_t* w16 = w32 ? nullptr : reinterpret_cast<const uint16_t*>(val.data_ptr());
    const int64_t numel = p[2 * i];
    const uint64_t e = static_cast<uint64_t>(p[2 * i + 1]);
    int64_t code = 0, at = 0, last = -1;
    for (int64_t q = 0; q < idx.numel(); ++q) {
      const int64_t g = wide ? i64[q] : static_cast<int64_t>(i32[q]);
      const uint64_t w = w32 ? w32[q] : w16[q];
      code = g < 0 || g >= numel ? 1 : g <= last ? 2 : e && (w & e) == e ? 3 : 0;
      if (code) {
        at = q;
        break;
      }
      last = g;
    }
    o[2 * i] = code;
    o[2 * i + 1] = at;
  }
  return out;
}
