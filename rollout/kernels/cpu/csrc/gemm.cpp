// CPU GEMMs in C++: a small-batch one that reads bf16 weights in place and accumulates in fp32, and
// a register-tiled one for larger batches over fp32 panels of the weights (tile_pack /
// tiled_linear, described at its code below).
//
// y[M, N] = x[M, K] @ W[N, K]^T (+ b) for a bf16 weight in its own layout (no packed copy).
// Decode steps at batch 1-16 are bound by reading the weights; oneDNN on CPUs without native bf16
// converts them through a slow path (~20 GFLOP/s), and an fp32 copy doubles the bytes to read.
// This kernel widens bf16 to fp32 in registers (a bf16 value is the top half of an fp32 one): for one
// to four activation rows each weight row as it streams past (direct_rows); from five, a tile at a
// time: each tile of 3-4 weight rows x 512 columns is widened once into an L1-resident buffer and
// then multiplied with every activation row (fp32 FMAs, several rows and outputs per register
// block), so the widening is paid once per weight and the arithmetic runs at fp32 FMA speed.
// Sums run in a fixed order (no -ffast-math); products of bf16 values are exact in fp32, so
// the result differs from oneDNN's only by the order of the fp32 additions, then one rounding to
// the activation dtype (round to nearest even, as torch); inputs are widened and outputs rounded in
// the kernel, not by torch operators around it (two fewer operators per linear layer). Parallel over
// output features (or tiles of them) with at::parallel_for, or split over a team of threads that is
// already running (gemm_part: rollout.kernels.cpu.fused's decode_stack).
//
// On CPUs with AVX512-BF16 (the avx512bf16 variant) bf16 activations of five to eight rows take its
// dot products instead of the tiles (dot_rows): one vdpbf16ps per 32 weight values and row, the
// activations read as the bf16 values they are, the weights in place (so decode_stack can take these
// rows too). Measured on AMD EPYC Zen 4 (2 threads, SmolLM2's layers streamed from memory, 5-8 rows): on a
// par with oneDNN's packed bf16 GEMMs (both bound by the dot products' rate on these two cores), 1.5-2x the
// tiles (benchmarks/NOTES.md).
//
// fp32 weights take the same code (an fp32 engine's small batches): there the one-row path, which
// streams each weight row with software prefetch, reads at about twice the bandwidth of oneDNN's
// fp32 GEMV on AMD EPYC; the engine's plan measures and decides, as for bf16.
//
// Compiled once per kernel ISA, the CPU's variant chosen at run time (rollout.kernels.cpu.build):
// vectors of ROLLOUT_LANES floats (AVX-512: 16, AVX2: 8, generic: 4) through GCC's vector extensions;
// the dot products through the AVX512-BF16 intrinsics where ROLLOUT_BF16_DOT is set.

