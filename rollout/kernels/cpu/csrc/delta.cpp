// Delta weight pushes (weight_sync.delta) in one pass over the weights' bits, on every core:
//
//   delta_fingerprint  a tensor's fingerprint (or a TP rank's part of it): the sum over its elements of the
//                      element's bits times the odd multiplier m(salt, g) of its full-tensor flat index g,
//                      mod 2^64. The elements lie as [outer, length, inner] of a full [outer, size, inner]
//                      tensor, starting at ``start`` of its middle dimension (a whole tensor: 1, n, 1, n, 0).
//   delta_diff_many    for each (now, base) pair, the flat indices at which ``now``'s bits differ from
//                      ``base``'s (increasing), and how far the fingerprint moves from base to now, (now - base)
//                      * m summed over them. ``now`` may be fp32 values against a bf16 base: each rounded to
//                      bf16 as torch rounds it (to nearest even; a NaN as a quiet NaN — torch's own scalar and
//                      vector casts differ there, and an engine refuses NaN) while compared, the cast never
//                      written out. One call for a whole model: one parallel region over chunks of every tensor
//                      (a call per tensor cost ~0.1 ms of thread wake-ups: 30 ms over a 272-tensor model).
//   delta_apply_many   sparse entries written where a TP rank holds them: for each (full-tensor flat index,
//                      value) whose index falls in the rank's run, the old word kept, the new one written, and
//                      the fingerprint's move summed; applied again with the old words, they undo themselves.
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
  // chunks of whole... any split: each chunk walks its own elements, run by run
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

// where a block of 32 elements differs: bit j set where now[i + j] != base[i + j]
template <typename B>
inline uint32_t differs32(const B* a, const B* b) {
#if ROLLOUT_LANES == 16
  if constexpr (sizeof(B) == 2) {
    return _mm512_cmpneq_epi16_mask(_mm512_loadu_si512(a), _mm512_loadu_si512(b));
  } else {
    const uint32_t lo = _mm512_cmpneq_epi32_mask(_mm512_loadu_si512(a), _mm512_loadu_si512(b));
    const uint32_t hi = _mm512_cmpneq_epi32_mask(_mm512_loadu_si512(a + 16), _mm512_loadu_si512(b + 16));
    return lo | (hi << 16);
  }
#else
  B any = 0;
  for (int j = 0; j < 32; ++j) any |= a[j] ^ b[j];  // vectorised: most blocks differ nowhere
  if (!any) return 0;
  uint32_t mask = 0;
  for (int j = 0; j < 32; ++j) mask |= static_cast<uint32_t>(a[j] != b[j]) << j;
  return mask;
#endif
}

