"""Paged decode attention on CPU that reads K/V blocks where they lie in the cache.

The torch path (``rollout.layers.attention``) gathers every decoding sequence's blocks into a
dense copy for SDPA: at batch 256 and 140-token contexts that is ~0.8 GB written and read again
per step on SmolLM2, a fifth of the step (``benchmarks/NOTES.md``). This kernel walks each
sequence's block table instead, a block at a time: one work item per sequence (all its KV heads,
which lie side by side in the cache) or, at batches too small to share the threads, per
(sequence, KV head); each KV head's query heads grouped (GQA without repeats), scores and
softmax in fp32 (max-subtracted, as SDPA), values accumulated in fp32, one rounding to the cache
dtype at the end. Parallel over work items with
``at::parallel_for`` (the calling thread's OpenMP team, shared with torch's own runtime). Dot
products, the exponentials (a polynomial of our own, within 2 ulp of ``expf``) and the softmax and
value sums are explicit vector code in a fixed order (no ``-ffast-math``).

It is C++ compiled on first use with the machine's compiler, for the CPU's instruction set and
without ``-ffast-math`` (``rollout.layers.cpu_build``); without a compiler the engine keeps the
torch path and says so once in its log. Its precision is that of the gather path: both are
within one bf16 rounding of an fp32 computation over the same bf16 K/V values (tested).
"""

from __future__ import annotations

from typing import Optional

import torch

SOURCE = r"""
namespace {

// Vectors of ROLLOUT_LANES floats (the build's ISA: AVX-512 16, AVX2 8) through GCC's vector
// extensions; every sum runs in a fixed order (no -ffast-math).
constexpr int PL = ROLLOUT_LANES;
typedef float pvf __attribute__((vector_size(PL * 4)));
typedef int32_t pvi __attribute__((vector_size(PL * 4)));

inline pvf pload(const float* p) { pvf v; std::memcpy(&v, p, sizeof v); return v; }
inline void pstore(float* p, pvf v) { std::memcpy(p, &v, sizeof v); }
// the lanes of v summed pairwise (halves, then quarters ...): a fixed order, a short dependency chain
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

// One work item is a sequence and a range of its KV heads: all of them where there are enough
// sequences to share the threads, one each at small batches. A token's K (or V) values of all its
// heads lie side by side in the cache, so an item reads each block it touches as one contiguous run
// (the hardware prefetcher follows it); blocks lie anywhere, so the loops also ask for the token
// AHEAD positions on. Measured on AVX2 (AMD EPYC): 2-3x faster than one head per item at batch 64+.
constexpr int64_t AHEAD = 4;
inline void prefetch_bytes(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(c + off, 0, 3);
}

template <typename T>
void decode(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
            int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks,
            int64_t blk_stride, int64_t tok_stride, int64_t head_stride, float scale, int64_t window) {
  const int64_t g = Hq / Hkv;
  const int64_t per_item = B >= 2 * at::get_num_threads() ? Hkv : 1;  // KV heads per work item
  const int64_t groups = (Hkv + per_item - 1) / per_item;
  at::parallel_for(0, B * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_item * g * D), acc(per_item * g * D), row(D), scores, total(per_item * g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / groups, h0 = (item % groups) * per_item, nh = std::min(per_item, Hkv - h0);
      const int64_t hq = nh * g;  // query heads of this item, h0 * g onwards
      const int64_t len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      const int64_t* table = tables + b * max_blocks;
      const int64_t run = ((nh - 1) * head_stride + D) * static_cast<int64_t>(sizeof(T));  // bytes per token
      // f(t, row of head h0 of context token t) for t = 0 .. n-1, a block at a time (the item's
      // heads follow h0's row head_stride apart); the next block's first tokens are asked for ahead
      auto tokens = [&](const T* cache, auto&& f) {
        for (int64_t pos = start; pos < len;) {
          const int64_t off = pos % bs, cnt = std::min(bs - off, len - pos);
          const T* base = cache + table[pos / bs] * blk_stride + off * tok_stride + h0 * head_stride;
          if (pos + cnt < len) {
            const T* next = cache + table[(pos + cnt) / bs] * blk_stride + h0 * head_stride;
            for (int64_t j = 0; j < std::min<int64_t>(AHEAD, len - pos - cnt); ++j)
              prefetch_bytes(next + j * tok_stride, run);
          }
          for (int64_t j = 0; j < cnt; ++j) f(pos - start + j, base + j * tok_stride);
          pos += cnt;
        }
      };
      to_float(q + (b * Hq + h0 * g) * D, qf.data(), hq * D);
      scores.resize(hq * n);
      tokens(kc, [&](int64_t t, const T* k) {
        for (int64_t hh = 0; hh < nh; ++hh) {
          to_float(k + hh * head_stride, row.data(), D);
          for (int64_t i = hh * g; i < (hh + 1) * g; ++i) scores[i * n + t] = dot(qf.data() + i * D, row.data(), D) * scale;
        }
      });
      for (int64_t i = 0; i < hq; ++i) {
        float* s = scores.data() + i * n;
        total[i] = exp_sum(s, n, *std::max_element(s, s + n));
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      tokens(vc, [&](int64_t t, const T* v) {
        for (int64_t hh = 0; hh < nh; ++hh) {
          to_float(v + hh * head_stride, row.data(), D);
          for (int64_t i = hh * g; i < (hh + 1) * g; ++i) {
            const float w = scores[i * n + t];
            const pvf wv = pvf{} + w;
            float* a = acc.data() + i * D;
            int64_t d = 0;
            for (; d + PL <= D; d += PL) pstore(a + d, pload(a + d) + wv * pload(row.data() + d));
            for (; d < D; ++d) a[d] += w * row[d];
          }
        }
      });
      T* o = out + (b * Hq + h0 * g) * D;
      for (int64_t i = 0; i < hq; ++i)
        for (int64_t d = 0; d < D; ++d) o[i * D + d] = static_cast<T>(acc[i * D + d] / total[i]);
    }
  });
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
"""

def load() -> Optional[object]:
    """The compiled kernels (``rollout.layers.cpu_build``), or None (the reason logged once)."""
    from rollout.layers import cpu_build

    return cpu_build.kernels()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: float, sliding_window: Optional[int] = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block tables [B, max_blocks]; context
    lengths [B] (the new token's K/V already written) -> [B, Hq, D] in q's dtype."""
    return load().paged_decode(q, k_cache, v_cache, block_tables, ctx_lens, float(scale), int(sliding_window or 0))