namespace {

// Register blocks: NB weight rows x MB activation rows of accumulators, plus NB weight vectors and
// one activation vector, must fit the vector registers (AVX2: 16, AVX-512: 32).
constexpr int NB = L >= 16 ? 4 : 3;          // weight rows (outputs) per tile
constexpr int MB = 4;                        // activation rows per register block
constexpr int KC = 512;                      // columns per widened chunk: NB x KC fp32 <= 8 KB
inline float hsum(vf v) { float s = 0.f; for (int i = 0; i < L; ++i) s += v[i]; return s; }  // fixed order

// sum vector i * NB + r of acc += x[i, 0:kc] . wf[r, 0:kc] for i < R rows (x rows K apart), kc a multiple of L
template <int R>
inline void block(const float* x, int64_t K, const float* wf, int64_t kc, float* acc) {
  vf a[R][NB];
  for (int i = 0; i < R; ++i) for (int r = 0; r < NB; ++r) a[i][r] = loadf(acc + (i * NB + r) * L);
  for (int64_t k = 0; k < kc; k += L) {
    vf wv[NB];
    for (int r = 0; r < NB; ++r) wv[r] = loadf(wf + r * KC + k);
    for (int i = 0; i < R; ++i) {
      const vf xv = loadf(x + i * K + k);
      for (int r = 0; r < NB; ++r) a[i][r] += xv * wv[r];
    }
  }
  for (int i = 0; i < R; ++i) for (int r = 0; r < NB; ++r) storef(acc + (i * NB + r) * L, a[i][r]);
}

// One to four activation rows (decode at batch 1-4, bound by reading the weights): one weight row
// at a time, widened in registers and used at once, with the stream prefetched PF elements ahead
// (rows lie end to end, so this runs into the next rows). Measured on AVX2 (AMD EPYC, 2 threads):
// 1.3-1.8x the bandwidth of tiles of 3 rows read side by side, which the hardware prefetcher
// follows poorly; on AMD EPYC Zen 4 (AVX-512) 1.6-2x at 3 rows and 1.3-1.6x at 4, and slower than
// the tiles from about 6 rows (the FMAs bound it there). Two chains per sum (even and odd vectors)
// hide the FMA latency.
constexpr int64_t PF = 2048;
template <int R, typename Out, typename W>
void direct_rows(const float* x, const W* w, const float* bias, Out* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t kv = K / (2 * L) * (2 * L);
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    vf a[R] = {}, b[R] = {};
    for (int64_t k = 0; k < kv; k += 2 * L) {
      __builtin_prefetch(row + k + PF, 0, 0);
      const vf wv = widen(row + k), wu = widen(row + k + L);
      for (int i = 0; i < R; ++i) { a[i] += loadf(x + i * K + k) * wv; b[i] += loadf(x + i * K + k + L) * wu; }
    }
    for (int i = 0; i < R; ++i) {
      float s = hsum(a[i] + b[i]);
      for (int64_t k = kv; k < K; ++k) s += x[i * K + k] * widen1(row[k]);  // columns past the last pair
      put(y, i * N + n, bias ? s + bias[n] : s);
    }
  }
}

// five or more activation rows: tiles [t0, t1) of NB weight rows, each widened once into L1 and used by every row
template <typename Out, typename W>
void tile_rows_of(const float* x, const W* w, const float* bias, Out* y, int64_t M, int64_t N, int64_t K, int64_t t0,
                  int64_t t1) {
  const int64_t kv = K / L * L;
  std::vector<float> wf(NB * KC);
  std::vector<float> acc(M * NB * L);  // the sums' vectors (float storage: no over-aligned allocation)
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * NB, nb = std::min<int64_t>(NB, N - n0);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k0 = 0; k0 < kv; k0 += KC) {
      const int64_t kc = std::min<int64_t>(KC, kv - k0);
      for (int r = 0; r < NB; ++r) {
        float* dst = wf.data() + r * KC;
        if (r < nb) {
          const W* src = w + (n0 + r) * K + k0;
          for (int64_t k = 0; k < kc; k += L) {
            __builtin_prefetch(src + k + PF, 0, 0);
            storef(dst + k, widen(src + k));
          }
        } else {
          std::fill(dst, dst + kc, 0.f);
        }
      }
      int64_t m = 0;
      for (; m + MB <= M; m += MB) block<MB>(x + m * K + k0, K, wf.data(), kc, acc.data() + m * NB * L);
      if (M - m == 3) block<3>(x + m * K + k0, K, wf.data(), kc, acc.data() + m * NB * L);
      if (M - m == 2) block<2>(x + m * K + k0, K, wf.data(), kc, acc.data() + m * NB * L);
      if (M - m == 1) block<1>(x + m * K + k0, K, wf.data(), kc, acc.data() + m * NB * L);
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < nb; ++r) {
        float s = hsum(loadf(acc.data() + (m * NB + r) * L));
        const W* wr = w + (n0 + r) * K;
        for (int64_t k = kv; k < K; ++k) s += x[m * K + k] * widen1(wr[k]);  // columns past the last vector
        put(y, m * N + n0 + r, bias ? s + bias[n0 + r] : s);
      }
  }
}

