// A decoder layer of the serving forward in two ops, split where tensor parallelism sums
// the ranks' partial outputs (loaded by spectrio/models/ops/native_ops.py, used by
// DecoderLayer.forward_native in spectrio/models/architecture/layers.py):
//
// * spectrio_attention_block: summed = x + delta (+ the previous block's bias), the
//   RMSNorm (its weight is folded into the q/k/v panels), the fused q/k/v product and its
//   bias, the q/k RMSNorms (Qwen3's), RoPE (rotate-half; the tables come from the model's
//   inverse frequencies, so every scaling the loader accepts), this step's K/V written
//   into the paged pools, causal GQA attention of every row over its own sequence's
//   context read through the block tables, and the o product. Returns (out, summed):
//   out is this rank's partial o projection, without the o bias.
// * spectrio_mlp_block: summed = x + delta (+ bias), the RMSNorm, the fused gate|up
//   product and its bias, SiLU(gate) * up, the down product. Returns (out, summed).
//
// One parallel region per op: the phases share one team of threads, separated by the
// barriers of their work-sharing loops, instead of a dispatch and a fork per small op.
// Every loop is scheduled statically (`static, 1` deals the attention's tasks round-robin,
// which balances a prefill chunk's growing contexts): GCC emits runtime calls for a
// dynamic schedule, and the OpenMP runtime Paddle ships and these kernels share
// (native_ops.py) handed out wrong iterations through them with two threads.
//
// Invariant (batch invariance): every value a row produces is computed by one thread in
// a fixed order that depends only on that row, its sequence's context and the weights:
// its norm, its q/k/v, its attention (over its own context, in position order) and the
// panel products (panel_kernels.h). A row's output therefore does not depend on which
// other rows share the step, on the row count or on the thread count; greedy output with
// speculation equals greedy output without it because of this.
//
// The rows of a step: row r is position positions[r] of sequence row_seq[r], whose KV
// blocks are tables[row_seq[r], :]; the rows of one sequence are consecutive positions,
// and a row attends to positions 0 .. positions[r] of its sequence (this step's rows
// included: every row's K/V is written before any row attends).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "checks.h"
#include "paddle/extension.h"
#include "panel_kernels.h"
#include "block_kernels.h"