// fp32 -> bf16 bits as torch's cast gives them: to nearest even (any NaN as 0x7FC0, torch's scalar cast's)
inline uint16_t torch_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// now's words: as they lie (N = B), or fp32 values rounded to bf16 words on the way (N = float, B = uint16_t)
template <typename N, typename B>
void diff_range(const N* now, const B* base, int64_t lo, int64_t hi, uint64_t salt, std::vector<int64_t>& out,
                uint64_t& moved) {
  B block[32];
  auto take = [&](int64_t k, B word) {
    out.push_back(k);
    moved += (static_cast<uint64_t>(word) - static_cast<uint64_t>(base[k])) * multiplier(k, salt);
  };
  int64_t i = lo;
  for (; i + 32 <= hi; i += 32) {
    const B* words;
    if constexpr (std::is_same<N, B>::value) {
      words = now + i;
    } else {
      for (int j = 0; j < 32; ++j) block[j] = torch_bf16(now[i + j]);  // vectorised
      words = block;
    }
    for (uint32_t mask = differs32(words, base + i); mask; mask &= mask - 1) {
      const int j = __builtin_ctz(mask);
      take(i + j, words[j]);
    }
  }
  for (; i < hi; ++i) {
    B word;
    if constexpr (std::is_same<N, B>::value) word = now[i];
    else word = torch_bf16(now[i]);
    if (word != base[i]) take(i, word);
  }
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

// one sparse entry into dst (see delta_apply_many); out[0] the move (0 unless counts), out[1] the words written;
// ``parallel``: over every core (one big entry), else on this thread (one of many, the caller's region)
void apply_entry(at::Tensor& dst, const at::Tensor& indices, const at::Tensor& values, at::Tensor& old, uint64_t salt,
                 int64_t length, int64_t inner, int64_t size, int64_t start, bool counts, int64_t* out, bool parallel) {
  const bool wide = indices.scalar_type() == at::kLong;
  const int32_t* i32 = wide ? nullptr : indices.data_ptr<int32_t>();
  const int64_t* i64 = wide ? indices.data_ptr<int64_t>() : nullptr;
  const int64_t n = indices.numel();
  const bool whole = start == 0 && length == size;  // the rank holds all of it: a full index is its own
  auto run = [&](auto* d, const auto* v, auto* o) {
    uint64_t moved = 0;
    int64_t wrote = 0;
    // the places lie scattered through the tensor (each a cache miss of its own): every core, and each
    // place fetched a few indices ahead
#pragma omp parallel for reduction(+ : moved, wrote) schedule(static) if (parallel && n > (1 << 15))
    for (int64_t k = 0; k < n; ++k) {
      if (whole && k + 16 < n) __builtin_prefetch(d + (wide ? i64[k + 16] : static_cast<int64_t>(i32[k + 16])), 1);
      const int64_t g = wide ? i64[k] : static_cast<int64_t>(i32[k]);
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
    out[0] = counts ? static_cast<int64_t>(moved) : 0;
    out[1] = wrote;
  };
  if (dst.scalar_type() == at::kShort)
    run(reinterpret_cast<uint16_t*>(dst.data_ptr()), reinterpret_cast<const uint16_t*>(values.data_ptr()),
        reinterpret_cast<uint16_t*>(old.data_ptr()));
  else
    run(reinterpret_cast<uint32_t*>(dst.data_ptr()), reinterpret_cast<const uint32_t*>(values.data_ptr()),
        reinterpret_cast<uint32_t*>(old.data_ptr()));
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
// fingerprint move, the words it wrote). One parallel region over the entries; a lone entry over every core.
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
  int64_t* o = out.data_ptr<int64_t>();
  auto one = [&](int64_t i, bool parallel) {
    apply_entry(dsts[i], indices[i], values[i], olds[i], static_cast<uint64_t>(p[6 * i]), p[6 * i + 1], p[6 * i + 2],
                p[6 * i + 3], p[6 * i + 4], p[6 * i + 5] != 0, o + 2 * i, parallel);
  };
  if (k == 1) {
    one(0, true);
    return out;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < k; ++i) one(i, false);
  return out;
}

// nows[i] against bases[i] (each contiguous on CPU: words of one type, or fp32 values against bf16 words),
// salts: int64 [k]; moved and counts: int64 [k], written;
// returns bytes: for each tensor in turn, its changed flat indices (int32 below 2^31 elements, else int64), then the
// new words at them, each tensor's block padded to 8 bytes
at::Tensor delta_diff_many(const std::vector<at::Tensor>& nows, const std::vector<at::Tensor>& bases,
                           const at::Tensor& salts, at::Tensor moved, at::Tensor counts) {
  const int64_t k = static_cast<int64_t>(nows.size());
  TORCH_CHECK(static_cast<int64_t>(bases.size()) == k && salts.numel() == k && moved.numel() == k &&
              counts.numel() == k && salts.scalar_type() == at::kLong && moved.scalar_type() == at::kLong &&
              counts.scalar_type() == at::kLong, "delta_diff_many: as many bases, salts, moved and counts as tensors");
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
  std::vector<std::vector<int64_t>> found(items.size());
  std::vector<uint64_t> sums(items.size(), 0);
  const int64_t* salt = salts.data_ptr<int64_t>();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t j = 0; j < static_cast<int64_t>(items.size()); ++j) {
    const Item it = items[static_cast<size_t>(j)];
    const at::Tensor &now = nows[static_cast<size_t>(it.tensor)], &base = bases[static_cast<size_t>(it.tensor)];
    const uint64_t s = static_cast<uint64_t>(salt[it.tensor]);
    std::vector<int64_t> mine;
    mine.reserve(static_cast<size_t>((it.hi - it.lo) / 16));
    uint64_t sum = 0;
    switch (kinds[static_cast<size_t>(it.tensor)]) {
      case F32_BF16:
        diff_range(reinterpret_cast<const float*>(now.data_ptr()), reinterpret_cast<const uint16_t*>(base.data_ptr()),
                   it.lo, it.hi, s, mine, sum);
        break;
      case W16:
        diff_range(reinterpret_cast<const uint16_t*>(now.data_ptr()), reinterpret_cast<const uint16_t*>(base.data_ptr()),
                   it.lo, it.hi, s, mine, sum);
        break;
      case W32:
        diff_range(reinterpret_cast<const uint32_t*>(now.data_ptr()), reinterpret_cast<const uint32_t*>(base.data_ptr()),
                   it.lo, it.hi, s, mine, sum);
        break;
    }
    found[static_cast<size_t>(j)] = std::move(mine);  // each item's own slot, written once
    sums[static_cast<size_t>(j)] = sum;
  }
  std::vector<int64_t> count(static_cast<size_t>(k), 0);
  std::vector<uint64_t> move(static_cast<size_t>(k), 0);
  for (size_t j = 0; j < items.size(); ++j) {
    count[static_cast<size_t>(items[j].tensor)] += static_cast<int64_t>(found[j].size());
    move[static_cast<size_t>(items[j].tensor)] += sums[j];
  }
  // each tensor's block (8-byte aligned) at its offset; its items from first[i]; packed on every core
  std::vector<int64_t> offset(static_cast<size_t>(k) + 1, 0);
  std::vector<size_t> first(static_cast<size_t>(k) + 1, items.size());
  for (size_t j = items.size(); j-- > 0;) first[static_cast<size_t>(items[j].tensor)] = j;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t isize = nows[static_cast<size_t>(i)].numel() < (int64_t{1} << 31) ? 4 : 8;
    offset[static_cast<size_t>(i) + 1] = offset[static_cast<size_t>(i)] +
        ((count[static_cast<size_t>(i)] * (isize + bases[static_cast<size_t>(i)].element_size()) + 7) & ~int64_t{7});
    moved.data_ptr<int64_t>()[i] = static_cast<int64_t>(move[static_cast<size_t>(i)]);
    counts.data_ptr<int64_t>()[i] = count[static_cast<size_t>(i)];
  }
  at::Tensor out = salts.new_empty({offset[static_cast<size_t>(k)]}, at::kByte);
  uint8_t* const raw0 = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < k; ++i) {
    const at::Tensor& now = nows[static_cast<size_t>(i)];
    const bool narrow = now.numel() < (int64_t{1} << 31);
    const int64_t c = count[static_cast<size_t>(i)], isize = narrow ? 4 : 8;
    uint8_t* raw = raw0 + offset[static_cast<size_t>(i)];
    uint8_t* words = raw + c * isize;
    int64_t at = 0;
    for (size_t j = first[static_cast<size_t>(i)]; j < items.size() && items[j].tensor == i; ++j) {
      for (int64_t g : found[j]) {
        if (narrow) {
          const int32_t v = static_cast<int32_t>(g);
          std::memcpy(raw + at * 4, &v, 4);
        } else {
          std::memcpy(raw + at * 8, &g, 8);
        }
        switch (kinds[static_cast<size_t>(i)]) {
          case F32_BF16: {
            const uint16_t w = torch_bf16(reinterpret_cast<const float*>(now.data_ptr())[g]);
            std::memcpy(words + at * 2, &w, 2);
            break;
          }
          case W16:
            std::memcpy(words + at * 2, reinterpret_cast<const uint16_t*>(now.data_ptr()) + g, 2);
            break;
          case W32:
            std::memcpy(words + at * 4, reinterpret_cast<const uint32_t*>(now.data_ptr()) + g, 4);
            break;
        }
        ++at;
      }
    }
  }
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