#if ROLLOUT_BF16_DOT && ROLLOUT_LANES == 16
// ---- bf16 dot products (AVX512-BF16): five to eight activation rows, bf16 activations and weights ----
// vdpbf16ps multiplies pairs of bf16 values (exact in fp32) and adds both products into fp32 lanes:
// one instruction per 32 weight values and activation row, where the widening kernels above spend
// two widenings and two FMAs, and the activations are read as the bf16 values they are. DN weight
// rows at a time as they stream past (prefetched as direct_rows's) against every activation row (up
// to DM: DM x DN sums, DN weight vectors and one activation vector in registers). An output's sum: its
// 16 lanes of pair products over k in order, the lanes added by lane_sums, then the columns past the
// last vector, then the bias; the same bits whatever the range, the thread or the outputs beside it.
// Past DM rows the weight rows would be read again (from L1) for a second block, and the kernel is
// bound by the dot products' rate: measured on AMD EPYC Zen 4 at 16 rows in an engine, a decode step
// 20 % slower than oneDNN's packed GEMMs; the tiles take those rows (the plan picks oneDNN there).
constexpr int DN = 2, DM = 8;
static_assert(DM * DN == 16, "lane_sums adds 16 sums' lanes at once");
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// lane j: the sum of a[j]'s 16 lanes, for 16 vectors at once. Every vector's lanes are added to each
// other only and in the same order whatever its position: in each 128-bit quarter (x0 + x2) + (x1 + x3),
// then the quarters (q0 + q1) + (q2 + q3).
inline __m512 lane_sums(const __m512* a) {
  __m512 s[8], u[4];
  for (int j = 0; j < 8; ++j)
    s[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d p = _mm512_castps_pd(s[2 * j]), q = _mm512_castps_pd(s[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xdd));
}

// lanes i * DN + r (i < R, r < NR) of the result: x row i . w row r over the first kv columns
template <int R, int NR>
inline __m512 dot_block(const uint16_t* x, const uint16_t* w, int64_t K, int64_t kv) {
  __m512 a[DM * DN];
  for (int j = 0; j < DM * DN; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kv; k += 32) {
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) {
      __builtin_prefetch(w + r * K + k + PF, 0, 0);
      wv[r] = load_bh(w + r * K + k);
    }
    for (int i = 0; i < R; ++i) {
      const __m512bh xv = load_bh(x + i * K + k);
      for (int r = 0; r < NR; ++r) a[i * DN + r] = _mm512_dpbf16_ps(a[i * DN + r], xv, wv[r]);
    }
  }
  return lane_sums(a);
}

template <int NR>
inline __m512 dot_rows_of(int64_t R, const uint16_t* x, const uint16_t* w, int64_t K, int64_t kv) {
  switch (R) {
    case 8: return dot_block<8, NR>(x, w, K, kv);
    case 7: return dot_block<7, NR>(x, w, K, kv);
    case 6: return dot_block<6, NR>(x, w, K, kv);
    default: return dot_block<5, NR>(x, w, K, kv);  // takes_dot: five rows or more
  }
}

// rows i < R of y from lanes i * DN .. i * DN + nr - 1 of v (rounded as put rounds)
inline void put_lanes(float* y, int64_t N, vf v, int R, int nr) {
  for (int i = 0; i < R; ++i) std::memcpy(y + i * N, reinterpret_cast<const float*>(&v) + i * DN, nr * 4);
}
inline void put_lanes(uint16_t* y, int64_t N, vf v, int R, int nr) {
  const vh h = bf16_halves(v);
  for (int i = 0; i < R; ++i) std::memcpy(y + i * N, reinterpret_cast<const uint16_t*>(&h) + i * DN, nr * 2);
}