namespace {

using spectrio::check_f32_cpu;
using spectrio::kPanel;

// A weight as the ops read it: float32 or float16 panels [ceil(n / 16), k, 16] (kind 0,
// 1: ggml's ids of F32 and F16), or n rows of GGUF blocks, [n, k / block elements * block
// bytes] uint8 (kind: the ggml type, block_kernels.h), or those blocks in the tiled
// layout, [ceil(n / 8), k / 32, 8 * block bytes] (block_kernels.h; told apart by shape). A block weight's type comes from
// the caller: sizes cannot tell the types apart (Q4_K's 144 bytes per 256 are Q4_0's 18
// per 32).
struct Weight {
  const void* data;
  int kind;
  int64_t count, k, n;
  bool tiled;  // blocks regrouped into tiles of 8 columns (block_kernels.h)
  bool blocks() const { return kind > 1; }
};
constexpr int kF32Panels = 0, kF16Panels = 1;

Weight weight_of(const paddle::Tensor& t, int type, int64_t k, int64_t n, const char* what) {
  PD_CHECK(t.is_cpu(), what, ": a CPU tensor is expected");
  const auto& s = t.shape();
  if (t.dtype() == paddle::DataType::UINT8) {
    PD_CHECK(spectrio::block_bytes(type) > 0, what, ": uint8 blocks of ggml type ", type,
             ", which has no kernel (the caller passes the blocks' type)");
    const int64_t elements = spectrio::block_elements(type);
    PD_CHECK(k % elements == 0, what, ": K=", k, " is no multiple of ", elements,
             " for ggml type ", type);
    if (spectrio::tiled_shape(s, type, n, k)) return {t.data<uint8_t>(), type, n, k, n, true};
    PD_CHECK(s.size() == 2 && s[0] == n && s[1] == spectrio::row_bytes_of(type, k), what,
             ": blocks [N, ", spectrio::row_bytes_of(type, k), "] of ggml type ", type,
             " (or their tiles) are expected for K=", k, ", N=", n);
    return {t.data<uint8_t>(), type, n, k, n, false};
  }
  const bool half = t.dtype() == paddle::DataType::FLOAT16;
  PD_CHECK(half || t.dtype() == paddle::DataType::FLOAT32, what,
           ": float32 or float16 panels, or uint8 blocks, are expected");
  const int64_t count = (n + kPanel - 1) / kPanel;
  PD_CHECK(s.size() == 3 && s[0] == count && s[1] == k && s[2] == kPanel, what,
           ": panels [ceil(N / 16), K, 16] are expected for K=", k, ", N=", n);
  const void* data = half ? static_cast<const void*>(t.data<paddle::float16>())
                          : static_cast<const void*>(t.data<float>());
  return {data, half ? kF16Panels : kF32Panels, count, k, n, false};
}

// The rows' quantized activations, sized for the op's largest block-weight input (none
// where every weight is panels).
int64_t block_k(std::initializer_list<Weight> weights) {
  int64_t k = 0;
  for (const Weight& w : weights)
    if (w.blocks()) k = std::max(k, w.k);
  return k;
}

// out [rows, w.n] = x [rows, w.k] @ w, by the calling team (panel_kernels.h,
// block_kernels.h: the rows are quantized first, each by one thread).
void product(const Weight& w, const float* x, int64_t rows, float* out,
             spectrio::QuantizedRows& s) {
  if (w.blocks()) {
    spectrio::quantize_rows_team(x, rows, w.k, s.dx.data(), s.sdx.data(), s.q.data());
    const auto* data = static_cast<const uint8_t*>(w.data);
    if (w.tiled)
      spectrio::tiled_matmul_team(w.kind, data, w.n, w.k, s.dx.data(), s.sdx.data(), s.q.data(),
                                  rows, out);
    else
      spectrio::block_matmul_team(w.kind, data, w.n, w.k, s.dx.data(), s.sdx.data(), s.q.data(),
                                  rows, out);
  } else if (w.kind == kF16Panels) {
    spectrio::panel_matmul_team(x, rows, w.k, static_cast<const uint16_t*>(w.data), w.count,
                                out, w.n);
  } else {
    spectrio::panel_matmul_team(x, rows, w.k, static_cast<const float*>(w.data), w.count, out,
                                w.n);
  }
}

// An optional float32 input: a tensor with no elements stands for "absent".
const float* optional_f32(const paddle::Tensor& t, int64_t numel, const char* what) {
  if (t.numel() == 0) return nullptr;
  check_f32_cpu(t, what);
  PD_CHECK(t.numel() == numel, what, ": ", numel, " elements are expected, not ", t.numel());
  return t.data<float>();
}

const int64_t* int64_input(const paddle::Tensor& t, int64_t numel, const char* what) {
  PD_CHECK(t.is_cpu() && t.dtype() == paddle::DataType::INT64, what,
           ": a CPU int64 tensor is expected");
  PD_CHECK(t.numel() == numel, what, ": ", numel, " elements are expected, not ", t.numel());
  return t.data<int64_t>();
}

// summed = x + (delta + bias); normed = summed / rms(summed), times `weight` where given
// (a block weight follows: the norm weight cannot be folded into quantized values). The
// same operations, in the same order, as spectrio_add_rms_norm and the Python path's
// bias add.
inline void add_normalize_row(const float* x, const float* delta, const float* bias,
                              const float* weight, int64_t d, float eps, float* summed,
                              float* normed) {
  float sq = 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    float s = x[i];
    if (delta != nullptr) s += bias != nullptr ? delta[i] + bias[i] : delta[i];
    summed[i] = s;
    sq += s * s;
  }
  const float scale = 1.0f / std::sqrt(sq / static_cast<float>(d) + eps);
  if (weight != nullptr) {
    for (int64_t i = 0; i < d; ++i) normed[i] = summed[i] * scale * weight[i];
  } else {
    for (int64_t i = 0; i < d; ++i) normed[i] = summed[i] * scale;
  }
}

// The rows' add + norm, shared by both blocks (inside the team).
void add_normalize_rows(const float* x, const float* delta, const float* bias,
                        const float* weight, int64_t rows, int64_t d, float eps, float* summed,
                        float* normed) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    add_normalize_row(x + r * d, delta == nullptr ? nullptr : delta + r * d, bias, weight, d, eps,
                      summed + r * d, normed + r * d);
}

// a * b + c: one fused instruction where the build has FMA (as the vector lanes compute
// it), a multiply and an add otherwise (std::fma would be a slow library call there).
inline float mul_add(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// e^x for x <= 88.7 (the softmax's x - max and SiLU's -x): Cephes' expf, a degree-6
// polynomial of the remainder after 2^n, within 2 ulp of e^x; below -87.3 it returns 0 or
// a subnormal. The same operations in the AVX2 lanes and the scalar tail, so an element's
// value does not depend on which of the two computes it.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP0 = 1.9875691500e-4f, kExpP1 = 1.3981999507e-3f, kExpP2 = 8.3334519073e-3f;
constexpr float kExpP3 = 4.1665795894e-2f, kExpP4 = 1.6666665459e-1f, kExpP5 = 5.0000001201e-1f;
constexpr float kExpMax = 88.3762626647949f, kExpMin = -87.3365478515625f;

inline float exp_approx(float x) {
  x = std::min(std::max(x, kExpMin), kExpMax);
  const float n = std::nearbyint(x * kLog2e);
  float r = mul_add(n, -kLn2Hi, x);
  r = mul_add(n, -kLn2Lo, r);
  float y = kExpP0;
  y = mul_add(y, r, kExpP1);
  y = mul_add(y, r, kExpP2);
  y = mul_add(y, r, kExpP3);
  y = mul_add(y, r, kExpP4);
  y = mul_add(y, r, kExpP5);
  y = mul_add(y, r * r, r) + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

#ifdef SPECTRIO_AVX2
inline __m256 exp_approx(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kExpP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP5));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// The eight lanes' sum in a fixed order.
inline float lane_sum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                   // (0+4) (1+5) (2+6) (3+7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));          // (0+4+2+6) (1+5+3+7)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));  // all
  return _mm_cvtss_f32(s);
}
#endif