// Why a sparse entry cannot apply to a tensor of ``numel`` elements: out = [code, position] with code 0 (it can),
// 1 (an index outside [0, numel)), 2 (indices not strictly increasing), 3 (a value NaN or infinite: its exponent
// bits, ``exponent``, all set); position: the first offending entry
at::Tensor delta_check(const at::Tensor& indices, const at::Tensor& values, int64_t numel, int64_t exponent,
                       at::Tensor out) {
  check_bits(values, "delta_check");
  TORCH_CHECK(indices.is_contiguous() && (indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong) &&
              indices.numel() == values.numel(), "delta_check: int32 or int64 indices, one per value");
  const bool wide = indices.scalar_type() == at::kLong;
  const int32_t* i32 = wide ? nullptr : indices.data_ptr<int32_t>();
  const int64_t* i64 = wide ? indices.data_ptr<int64_t>() : nullptr;
  const uint32_t* w32 = values.scalar_type() == at::kInt ? reinterpret_cast<const uint32_t*>(values.data_ptr()) : nullptr;
  const uint16_t* w16 = w32 ? nullptr : reinterpret_cast<const uint16_t*>(values.data_ptr());
  const uint64_t e = static_cast<uint64_t>(exponent);
  int64_t code = 0, at = 0, last = -1;
  for (int64_t k = 0; k < indices.numel(); ++k) {
    const int64_t g = wide ? i64[k] : static_cast<int64_t>(i32[k]);
    const uint64_t w = w32 ? w32[k] : w16[k];
    code = g < 0 || g >= numel ? 1 : g <= last ? 2 : e && (w & e) == e ? 3 : 0;
    if (code) {
      at = k;
      break;
    }
    last = g;
  }
  out.data_ptr<int64_t>()[0] = code;
  out.data_ptr<int64_t>()[1] = at;
  return out;
}