template <typename Out>
void dot_rows(const uint16_t* x, const uint16_t* w, const float* bias, Out* y, int64_t M, int64_t N, int64_t K,
              int64_t n0, int64_t n1) {
  const int64_t kv = K / 32 * 32;
  const int R = static_cast<int>(M);
  for (int64_t n = n0; n < n1; n += DN) {
    const int nr = static_cast<int>(std::min<int64_t>(DN, n1 - n));
    const uint16_t* wn = w + n * K;
    __m512 v = nr == 2 ? dot_rows_of<2>(R, x, wn, K, kv) : dot_rows_of<1>(R, x, wn, K, kv);
    if (kv < K) {  // the columns past the last vector, summed apart and added to the lanes' sum
      float t[DM * DN] = {};
      for (int i = 0; i < R; ++i)
        for (int r = 0; r < nr; ++r)
          for (int64_t k = kv; k < K; ++k) t[i * DN + r] += widen1(x[i * K + k]) * widen1(wn[r * K + k]);
      v = _mm512_add_ps(v, _mm512_loadu_ps(t));
    }
    if (bias) {
      float b[DM * DN] = {};
      for (int i = 0; i < R; ++i) std::memcpy(b + i * DN, bias + n, nr * 4);
      v = _mm512_add_ps(v, _mm512_loadu_ps(b));
    }
    vf f;
    std::memcpy(&f, &v, sizeof f);
    put_lanes(y + n, N, f, R, nr);
  }
}
constexpr bool BF16_DOT = true;
constexpr int64_t DOT_ROWS = DM;
#else
constexpr bool BF16_DOT = false;
constexpr int64_t DOT_ROWS = 0;
template <typename Out>
void dot_rows(const uint16_t*, const uint16_t*, const float*, Out*, int64_t, int64_t, int64_t, int64_t, int64_t) {}
#endif

// whether y = x W^T takes the bf16 dot products: a variant that has them, bf16 weights, the activations'
// bf16 bits given (xh: x's values, which are then bf16 ones) and five to DM rows
template <typename W>
inline bool takes_dot(int64_t M, const uint16_t* xh) {
  return BF16_DOT && std::is_same<W, uint16_t>::value && xh != nullptr && M > 4 && M <= DOT_ROWS;
}

// y [M, N] = x W^T (+ bias) in units of work: an output column each for M <= 4 and for the dot
// products, else a tile of NB. gemm_part computes units [u0, u1); every output is summed in the same
// order whatever the range or the thread computing it, so any split of the units gives the same bits.
inline int64_t gemm_units(int64_t M, int64_t N, bool dot) { return M <= 4 || dot ? N : (N + NB - 1) / NB; }
template <typename Out, typename W>
void gemm_part(const float* x, const uint16_t* xh, const W* w, const float* bias, Out* y, int64_t M, int64_t N,
               int64_t K, int64_t u0, int64_t u1) {
  if (M == 1) direct_rows<1>(x, w, bias, y, N, K, u0, u1);
  else if (M == 2) direct_rows<2>(x, w, bias, y, N, K, u0, u1);
  else if (M == 3) direct_rows<3>(x, w, bias, y, N, K, u0, u1);
  else if (M == 4) direct_rows<4>(x, w, bias, y, N, K, u0, u1);
  else if (takes_dot<W>(M, xh)) dot_rows(xh, reinterpret_cast<const uint16_t*>(w), bias, y, M, N, K, u0, u1);
  else tile_rows_of(x, w, bias, y, M, N, K, u0, u1);
}

template <typename Out, typename W>
void gemm(const float* x, const uint16_t* xh, const W* w, const float* bias, Out* y, int64_t M, int64_t N, int64_t K) {
  const bool dot = takes_dot<W>(M, xh);
  at::parallel_for(0, gemm_units(M, N, dot), M <= 4 || dot ? 16 : 4, [&](int64_t u0, int64_t u1) {
    gemm_part(x, xh, w, bias, y, M, N, K, u0, u1);
  });
}