// a . b: two eight-lane partial sums over 16-element steps, added in a fixed order.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef SPECTRIO_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
  }
  if (i + 8 <= n) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    i += 8;
  }
  s = lane_sum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) s = mul_add(a[i], b[i], s);
  return s;
}

// s[j] = e^(s[j] - top) for j < n; returns their sum (lanes, then the tail, in order).
inline float exp_shifted(float* s, int64_t n, float top) {
  int64_t j = 0;
  float total = 0.0f;
#ifdef SPECTRIO_AVX2
  const __m256 t = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_approx(_mm256_sub_ps(_mm256_loadu_ps(s + j), t));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = lane_sum(acc);
#endif
  for (; j < n; ++j) {
    s[j] = exp_approx(s[j] - top);
    total += s[j];
  }
  return total;
}

// out[i] = silu(gate[i] + bias[i]) * (up[i] + bias[f + i]), no bias where it is null.
inline void swiglu_row(const float* gate, const float* up, const float* bias, int64_t f,
                       float* out) {
  int64_t i = 0;
#ifdef SPECTRIO_AVX2
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= f; i += 8) {
    __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
    if (bias != nullptr) {
      g = _mm256_add_ps(g, _mm256_loadu_ps(bias + i));
      u = _mm256_add_ps(u, _mm256_loadu_ps(bias + f + i));
    }
    const __m256 e = exp_approx(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
  }
#endif
  for (; i < f; ++i) {
    const float g = bias != nullptr ? gate[i] + bias[i] : gate[i];
    const float u = bias != nullptr ? up[i] + bias[f + i] : up[i];
    out[i] = g / (1.0f + exp_approx(-g)) * u;
  }
}

#ifdef SPECTRIO_AVX2
// Lane l of the result: the sum of a_l's eight lanes (a fixed tree of additions).
inline __m256 lane_sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                         __m256 a6, __m256 a7) {
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                       _mm256_permute2f128_ps(h0123, h4567, 0x31));
}
#endif

// s[j] = q . k[rows[j] ..] for j < ctx. With AVX2 and a head dim of 64, eight positions at
// a time, q held in registers; the positions past the last full eight, and other head
// dims, take dot(). Which of the two computes position j depends only on j and ctx (the
// row's own position), so a row's scores never depend on the other rows of its step.
inline void score_row(const float* q, const float* k, const int64_t* rows, int64_t ctx,
                      int64_t hd, float* s) {
  int64_t j = 0;
#ifdef SPECTRIO_AVX2
  if (hd == 64) {
    const __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8);
    const __m256 q2 = _mm256_loadu_ps(q + 16), q3 = _mm256_loadu_ps(q + 24);
    const __m256 q4 = _mm256_loadu_ps(q + 32), q5 = _mm256_loadu_ps(q + 40);
    const __m256 q6 = _mm256_loadu_ps(q + 48), q7 = _mm256_loadu_ps(q + 56);
    auto dot64 = [&](const float* x) {
      __m256 a = _mm256_mul_ps(q0, _mm256_loadu_ps(x));
      a = _mm256_fmadd_ps(q1, _mm256_loadu_ps(x + 8), a);
      a = _mm256_fmadd_ps(q2, _mm256_loadu_ps(x + 16), a);
      a = _mm256_fmadd_ps(q3, _mm256_loadu_ps(x + 24), a);
      a = _mm256_fmadd_ps(q4, _mm256_loadu_ps(x + 32), a);
      a = _mm256_fmadd_ps(q5, _mm256_loadu_ps(x + 40), a);
      a = _mm256_fmadd_ps(q6, _mm256_loadu_ps(x + 48), a);
      return _mm256_fmadd_ps(q7, _mm256_loadu_ps(x + 56), a);
    };
    for (; j + 8 <= ctx; j += 8) {
      const int64_t* r = rows + j;
      _mm256_storeu_ps(s + j, lane_sums8(dot64(k + r[0]), dot64(k + r[1]), dot64(k + r[2]),
                                         dot64(k + r[3]), dot64(k + r[4]), dot64(k + r[5]),
                                         dot64(k + r[6]), dot64(k + r[7])));
    }
  }
#endif
  for (; j < ctx; ++j) s[j] = dot(q, k + rows[j], hd);
}

// o [hd] = sum over j < ctx of w[j] * v[rows[j] ..], in position order, one fused
// multiply-add per element and position. With AVX2 and a head dim that is a multiple of
// 64, each 64 columns are summed in eight registers; the scalar loop makes the same chain.
inline void weighted_sum(const float* w, const int64_t* rows, int64_t ctx, const float* v,
                         int64_t hd, float* o) {
  int64_t c0 = 0;
#ifdef SPECTRIO_AVX2
  for (; c0 + 64 <= hd; c0 += 64) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int64_t j = 0; j < ctx; ++j) {
      const __m256 wj = _mm256_set1_ps(w[j]);
      const float* x = v + rows[j] + c0;
      a0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x), a0);
      a1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x + 8), a1);
      a2 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x + 16), a2);
      a3 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x + 24), a3);
      a4 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x + 32), a4);
      a5 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x + 40), a5);
      a6 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x + 48), a6);
      a7 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x + 56), a7);
    }
    float* out = o + c0;
    _mm256_storeu_ps(out, a0);
    _mm256_storeu_ps(out + 8, a1);
    _mm256_storeu_ps(out + 16, a2);
    _mm256_storeu_ps(out + 24, a3);
    _mm256_storeu_ps(out + 32, a4);
    _mm256_storeu_ps(out + 40, a5);
    _mm256_storeu_ps(out + 48, a6);
    _mm256_storeu_ps(out + 56, a7);
  }
