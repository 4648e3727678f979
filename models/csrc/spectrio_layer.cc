// A decoder layer of the serving forward in two ops, split where tensor parallelism sums
// the ranks' partial outputs (loaded by spectrio/models/native_ops.py, used by
// DecoderLayer.forward_native in spectrio/models/layers.py):
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
  check_f32_cpu(x, "attention_block x");
  PD_CHECK(x.shape().size() == 2, "attention_block: x is [N, d]");
  const int64_t n = x.shape()[0], d = x.shape()[1];
  const int64_t h = num_heads, kvh = num_kv_heads, hd = head_dim, bs = block_size;
  PD_CHECK(h > 0 && kvh > 0 && h % kvh == 0 && hd > 0 && hd % 2 == 0 && bs > 0,
           "attention_block: heads, head_dim and block_size do not fit");
  const int64_t g = h / kvh, nq = h * hd, nqkv = (h + 2 * kvh) * hd;
  const float* dp = optional_f32(delta, n * d, "attention_block delta");
  const float* bp = optional_f32(delta_bias, d, "attention_block delta_bias");
  const Weight w_qkv = weight_of(qkv_panels, qkv_type, d, nqkv, "attention_block qkv");
  const Weight w_o = weight_of(o_panels, o_type, nq, d, "attention_block o");
  const float* norm_w = optional_f32(norm_weight, d, "attention_block norm_weight");
  PD_CHECK(!w_qkv.blocks() || norm_w != nullptr,
           "attention_block: block weights need the norm weight (it is not folded into them)");
  const float* qkv_b = optional_f32(qkv_bias, nqkv, "attention_block qkv_bias");
  const float* qk_w = optional_f32(qk_norm, (h + kvh) * hd, "attention_block qk_norm");
  check_f32_cpu(rope_cos, "attention_block rope_cos");
  check_f32_cpu(rope_sin, "attention_block rope_sin");
  const int64_t half = hd / 2;
  PD_CHECK(rope_cos.shape().size() == 2 && rope_cos.shape()[1] == half &&
               rope_sin.shape() == rope_cos.shape(),
           "attention_block: rope tables are [P, head_dim / 2]");
  const int64_t rope_len = rope_cos.shape()[0];
  check_f32_cpu(k_pool, "attention_block k_pool");
  check_f32_cpu(v_pool, "attention_block v_pool");
  PD_CHECK(k_pool.shape().size() == 2 && k_pool.shape()[1] == hd &&
               v_pool.shape() == k_pool.shape() && k_pool.shape()[0] % (kvh * bs) == 0,
           "attention_block: pools are [kv_heads * blocks * block_size, head_dim]");
  const int64_t slots = k_pool.shape()[0] / kvh, num_blocks = slots / bs;
  const int64_t* pos = int64_input(positions, n, "attention_block positions");
  const int64_t* seq = int64_input(row_seq, n, "attention_block row_seq");
  PD_CHECK(tables.shape().size() == 2, "attention_block: tables are [B, W]");
  const int64_t num_seqs = tables.shape()[0], width = tables.shape()[1];
  const int64_t* tab = int64_input(tables, num_seqs * width, "attention_block tables");

  // Every address the team will use is checked here, before the parallel region.
  int64_t max_ctx = 0;
  std::vector<int64_t> seq_last(num_seqs, -1);
  for (int64_t r = 0; r < n; ++r) {
    PD_CHECK(seq[r] >= 0 && seq[r] < num_seqs, "attention_block: row ", r, " names sequence ",
             seq[r], " of ", num_seqs);
    PD_CHECK(pos[r] >= 0 && pos[r] < rope_len, "attention_block: row ", r, " is at position ",
             pos[r], ", outside the RoPE table's ", rope_len);
    seq_last[seq[r]] = std::max(seq_last[seq[r]], pos[r]);
    max_ctx = std::max(max_ctx, pos[r] + 1);
  }
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t blocks = seq_last[b] < 0 ? 0 : seq_last[b] / bs + 1;
    PD_CHECK(blocks <= width, "attention_block: sequence ", b, " reaches position ", seq_last[b],
             " beyond its ", width, " blocks");
    for (int64_t j = 0; j < blocks; ++j)
      PD_CHECK(tab[b * width + j] >= 0 && tab[b * width + j] < num_blocks,
               "attention_block: sequence ", b, " names block ", tab[b * width + j], " of ",
               num_blocks);
  }

  auto out = paddle::empty({n, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto summed = paddle::empty({n, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  std::vector<float> normed(n * d), qkv(n * nqkv), attn(n * nq);
  spectrio::QuantizedRows scratch(n, block_k({w_qkv, w_o}));
  const float* xp = x.data<float>();
  float* sp = summed.data<float>();
  float* op = out.data<float>();
  // The pools are written in place: the op owns no state, the cache does (no autograd).
  float* kp = const_cast<float*>(k_pool.data<float>());
  float* vp = const_cast<float*>(v_pool.data<float>());
  const float* cos_t = rope_cos.data<float>();
  const float* sin_t = rope_sin.data<float>();

#pragma omp parallel num_threads(std::max(1, num_threads))
  {
    add_normalize_rows(xp, dp, bp, norm_w, n, d, eps, sp, normed.data());
    product(w_qkv, normed.data(), n, qkv.data(), scratch);

    // bias, q/k norms, RoPE, and this step's K/V into the pools
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      float* row = qkv.data() + r * nqkv;
      if (qkv_b != nullptr)
        for (int64_t i = 0; i < nqkv; ++i) row[i] += qkv_b[i];
      const float* cos = cos_t + pos[r] * half;
      const float* sin = sin_t + pos[r] * half;
      for (int64_t head = 0; head < h + kvh; ++head) {
        if (qk_w != nullptr) rms_norm_head(row + head * hd, qk_w + head * hd, hd, eps);
        rope_head(row + head * hd, cos, sin, hd);
      }
      const int64_t p = pos[r];
      const int64_t slot = tab[seq[r] * width + p / bs] * bs + p % bs;
      for (int64_t kv = 0; kv < kvh; ++kv) {
        std::copy_n(row + nq + kv * hd, hd, kp + (kv * slots + slot) * hd);
        std::copy_n(row + nq + (kvh + kv) * hd, hd, vp + (kv * slots + slot) * hd);
      }
    }

    // attention: one task per (row, KV head), its g query heads together
    std::vector<float> scores(g * max_ctx);
    std::vector<int64_t> rows_of(max_ctx);
#pragma omp for schedule(static, 1)
    for (int64_t task = 0; task < n * kvh; ++task) {
      const int64_t r = task / kvh, kv = task % kvh;
      const int64_t ctx = pos[r] + 1;
      const int64_t* table = tab + seq[r] * width;
      for (int64_t j = 0; j < ctx; ++j)
        rows_of[j] = (kv * slots + table[j / bs] * bs + j % bs) * hd;
      const float* q = qkv.data() + r * nqkv + kv * g * hd;
      for (int64_t i = 0; i < g; ++i)
        score_row(q + i * hd, kp, rows_of.data(), ctx, hd, scores.data() + i * ctx);
      for (int64_t i = 0; i < g; ++i) {
        float* s = scores.data() + i * ctx;
        float top = s[0];
        for (int64_t j = 1; j < ctx; ++j) top = std::max(top, s[j]);
        const float inv = 1.0f / exp_shifted(s, ctx, top);
        for (int64_t j = 0; j < ctx; ++j) s[j] *= inv;
      }
      float* o = attn.data() + r * nq + kv * g * hd;
      for (int64_t i = 0; i < g; ++i)
        weighted_sum(scores.data() + i * ctx, rows_of.data(), ctx, vp, hd, o + i * hd);
    }

    product(w_o, attn.data(), n, op, scratch);
  }
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
  check_f32_cpu(x, "mlp_block x");
  PD_CHECK(x.shape().size() == 2, "mlp_block: x is [N, d]");
  const int64_t n = x.shape()[0], d = x.shape()[1], f = intermediate;
  PD_CHECK(f > 0, "mlp_block: the intermediate size is positive");
  const float* dp = optional_f32(delta, n * d, "mlp_block delta");
  const float* bp = optional_f32(delta_bias, d, "mlp_block delta_bias");
  const Weight w_gu = weight_of(gate_up_panels, gate_up_type, d, 2 * f, "mlp_block gate_up");
  const Weight w_down = weight_of(down_panels, down_type, f, d, "mlp_block down");
  const float* norm_w = optional_f32(norm_weight, d, "mlp_block norm_weight");
  PD_CHECK(!w_gu.blocks() || norm_w != nullptr,
           "mlp_block: block weights need the norm weight (it is not folded into them)");
  const float* gu_b = optional_f32(gate_up_bias, 2 * f, "mlp_block gate_up_bias");

  auto out = paddle::empty({n, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto summed = paddle::empty({n, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  std::vector<float> normed(n * d), gate_up(n * 2 * f), act(n * f);
  spectrio::QuantizedRows scratch(n, block_k({w_gu, w_down}));
  float* sp = summed.data<float>();

#pragma omp parallel num_threads(std::max(1, num_threads))
  {
    add_normalize_rows(x.data<float>(), dp, bp, norm_w, n, d, eps, sp, normed.data());
    product(w_gu, normed.data(), n, gate_up.data(), scratch);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      const float* gate = gate_up.data() + r * 2 * f;
      swiglu_row(gate, gate + f, gu_b, f, act.data() + r * f);
    }
    product(w_down, act.data(), n, out.data<float>(), scratch);
  }
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