// ---- tiled: a register-tiled GEMM for the larger batches, over fp32 panels of W ---------------------
// W [N, K] is packed once (tile_pack) into panels of TNR output columns, each K x TNR fp32 values in
// k order. A forward packs its activations into tiles of TMR rows (K x TMR, widened to fp32), then
// every register tile of TMR x TNR outputs sums over k with one broadcast activation and two weight
// vectors per k (12 FMAs per 8 loads: the FMA ports bound it, as in BLIS-style kernels). The k range
// is cut into blocks of TKC so that a panel's block stays in L1 while every activation tile passes
// over it. Each output's sum runs over k in order, whatever M, the tile or the thread: a row's result
// does not depend on the batch it came in.
constexpr int TNR = 2 * L;            // output columns per panel (two vectors)
constexpr int TMR = 6;                // activation rows per register tile: 12 sums + 2 weight vectors + 1
constexpr int64_t TKC = 2048 / L;     // k per block: a panel's block is 16 KB (AVX2) or 32 KB (AVX-512)

constexpr int64_t TPF = 2048;         // floats ahead that the first tile of a block prefetches
constexpr int64_t LINE = 64 / sizeof(float), BLOCK_LINES = TKC * TNR / LINE;  // a block's cache lines
constexpr int64_t SPREAD_TILES = 10;  // from this many activation tiles: the next block prefetched in slices

// PF (the first activation tile over a panel's block): the weight stream prefetched TPF floats
// ahead, into the next blocks and panels (a thread's panels lie end to end). Measured on AMD EPYC
// (AVX2, 2 threads, SmolLM2's layers): 15-20 % faster at 4-32 rows, where the weights' stream
// bounds the kernel; later tiles find the block in L1, where a prefetch per k would cost a third
// of the FMA rate. From SPREAD_TILES activation tiles on (about 60 rows), the next block is
// prefetched instead a slice of lines before each tile, so that no tile waits on memory: the
// first tile over a block otherwise reads it at the memory's latency while the others wait for
// nothing (measured on AMD EPYC, 2 threads, Qwen2-0.5B's and SmolLM2's layers, bf16 activations:
// +4-12 % at 64-256 rows standalone, 4-8 % of a Qwen2-0.5B-shape decode step at batch 128 with
// the two alternating in one engine; within noise of the tile-0 prefetch or worse below ~60 rows).
template <int R, bool PF>
inline void tile(const float* __restrict a, const float* __restrict b, int64_t kc, float* c, bool add) {
  vf c0[R], c1[R];
  for (int i = 0; i < R; ++i) {
    c0[i] = add ? loadf(c + i * TNR) : vf{};
    c1[i] = add ? loadf(c + i * TNR + L) : vf{};
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    if (PF) __builtin_prefetch(b + k * TNR + TPF, 0, 0);
    const vf b0 = loadf(b + k * TNR), b1 = loadf(b + k * TNR + L);
    for (int i = 0; i < R; ++i) {
      const float s = a[k * TMR + i];
      c0[i] += s * b0;
      c1[i] += s * b1;
    }
  }
  for (int i = 0; i < R; ++i) { storef(c + i * TNR, c0[i]); storef(c + i * TNR + L, c1[i]); }
}

template <bool PF>
inline void tile_rows(int64_t rows, const float* a, const float* b, int64_t kc, float* c, bool add) {
  switch (rows) {
    case 6: tile<6, PF>(a, b, kc, c, add); break;
    case 5: tile<5, PF>(a, b, kc, c, add); break;
    case 4: tile<4, PF>(a, b, kc, c, add); break;
    case 3: tile<3, PF>(a, b, kc, c, add); break;
    case 2: tile<2, PF>(a, b, kc, c, add); break;
    default: tile<1, PF>(a, b, kc, c, add); break;
  }
}

