// The sampler's inverse-CDF draw on CPU in one C++ call: the row's max, the sum of exp(x - max), the
// drawn token and its logprob, with no vocabulary-sized temporary.
//
// The torch path (rollout.layers.sampler) takes four operators over every row of the vocabulary
// (max, x - max into a new tensor, exp_, cumsum_) and a search: for 128 rows of a
// 152k vocabulary that is five passes over 78 MB and a fresh 78 MB tensor, ~100 ms of a decode step
// on two cores. Here a row is read twice (max, then exp and sums) and nothing of its size is written.
//
// Per row of dist [S, V] fp32: m = max; e_j = exp(x_j - m), vectorised (Cephes' expf polynomial,
// within 2 ulp of exp; exactly 0 below -87.33, where exp leaves the normal floats); the e_j summed in
// blocks of two vectors (each block's sum in a fixed lane order, in fp32), the blocks summed in order
// in fp64: total. The draw is the first token whose running sum passes u * total (u in [0, 1)):
// the block where the blocks' running sum passes it, then in that block the first token whose running
// sum (fp64, in order) passes it — or that block's last token of non-zero probability, should rounding
// leave the sum inside the block short of it; a token of probability 0 is never drawn. Its logprob is
// (x - m) - log(total). A replayed score calls the same function with the token given instead of u,
// so a reported logprob and its replay are the same bits. Each row is computed alone: a row's result
// does not depend on the batch it came in. A row holding a NaN or +inf (or only -inf) reports NaN.

namespace {

constexpr int SB = 2 * SL;  // values per block of the draw's running sums

// a block of SB values of the row from b0 (past V: -inf), its exps into e
inline void block_exps(const float* x, int64_t V, int64_t b0, float m, float* e) {
  float buf[SB];
  const float* src = x + b0;
  if (b0 + SB > V) {
    for (int j = 0; j < SB; ++j) buf[j] = b0 + j < V ? x[b0 + j] : -INFINITY;
    src = buf;
  }
  const svf mv = ssplat(m);
  const svf e0 = sexp(sload(src) - mv), e1 = sexp(sload(src + SL) - mv);
  std::memcpy(e, &e0, sizeof e0);
  std::memcpy(e + SL, &e1, sizeof e1);
}

inline float block_sum(const float* e) {
  float s = 0.f;
  for (int j = 0; j < SB; ++j) s += e[j];
  return s;
}

// row max; NaN when the row holds a NaN
inline float row_max(const float* x, int64_t V) {
  svf mv = ssplat(-INFINITY);
  svi nan = {};
  int64_t j = 0;
  for (; j + SL <= V; j += SL) {
    const svf v = sload(x + j);
    mv = v > mv ? v : mv;
    nan |= v != v;
  }
  float m = -INFINITY;
  bool any_nan = false;
  for (int i = 0; i < SL; ++i) { m = std::max(m, mv[i]); any_nan |= nan[i] != 0; }
  for (; j < V; ++j) { any_nan |= x[j] != x[j]; m = std::max(m, x[j]); }
  return any_nan ? NAN : m;
}

// one row: the drawn token (draw) or the given one, and its logprob
float sample_row(const float* x, int64_t V, float u, bool draw, int64_t* id, std::vector<float>& sums) {
  const float m = row_max(x, V);
  if (!(m > -INFINITY) || !(m < INFINITY)) {  // NaN, +inf or nothing kept: no distribution
    if (draw) *id = V - 1;
    return NAN;
  }
  const int64_t blocks = (V + SB - 1) / SB;
  sums.resize(blocks);
  float e[SB];
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    block_exps(x, V, b * SB, m, e);
    sums[b] = block_sum(e);
    total += sums[b];
  }
  if (draw) {
    const double target = static_cast<double>(u) * total;
    double run = 0.0;
    int64_t b = 0, last = -1;
    for (; b < blocks; ++b) {
      if (sums[b] > 0.f) last = b;
      if (run + sums[b] > target) break;
      run += sums[b];
    }
    if (b == blocks) b = last;  // rounding left the sums short of the target: the last block with mass
    block_exps(x, V, b * SB, m, e);
    int64_t pick = -1;
    for (int j = 0; j < SB; ++j) {
      if (e[j] > 0.f) pick = j;
      run += e[j];
      if (e[j] > 0.f && run > target) break;
    }
    *id = b * SB + pick;
  }
  return static_cast<float>(static_cast<double>(x[*id] - m) - std::log(total));
}

}  // namespace

// dist [S, V] fp32 -> logprobs [S] fp32; draw: ids [S] (long) written with the tokens drawn by
// uniforms [S] fp32 in [0, 1); else the logprobs of the tokens already in ids
at::Tensor sample_rows(at::Tensor dist, at::Tensor uniforms, at::Tensor ids, bool draw) {
  TORCH_CHECK(dist.dim() == 2 && dist.scalar_type() == at::kFloat, "sample_rows: dist [S, V] fp32");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.size(0) == dist.size(0),
              "sample_rows: ids [S] long, contiguous");
  TORCH_CHECK(!draw || (uniforms.dim() == 1 && uniforms.scalar_type() == at::kFloat && uniforms.size(0) == dist.size(0)),
              "sample_rows: uniforms [S] fp32 to draw");
  auto rows = dist.contiguous();
  auto us = draw ? uniforms.contiguous() : uniforms;
  const int64_t S = rows.size(0), V = rows.size(1);
  TORCH_CHECK(V > 0, "sample_rows: an empty vocabulary");
  auto out = rows.new_empty({S});
  const float* x = rows.data_ptr<float>();
  const float* u = draw ? us.data_ptr<float>() : nullptr;
  int64_t* id = ids.data_ptr<int64_t>();
  float* lp = out.data_ptr<float>();
  if (!draw)
    for (int64_t s = 0; s < S; ++s) TORCH_CHECK(id[s] >= 0 && id[s] < V, "sample_rows: a token id outside the vocabulary");
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> sums;
    for (int64_t s = s0; s < s1; ++s) lp[s] = sample_row(x + s * V, V, draw ? u[s] : 0.f, draw, id + s, sums);
  });
  return out;
}