#endif
  if (c0 < hd) {
    std::fill(o + c0, o + hd, 0.0f);
    for (int64_t j = 0; j < ctx; ++j)
      for (int64_t e = c0; e < hd; ++e) o[e] = mul_add(w[j], v[rows[j] + e], o[e]);
  }
}

// x [d] /= rms(x), times weight.
inline void rms_norm_head(float* x, const float* weight, int64_t d, float eps) {
  float sq = 0.0f;
  for (int64_t i = 0; i < d; ++i) sq += x[i] * x[i];
  const float scale = 1.0f / std::sqrt(sq / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) x[i] = x[i] * scale * weight[i];
}

// Rotate-half RoPE of one head in place, with the row's cos/sin [d / 2].
inline void rope_head(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * cos[j] - b * sin[j];
    x[j + half] = b * cos[j] + a * sin[j];
  }
}

// A layer's sizes.
struct Dims {
  int64_t d, h, kvh, hd, bs;
  int64_t g() const { return h / kvh; }
  int64_t nq() const { return h * hd; }
  int64_t nqkv() const { return (h + 2 * kvh) * hd; }
};

Dims dims_of(int64_t d, int num_heads, int num_kv_heads, int head_dim, int block_size,
             const char* what) {
  const Dims s{d, num_heads, num_kv_heads, head_dim, block_size};
  PD_CHECK(s.h > 0 && s.kvh > 0 && s.h % s.kvh == 0 && s.hd > 0 && s.hd % 2 == 0 && s.bs > 0,
           what, ": heads, head_dim and block_size do not fit");
  return s;
}

// A step's rows as every layer reads them, checked against the RoPE tables.
struct StepRows {
  int64_t n = 0, num_seqs = 0, width = 0, max_ctx = 0, half = 0;
  const int64_t *pos = nullptr, *seq = nullptr, *tab = nullptr;
  const float *cos = nullptr, *sin = nullptr;
  std::vector<int64_t> seq_last;  // each sequence's last position this step (-1: none)
};

StepRows step_rows(int64_t n, const Dims& s, const paddle::Tensor& rope_cos,
                   const paddle::Tensor& rope_sin, const paddle::Tensor& positions,
                   const paddle::Tensor& row_seq, const paddle::Tensor& tables,
                   const char* what) {
  StepRows r;
  r.n = n;
  r.half = s.hd / 2;
  check_f32_cpu(rope_cos, what);
  check_f32_cpu(rope_sin, what);
  PD_CHECK(rope_cos.shape().size() == 2 && rope_cos.shape()[1] == r.half &&
               rope_sin.shape() == rope_cos.shape(),
           what, ": rope tables are [P, head_dim / 2]");
  const int64_t rope_len = rope_cos.shape()[0];
  r.pos = int64_input(positions, n, "positions");
  r.seq = int64_input(row_seq, n, "row_seq");
  PD_CHECK(tables.shape().size() == 2, what, ": tables are [B, W]");
  r.num_seqs = tables.shape()[0];
  r.width = tables.shape()[1];
  r.tab = int64_input(tables, r.num_seqs * r.width, "tables");
  r.cos = rope_cos.data<float>();
  r.sin = rope_sin.data<float>();
  r.seq_last.assign(r.num_seqs, -1);
  for (int64_t i = 0; i < n; ++i) {
    PD_CHECK(r.seq[i] >= 0 && r.seq[i] < r.num_seqs, what, ": row ", i, " names sequence ",
             r.seq[i], " of ", r.num_seqs);
    PD_CHECK(r.pos[i] >= 0 && r.pos[i] < rope_len, what, ": row ", i, " is at position ",
             r.pos[i], ", outside the RoPE table's ", rope_len);
    r.seq_last[r.seq[i]] = std::max(r.seq_last[r.seq[i]], r.pos[i]);
    r.max_ctx = std::max(r.max_ctx, r.pos[i] + 1);
  }
  for (int64_t b = 0; b < r.num_seqs; ++b) {
    const int64_t blocks = r.seq_last[b] < 0 ? 0 : r.seq_last[b] / s.bs + 1;
    PD_CHECK(blocks <= r.width, what, ": sequence ", b, " reaches position ", r.seq_last[b],
             " beyond its ", r.width, " blocks");
  }
  return r;
}

// A layer's attention half: its weights, and the K/V pools it writes in place (the op owns
// no state, the cache does; no autograd).
struct AttentionLayer {
  Weight qkv, o;
  const float *norm_w, *qkv_b, *qk_w;
  float *kp, *vp;
  int64_t slots;  // pool rows per KV head
};