// rows [n, K] -> ceil(n / WIDTH) blocks of K x WIDTH fp32 values in k order (rows past n: zeros):
// the weight's panels (WIDTH = TNR) and the activations' tiles (WIDTH = TMR)
template <int WIDTH, typename T>
void interleave(const T* src, float* out, int64_t n, int64_t K) {
  at::parallel_for(0, (n + WIDTH - 1) / WIDTH, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* dst = out + p * K * WIDTH;
      const int64_t rows = std::min<int64_t>(WIDTH, n - p * WIDTH);
      const T* row = src + p * WIDTH * K;
      if (rows == WIDTH) {  // written in order: the block's lines once each, WIDTH rows read side by side
        for (int64_t k = 0; k < K; ++k)
          for (int j = 0; j < WIDTH; ++j) dst[k * WIDTH + j] = widen1(row[j * K + k]);
        continue;
      }
      for (int64_t k = 0; k < K; ++k)
        for (int j = 0; j < WIDTH; ++j) dst[k * WIDTH + j] = j < rows ? widen1(row[j * K + k]) : 0.f;
    }
  });
}

template <typename Out>
void tiled(const float* ap, const float* bp, const float* bias, Out* y, int64_t M, int64_t N, int64_t K) {
  const int64_t panels = (N + TNR - 1) / TNR, tiles = (M + TMR - 1) / TMR;
  const bool spread = tiles >= SPREAD_TILES;
  const int64_t total = panels * K * TNR;  // floats of panels
  const int64_t per_tile = (BLOCK_LINES + tiles - 1) / tiles;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> c(tiles * TMR * TNR);  // one panel's sums for every row
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t k0 = 0; k0 < K; k0 += TKC) {
        const int64_t kc = std::min<int64_t>(TKC, K - k0);
        const float* b = bp + (p * K + k0) * TNR;
        const int64_t next = (p * K + k0 + kc) * TNR;  // the next block (the next panel's first: end to end)
        for (int64_t t = 0; t < tiles; ++t) {
          const float* a = ap + (t * K + k0) * TMR;
          const int64_t rows = std::min<int64_t>(TMR, M - t * TMR);
          if (spread) {
            for (int64_t l = t * per_tile, l1 = std::min<int64_t>(BLOCK_LINES, l + per_tile); l < l1; ++l)
              if (next + l * LINE < total) __builtin_prefetch(bp + next + l * LINE, 0, 2);
            tile_rows<false>(rows, a, b, kc, c.data() + t * TMR * TNR, k0 > 0);
          } else if (t == 0) {
            tile_rows<true>(rows, a, b, kc, c.data(), k0 > 0);
          } else {
            tile_rows<false>(rows, a, b, kc, c.data() + t * TMR * TNR, k0 > 0);
          }
        }
      }
      const int64_t n0 = p * TNR, nc = std::min<int64_t>(TNR, N - n0);
      if (nc == TNR) {  // a whole panel: two vectors a row (the same adds and roundings as put's)
        const vf b0 = bias ? loadf(bias + n0) : vf{}, b1 = bias ? loadf(bias + n0 + L) : vf{};
        for (int64_t m = 0; m < M; ++m) {
          vf s0 = loadf(c.data() + m * TNR), s1 = loadf(c.data() + m * TNR + L);
          if (bias) { s0 += b0; s1 += b1; }
          putv(y + m * N + n0, s0);
          putv(y + m * N + n0 + L, s1);
        }
        continue;
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nc; ++j) {
          const float s = c[m * TNR + j];
          put(y, m * N + n0 + j, bias ? s + bias[n0 + j] : s);
        }
    }
  });
}

}  // namespace

