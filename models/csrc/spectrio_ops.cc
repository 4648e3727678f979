// spectrio's own CPU kernels for the serving forward (float32), loaded by
// spectrio/models/native_ops.py, which compiles this file once per machine and falls back
// to plain Paddle ops wherever it cannot.
//
// * spectrio_add_rms_norm: (rmsnorm(x + delta) * weight, x + delta) in one op. In Python
//   a residual add and an RMSNorm are six Paddle ops, each dispatched for a few
//   microseconds of work at decode sizes; a forward runs two per layer.
// * spectrio_head_logits: out[r, v] = dot(x[r], w[v]) for a few rows against a row-major
//   [V, d] head far larger than the cache. MKL's SGEMM runs such a product well below the
//   memory bound; here each head row is read once and used for every input row while it
//   sits in L1.
//
// Every output element is computed by one thread over a fixed order, so results do not
// depend on the thread count. Threads come from OpenMP with an explicit count, from the
// runtime Paddle ships (native_ops.py links it), so the head shares the pool MKL uses.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paddle/extension.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECTRIO_AVX2 1
#endif

namespace {

void check_f32_cpu(const paddle::Tensor& t, const char* what) {
  PD_CHECK(t.is_cpu(), what, ": a CPU tensor is expected");
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, what, ": float32 is expected");
}

}  // namespace

std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& x, const paddle::Tensor& delta,
                                       const paddle::Tensor& weight, float eps) {
  check_f32_cpu(x, "add_rms_norm x");
  check_f32_cpu(delta, "add_rms_norm delta");
  check_f32_cpu(weight, "add_rms_norm weight");
  const int64_t d = x.shape().back();
  PD_CHECK(delta.shape() == x.shape(), "add_rms_norm: x and delta differ in shape");
  PD_CHECK(weight.numel() == d, "add_rms_norm: weight is [d]");
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  auto normed = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto summed = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  const float* dp = delta.data<float>();
  const float* wp = weight.data<float>();
  float* np_ = normed.data<float>();
  float* sp = summed.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * d;
    const float* dr = dp + r * d;
    float* sr = sp + r * d;
    float sq = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
      const float s = xr[i] + dr[i];
      sr[i] = s;
      sq += s * s;
    }
    const float scale = 1.0f / std::sqrt(sq / static_cast<float>(d) + eps);
    float* nr = np_ + r * d;
    for (int64_t i = 0; i < d; ++i) nr[i] = sr[i] * scale * wp[i];
  }
  return {normed, summed};
}

std::vector<std::vector<int64_t>> AddRmsNormShape(const std::vector<int64_t>& x,
                                                  const std::vector<int64_t>&,
                                                  const std::vector<int64_t>&) {
  return {x, x};
}

std::vector<paddle::DataType> AddRmsNormDtype(const paddle::DataType& x, const paddle::DataType&,
                                              const paddle::DataType&) {
  return {x, x};
}

PD_BUILD_OP(spectrio_add_rms_norm)
    .Inputs({"X", "Delta", "Weight"})
    .Outputs({"Normed", "Summed"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(AddRmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(AddRmsNormShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AddRmsNormDtype));

namespace {

constexpr int64_t kHeadRows = 4;  // head rows that share each load of an input row

#ifdef SPECTRIO_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

// out[r, v0 .. v0 + n) for every r; n <= kHeadRows.
void head_block(const float* x, const float* w, float* out, int64_t rows, int64_t d,
                int64_t vocab, int64_t v0, int64_t n) {
  const float* wr[kHeadRows];
  for (int64_t j = 0; j < kHeadRows; ++j) wr[j] = w + (v0 + (j < n ? j : 0)) * d;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float acc[kHeadRows];
    int64_t k = 0;
#ifdef SPECTRIO_AVX2
    __m256 a[kHeadRows];
    for (int64_t j = 0; j < kHeadRows; ++j) a[j] = _mm256_setzero_ps();
    for (; k + 8 <= d; k += 8) {
      const __m256 xv = _mm256_loadu_ps(xr + k);
      for (int64_t j = 0; j < kHeadRows; ++j)
        a[j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wr[j] + k), a[j]);
    }
    for (int64_t j = 0; j < kHeadRows; ++j) acc[j] = hsum(a[j]);
#else
    for (int64_t j = 0; j < kHeadRows; ++j) acc[j] = 0.0f;
#endif
    for (; k < d; ++k)
      for (int64_t j = 0; j < kHeadRows; ++j) acc[j] += xr[k] * wr[j][k];
    for (int64_t j = 0; j < n; ++j) out[r * vocab + v0 + j] = acc[j];
  }
}

}  // namespace

std::vector<paddle::Tensor> HeadLogits(const paddle::Tensor& x, const paddle::Tensor& w,
                                       int num_threads) {
  check_f32_cpu(x, "head_logits x");
  check_f32_cpu(w, "head_logits w");
  PD_CHECK(x.shape().size() == 2 && w.shape().size() == 2, "head_logits: 2-D operands");
  const int64_t rows = x.shape()[0], d = x.shape()[1], vocab = w.shape()[0];
  PD_CHECK(w.shape()[1] == d, "head_logits: x is [rows, d], w is [V, d]");
  auto out = paddle::empty({rows, vocab}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* op = out.data<float>();
  const int64_t blocks = (vocab + kHeadRows - 1) / kHeadRows;
#pragma omp parallel for schedule(static) num_threads(std::max(1, num_threads))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t v0 = b * kHeadRows;
    head_block(xp, wp, op, rows, d, vocab, v0, std::min<int64_t>(kHeadRows, vocab - v0));
  }
  return {out};
}

std::vector<std::vector<int64_t>> HeadLogitsShape(const std::vector<int64_t>& x,
                                                  const std::vector<int64_t>& w) {
  return {{x[0], w[0]}};
}

std::vector<paddle::DataType> HeadLogitsDtype(const paddle::DataType& x, const paddle::DataType&) {
  return {x};
}

PD_BUILD_OP(spectrio_head_logits)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .Attrs({"num_threads: int"})
    .SetKernelFn(PD_KERNEL(HeadLogits))
    .SetInferShapeFn(PD_INFER_SHAPE(HeadLogitsShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(HeadLogitsDtype));