AttentionLayer attention_layer(const Dims& s, const StepRows& rows,
                               const paddle::Tensor& norm_weight, const paddle::Tensor& qkv,
                               const paddle::Tensor& qkv_bias, const paddle::Tensor& qk_norm,
                               const paddle::Tensor& k_pool, const paddle::Tensor& v_pool,
                               const paddle::Tensor& o, int qkv_type, int o_type) {
  AttentionLayer a{};
  a.qkv = weight_of(qkv, qkv_type, s.d, s.nqkv(), "attention qkv");
  a.o = weight_of(o, o_type, s.nq(), s.d, "attention o");
  a.norm_w = optional_f32(norm_weight, s.d, "attention norm_weight");
  PD_CHECK(!a.qkv.blocks() || a.norm_w != nullptr,
           "attention: block weights need the norm weight (it is not folded into them)");
  a.qkv_b = optional_f32(qkv_bias, s.nqkv(), "attention qkv_bias");
  a.qk_w = optional_f32(qk_norm, (s.h + s.kvh) * s.hd, "attention qk_norm");
  check_f32_cpu(k_pool, "attention k_pool");
  check_f32_cpu(v_pool, "attention v_pool");
  PD_CHECK(k_pool.shape().size() == 2 && k_pool.shape()[1] == s.hd &&
               v_pool.shape() == k_pool.shape() && k_pool.shape()[0] % (s.kvh * s.bs) == 0,
           "attention: pools are [kv_heads * blocks * block_size, head_dim]");
  a.slots = k_pool.shape()[0] / s.kvh;
  const int64_t num_blocks = a.slots / s.bs;
  // every block a row reads or writes, checked before the parallel region
  for (int64_t b = 0; b < rows.num_seqs; ++b) {
    const int64_t blocks = rows.seq_last[b] < 0 ? 0 : rows.seq_last[b] / s.bs + 1;
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t block = rows.tab[b * rows.width + j];
      PD_CHECK(block >= 0 && block < num_blocks, "attention: sequence ", b, " names block ",
               block, " of ", num_blocks);
    }
  }
  a.kp = const_cast<float*>(k_pool.data<float>());
  a.vp = const_cast<float*>(v_pool.data<float>());
  return a;
}

// A layer's MLP half.
struct MlpLayer {
  Weight gate_up, down;
  const float *norm_w, *gate_up_b;
  int64_t f;
};

MlpLayer mlp_layer(int64_t d, int64_t f, const paddle::Tensor& norm_weight,
                   const paddle::Tensor& gate_up, const paddle::Tensor& gate_up_bias,
                   const paddle::Tensor& down, int gate_up_type, int down_type) {
  PD_CHECK(f > 0, "mlp: the intermediate size is positive");
  MlpLayer m{};
  m.f = f;
  m.gate_up = weight_of(gate_up, gate_up_type, d, 2 * f, "mlp gate_up");
  m.down = weight_of(down, down_type, f, d, "mlp down");
  m.norm_w = optional_f32(norm_weight, d, "mlp norm_weight");
  PD_CHECK(!m.gate_up.blocks() || m.norm_w != nullptr,
           "mlp: block weights need the norm weight (it is not folded into them)");
  m.gate_up_b = optional_f32(gate_up_bias, 2 * f, "mlp gate_up_bias");
  return m;
}

// The team's buffers for `n` rows, sized for the largest layer they serve.
struct Work {
  std::vector<float> normed, qkv, attn, gate_up, act;
  spectrio::QuantizedRows scratch;
  Work(int64_t n, const Dims& s, int64_t f, int64_t block_k)
      : normed(n * s.d), qkv(n * s.nqkv()), attn(n * s.nq()), gate_up(n * 2 * f), act(n * f),
        scratch(n, block_k) {}
};

// The attention half, by the calling team (inside a parallel region): summed = x + delta
// (+ bias), and out = this rank's o projection of the attention over it.
void attention_team(const Dims& s, const StepRows& rows, const AttentionLayer& a,
                    const float* x, const float* delta, const float* bias, float eps,
                    float* summed, float* out, Work& w) {
  const int64_t n = rows.n, h = s.h, kvh = s.kvh, hd = s.hd, bs = s.bs, g = s.g();
  const int64_t nq = s.nq(), nqkv = s.nqkv(), half = rows.half, width = rows.width;
  const int64_t* pos = rows.pos;
  const int64_t* seq = rows.seq;
  const int64_t* tab = rows.tab;
  float* qkv = w.qkv.data();
  add_normalize_rows(x, delta, bias, a.norm_w, n, s.d, eps, summed, w.normed.data());
  product(a.qkv, w.normed.data(), n, qkv, w.scratch);

  // bias, q/k norms, RoPE, and this step's K/V into the pools
#pragma omp for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    float* row = qkv + r * nqkv;
    if (a.qkv_b != nullptr)
      for (int64_t i = 0; i < nqkv; ++i) row[i] += a.qkv_b[i];
    const float* cos = rows.cos + pos[r] * half;
    const float* sin = rows.sin + pos[r] * half;
    for (int64_t head = 0; head < h + kvh; ++head) {
      if (a.qk_w != nullptr) rms_norm_head(row + head * hd, a.qk_w + head * hd, hd, eps);
      rope_head(row + head * hd, cos, sin, hd);
    }
    const int64_t p = pos[r];
    const int64_t slot = tab[seq[r] * width + p / bs] * bs + p % bs;
    for (int64_t kv = 0; kv < kvh; ++kv) {
      std::copy_n(row + nq + kv * hd, hd, a.kp + (kv * a.slots + slot) * hd);
      std::copy_n(row + nq + (kvh + kv) * hd, hd, a.vp + (kv * a.slots + slot) * hd);
    }
  }

  // attention: one task per (row, KV head), its g query heads together
  std::vector<float> scores(g * rows.max_ctx);
  std::vector<int64_t> rows_of(rows.max_ctx);