// fp32 copies of bf16 or fp32 values, widened here rather than by a torch operator per call
std::vector<float> widened(const at::Tensor& t) {
  std::vector<float> out(t.numel());
  if (t.scalar_type() == at::kFloat) {
    std::memcpy(out.data(), t.data_ptr<float>(), out.size() * 4);
  } else {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
    for (size_t i = 0; i < out.size(); ++i) out[i] = widen1(src[i]);
  }
  return out;
}

// a linear layer's optional bias of n values as fp32 (empty: none)
std::vector<float> widened_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->numel() == n && (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat),
              "bias: N bf16 or fp32 values");
  return widened(bias->contiguous());
}

at::Tensor bf16_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kBFloat16 ||
              (w.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat)),
              "weight: contiguous [N, K], bf16 (x bf16 or fp32) or fp32 (x fp32)");
  TORCH_CHECK(x.size(-1) == w.size(1), "x and weight disagree on K");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x: bf16 or fp32");
  auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = rows.size(0), N = w.size(0), K = w.size(1);
  const bool bf16 = w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16;
  const uint16_t* xh = bf16 ? reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>()) : nullptr;
  const std::vector<float> xf = takes_dot<uint16_t>(M, xh) ? std::vector<float>() : widened(rows);
  const std::vector<float> bf = widened_bias(bias, N);
  auto y = rows.new_empty({M, N});
  const float* bp = bf.empty() ? nullptr : bf.data();
  if (w.scalar_type() == at::kFloat) {
    gemm(xf.data(), nullptr, w.data_ptr<float>(), bp, y.data_ptr<float>(), M, N, K);
    auto sizes = x.sizes().vec();
    sizes.back() = N;
    return y.view(sizes);
  }
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  if (x.scalar_type() == at::kFloat)
    gemm(xf.data(), nullptr, wp, bp, y.data_ptr<float>(), M, N, K);
  else
    gemm(xf.data(), xh, wp, bp, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, N, K);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// W [N, K] (bf16 or fp32) -> its fp32 panels [ceil(N / TNR), K, TNR] for tiled_linear
at::Tensor tile_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "tile_pack: a 2-D bf16 or fp32 weight [N, K]");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  auto out = wc.new_empty({(N + TNR - 1) / TNR, K, TNR}, wc.options().dtype(at::kFloat));
  if (wc.scalar_type() == at::kFloat)
    interleave<TNR>(wc.data_ptr<float>(), out.data_ptr<float>(), N, K);
  else
    interleave<TNR>(reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), out.data_ptr<float>(), N, K);
  return out;
}

// y [.., N] = x [.., K] @ W^T (+ bias) from tile_pack(W), in x's dtype (bf16 rounded once, as torch)
at::Tensor tiled_linear(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.is_contiguous() &&
              panels.size(2) == TNR, "tiled_linear: panels from this kernel variant's tile_pack");
  TORCH_CHECK(x.size(-1) == panels.size(1), "tiled_linear: x and the weight disagree on K");
  TORCH_CHECK(n > (panels.size(0) - 1) * TNR && n <= panels.size(0) * TNR, "tiled_linear: N does not fit the panels");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "tiled_linear: x bf16 or fp32");
  auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = rows.size(0), K = rows.size(1);
  std::vector<float> ap(((M + TMR - 1) / TMR) * TMR * K);
  if (rows.scalar_type() == at::kFloat)
    interleave<TMR>(rows.data_ptr<float>(), ap.data(), M, K);
  else
    interleave<TMR>(reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>()), ap.data(), M, K);
  const std::vector<float> bf = widened_bias(bias, n);
  auto y = rows.new_empty({M, n});
  const float* bp = bf.empty() ? nullptr : bf.data();
  if (rows.scalar_type() == at::kFloat)
    tiled(ap.data(), panels.data_ptr<float>(), bp, y.data_ptr<float>(), M, n, K);
  else
    tiled(ap.data(), panels.data_ptr<float>(), bp, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, n, K);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return y.view(sizes);
}