#pragma omp for schedule(static, 1)
  for (int64_t task = 0; task < n * kvh; ++task) {
    const int64_t r = task / kvh, kv = task % kvh;
    const int64_t ctx = pos[r] + 1;
    const int64_t* table = tab + seq[r] * width;
    for (int64_t j = 0; j < ctx; ++j)
      rows_of[j] = (kv * a.slots + table[j / bs] * bs + j % bs) * hd;
    const float* q = qkv + r * nqkv + kv * g * hd;
    for (int64_t i = 0; i < g; ++i)
      score_row(q + i * hd, a.kp, rows_of.data(), ctx, hd, scores.data() + i * ctx);
    for (int64_t i = 0; i < g; ++i) {
      float* sc = scores.data() + i * ctx;
      float top = sc[0];
      for (int64_t j = 1; j < ctx; ++j) top = std::max(top, sc[j]);
      const float inv = 1.0f / exp_shifted(sc, ctx, top);
      for (int64_t j = 0; j < ctx; ++j) sc[j] *= inv;
    }
    float* o = w.attn.data() + r * nq + kv * g * hd;
    for (int64_t i = 0; i < g; ++i)
      weighted_sum(scores.data() + i * ctx, rows_of.data(), ctx, a.vp, hd, o + i * hd);
  }

  product(a.o, w.attn.data(), n, out, w.scratch);
}

// The MLP half, by the calling team: summed = x + delta (+ bias), and out = this rank's
// down projection of SwiGLU over it.
void mlp_team(int64_t n, int64_t d, const MlpLayer& m, const float* x, const float* delta,
              const float* bias, float eps, float* summed, float* out, Work& w) {
  const int64_t f = m.f;
  add_normalize_rows(x, delta, bias, m.norm_w, n, d, eps, summed, w.normed.data());
  product(m.gate_up, w.normed.data(), n, w.gate_up.data(), w.scratch);
#pragma omp for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* gate = w.gate_up.data() + r * 2 * f;
    swiglu_row(gate, gate + f, m.gate_up_b, f, w.act.data() + r * f);
  }
  product(m.down, w.act.data(), n, out, w.scratch);
}

int64_t rows_of_x(const paddle::Tensor& x, const char* what) {
  check_f32_cpu(x, what);
  PD_CHECK(x.shape().size() == 2, what, ": x is [N, d]");
  return x.shape()[0];
}

}  // namespace

std::vector<paddle::Tensor> AttentionBlock(
    const paddle::Tensor& x, const paddle::Tensor& delta, const paddle::Tensor& delta_bias,
    const paddle::Tensor& norm_weight, const paddle::Tensor& qkv_panels,
    const paddle::Tensor& qkv_bias,
    const paddle::Tensor& qk_norm, const paddle::Tensor& rope_cos, const paddle::Tensor& rope_sin,
    const paddle::Tensor& k_pool, const paddle::Tensor& v_pool, const paddle::Tensor& o_panels,
    const paddle::Tensor& positions, const paddle::Tensor& row_seq, const paddle::Tensor& tables,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float eps, int num_threads,
    int qkv_type, int o_type) {
  const int64_t n = rows_of_x(x, "attention_block x"), d = x.shape()[1];
  const Dims s = dims_of(d, num_heads, num_kv_heads, head_dim, block_size, "attention_block");
  const float* dp = optional_f32(delta, n * d, "attention_block delta");
  const float* bp = optional_f32(delta_bias, d, "attention_block delta_bias");
  const StepRows rows =
      step_rows(n, s, rope_cos, rope_sin, positions, row_seq, tables, "attention_block");
  const AttentionLayer a = attention_layer(s, rows, norm_weight, qkv_panels, qkv_bias, qk_norm,
                                           k_pool, v_pool, o_panels, qkv_type, o_type);
  auto out = paddle::empty({n, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto summed = paddle::empty({n, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  Work w(n, s, 0, block_k({a.qkv, a.o}));
  const float* xp = x.data<float>();
  float* sp = summed.data<float>();
  float* op = out.data<float>();
#pragma omp parallel num_threads(std::max(1, num_threads))
  attention_team(s, rows, a, xp, dp, bp, eps, sp, op, w);
  return {out, summed};
}

std::vector<std::vector<int64_t>> AttentionBlockShape(
    const std::vector<int64_t>& x, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {x, x};
}

std::vector<paddle::DataType> AttentionBlockDtype(
    const paddle::DataType& x, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {x, x};
}

PD_BUILD_OP(spectrio_attention_block)
    .Inputs({"X", "Delta", "DeltaBias", "NormWeight", "QkvPanels", "QkvBias", "QkNorm", "RopeCos",
             "RopeSin", "KPool", "VPool", "OPanels", "Positions", "RowSeq", "Tables"})
    .Outputs({"Out", "Summed"})
    .Attrs({"num_heads: int", "num_kv_heads: int", "head_dim: int", "block_size: int",
            "eps: float", "num_threads: int", "qkv_type: int", "o_type: int"})
    .SetKernelFn(PD_KERNEL(AttentionBlock))
    .SetInferShapeFn(PD_INFER_SHAPE(AttentionBlockShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AttentionBlockDtype));

std::vector<paddle::Tensor> MlpBlock(const paddle::Tensor& x, const paddle::Tensor& delta,
                                     const paddle::Tensor& delta_bias,
                                     const paddle::Tensor& norm_weight,
                                     const paddle::Tensor& gate_up_panels,
                                     const paddle::Tensor& gate_up_bias,
                                     const paddle::Tensor& down_panels, int64_t intermediate,
                                     float eps, int num_threads, int gate_up_type,
                                     int down_type) {
  const int64_t n = rows_of_x(x, "mlp_block x"), d = x.shape()[1];
  const float* dp = optional_f32(delta, n * d, "mlp_block delta");
  const float* bp = optional_f32(delta_bias, d, "mlp_block delta_bias");
  const MlpLayer m = mlp_layer(d, intermediate, norm_weight, gate_up_panels, gate_up_bias,
                               down_panels, gate_up_type, down_type);
  auto out = paddle::empty({n, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto summed = paddle::empty({n, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  Work w(n, Dims{d, 0, 1, 0, 1}, m.f, block_k({m.gate_up, m.down}));
  const float* xp = x.data<float>();
  float* sp = summed.data<float>();
  float* op = out.data<float>();
#pragma omp parallel num_threads(std::max(1, num_threads))
  mlp_team(n, d, m, xp, dp, bp, eps, sp, op, w);
  return {out, summed};
}

std::vector<std::vector<int64_t>> MlpBlockShape(const std::vector<int64_t>& x,
                                                const std::vector<int64_t>&,
                                                const std::vector<int64_t>&,
                                                const std::vector<int64_t>&,
                                                const std::vector<int64_t>&,
                                                const std::vector<int64_t>&,
                                                const std::vector<int64_t>&) {
  return {x, x};
}

std::vector<paddle::DataType> MlpBlockDtype(const paddle::DataType& x, const paddle::DataType&,
                                            const paddle::DataType&, const paddle::DataType&,
                                            const paddle::DataType&, const paddle::DataType&,
                                            const paddle::DataType&) {
  return {x, x};
}

PD_BUILD_OP(spectrio_mlp_block)
    .Inputs({"X", "Delta", "DeltaBias", "NormWeight", "GateUpPanels", "GateUpBias", "DownPanels"})
    .Outputs({"Out", "Summed"})
    .Attrs({"intermediate: int64_t", "eps: float", "num_threads: int", "gate_up_type: int",
            "down_type: int"})
    .SetKernelFn(PD_KERNEL(MlpBlock))
    .SetInferShapeFn(PD_INFER_SHAPE(MlpBlockShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(MlpBlockDtype));

// spectrio_decoder_layers: a run of whole layers of one rank (no tensor parallelism: no
// sum across ranks between halves) in one op and one parallel region, layer l reading
// the l-th entry of each list; an absent input is an empty tensor, as above. Each half
// is the same team function as the two ops above, in the same order, so the result is
// bit for bit theirs chained: returns (summed, delta) whose sum plus the last layer's
// down bias (left to the caller, as there) is the last layer's output.
std::vector<paddle::Tensor> DecoderLayers(
    const paddle::Tensor& x, const paddle::Tensor& delta, const paddle::Tensor& delta_bias,
    const std::vector<paddle::Tensor>& input_norms, const std::vector<paddle::Tensor>& qkvs,
    const std::vector<paddle::Tensor>& qkv_biases, const std::vector<paddle::Tensor>& qk_norms,
    const std::vector<paddle::Tensor>& k_pools, const std::vector<paddle::Tensor>& v_pools,
    const std::vector<paddle::Tensor>& os, const std::vector<paddle::Tensor>& o_biases,
    const std::vector<paddle::Tensor>& post_norms, const std::vector<paddle::Tensor>& gate_ups,
    const std::vector<paddle::Tensor>& gate_up_biases, const std::vector<paddle::Tensor>& downs,
    const std::vector<paddle::Tensor>& down_biases, const paddle::Tensor& rope_cos,
    const paddle::Tensor& rope_sin, const paddle::Tensor& positions,
    const paddle::Tensor& row_seq, const paddle::Tensor& tables, int num_heads,
    int num_kv_heads, int head_dim, int block_size, int64_t intermediate, float eps,
    int num_threads, const std::vector<int>& types) {
  const int64_t n = rows_of_x(x, "decoder_layers x"), d = x.shape()[1];
  const size_t layers = qkvs.size();
  PD_CHECK(layers > 0, "decoder_layers: at least one layer");
  for (const auto* list : {&input_norms, &qkv_biases, &qk_norms, &k_pools, &v_pools, &os,
                           &o_biases, &post_norms, &gate_ups, &gate_up_biases, &downs,
                           &down_biases})
    PD_CHECK(list->size() == layers, "decoder_layers: every list has one entry per layer (",
             layers, "), not ", list->size());
  PD_CHECK(types.size() == 4 * layers,
           "decoder_layers: four ggml types per layer (qkv, o, gate_up, down)");
  const Dims s = dims_of(d, num_heads, num_kv_heads, head_dim, block_size, "decoder_layers");
  const float* dp = optional_f32(delta, n * d, "decoder_layers delta");
  const float* bp = optional_f32(delta_bias, d, "decoder_layers delta_bias");
  const StepRows rows =
      step_rows(n, s, rope_cos, rope_sin, positions, row_seq, tables, "decoder_layers");
  std::vector<AttentionLayer> attn;
  std::vector<MlpLayer> mlp;
  std::vector<const float*> o_b, down_b;
  int64_t k_max = 0;
  for (size_t l = 0; l < layers; ++l) {
    attn.push_back(attention_layer(s, rows, input_norms[l], qkvs[l], qkv_biases[l], qk_norms[l],
                                   k_pools[l], v_pools[l], os[l], types[4 * l],
                                   types[4 * l + 1]));
    mlp.push_back(mlp_layer(d, intermediate, post_norms[l], gate_ups[l], gate_up_biases[l],
                            downs[l], types[4 * l + 2], types[4 * l + 3]));
    o_b.push_back(optional_f32(o_biases[l], d, "decoder_layers o_bias"));
    down_b.push_back(optional_f32(down_biases[l], d, "decoder_layers down_bias"));
    k_max = std::max(k_max, block_k({attn[l].qkv, attn[l].o, mlp[l].gate_up, mlp[l].down}));
  }
  auto summed = paddle::empty({n, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto out = paddle::empty({n, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  Work w(n, s, intermediate, k_max);
  std::vector<float> attn_out(n * d);
  float* sp = summed.data<float>();
  float* op = out.data<float>();
  const float* xp = x.data<float>();
#pragma omp parallel num_threads(std::max(1, num_threads))
  {
    // summed is updated in place from the second half on: add_normalize_rows reads a row's
    // element before it writes it, and each row is one thread's
    for (size_t l = 0; l < layers; ++l) {
      attention_team(s, rows, attn[l], l == 0 ? xp : sp, l == 0 ? dp : op,
                     l == 0 ? bp : down_b[l - 1], eps, sp, attn_out.data(), w);
      mlp_team(n, d, mlp[l], sp, attn_out.data(), o_b[l], eps, sp, op, w);
    }
  }
  return {summed, out};
}

using Shape = std::vector<int64_t>;
using Shapes = std::vector<Shape>;
std::vector<Shape> DecoderLayersShape(const Shape& x, const Shape&, const Shape&, const Shapes&,
                                      const Shapes&, const Shapes&, const Shapes&, const Shapes&,
                                      const Shapes&, const Shapes&, const Shapes&, const Shapes&,
                                      const Shapes&, const Shapes&, const Shapes&, const Shapes&,
                                      const Shape&, const Shape&, const Shape&, const Shape&,
                                      const Shape&) {
  return {x, x};
}

using Dtype = paddle::DataType;
using Dtypes = std::vector<paddle::DataType>;
std::vector<Dtype> DecoderLayersDtype(const Dtype& x, const Dtype&, const Dtype&, const Dtypes&,
                                      const Dtypes&, const Dtypes&, const Dtypes&, const Dtypes&,
                                      const Dtypes&, const Dtypes&, const Dtypes&, const Dtypes&,
                                      const Dtypes&, const Dtypes&, const Dtypes&, const Dtypes&,
                                      const Dtype&, const Dtype&, const Dtype&, const Dtype&,
                                      const Dtype&) {
  return {x, x};
}

PD_BUILD_OP(spectrio_decoder_layers)
    .Inputs({"X", "Delta", "DeltaBias", paddle::Vec("InputNorms"), paddle::Vec("Qkv"),
             paddle::Vec("QkvBias"), paddle::Vec("QkNorm"), paddle::Vec("KPool"),
             paddle::Vec("VPool"), paddle::Vec("O"), paddle::Vec("OBias"),
             paddle::Vec("PostNorms"), paddle::Vec("GateUp"), paddle::Vec("GateUpBias"),
             paddle::Vec("Down"), paddle::Vec("DownBias"), "RopeCos", "RopeSin", "Positions",
             "RowSeq", "Tables"})
    .Outputs({"Summed", "Out"})
    .Attrs({"num_heads: int", "num_kv_heads: int", "head_dim: int", "block_size: int",
            "intermediate: int64_t", "eps: float", "num_threads: int", "types: std::vector<int>"})
    .SetKernelFn(PD_KERNEL(DecoderLayers))
    .SetInferShapeFn(PD_INFER_SHAPE(DecoderLayersShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecoderLayersDtype));
