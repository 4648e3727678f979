// spectrio's own CPU kernels for the serving forward (float32), loaded by
// spectrio/models/native_ops.py, which compiles this file once per machine and falls back
// to plain Paddle ops wherever it cannot.
//
// * spectrio_add_rms_norm: (rmsnorm(x + delta) * weight, x + delta) in one op. In Python
//   a residual add and an RMSNorm are six Paddle ops, each dispatched for a few
//   microseconds of work at decode sizes; a forward runs two per layer.
// * spectrio_panel_matmul: out = x @ w for a [K, N] weight packed into 16-column panels
//   ([ceil(N / 16), K, 16], each panel contiguous; pack_panels in models/serving_matrix.py).
//   MKL's SGEMM leaves its GEMV path at two rows, and the layers' projections then cost
//   two to three times one row's; streaming each contiguous panel once through a
//   register tile of up to 6 rows x 16 columns keeps a few rows at one row's memory
//   traffic, and the same tile is a full-rate GEMM micro-kernel for many rows. The LM
//   head is packed the same way. Panels may also be float16 (the MTP layer's and the
//   draft head's, whose products only pick drafts): each weight is widened to float32 in
//   registers, so the product reads half the bytes and sums in float32 as before.
// * spectrio_read_sum: the sum of a float32 tensor, each byte read once with wide loads by
//   `num_threads` threads. It is the read-bandwidth probe of models/memory_floor.py: a
//   forward at few rows is bound by the bytes it reads, and the bandwidth this measures,
//   in the same run as the forward, is the floor that forward is judged by.
//
// Every output element is computed by one thread over a fixed order, so results do not
// depend on the thread count. Threads come from OpenMP with an explicit count, from the
// runtime Paddle ships (native_ops.py links it), so the kernels share the pool MKL uses.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
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

constexpr int64_t kPanel = 16;     // columns per panel
constexpr int64_t kTileRows = 6;   // rows per register tile: 12 accumulators
constexpr int64_t kRowBlock = 96;  // rows whose inputs stay in L2 while every panel passes

// IEEE half -> float, exactly (the scalar path's; F16C does it in registers)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;  // signed zero
  } else {  // subnormal: normalise
    exp = 113u;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float widen(float w) { return w; }
inline float widen(uint16_t w) { return half_to_float(w); }

#ifdef SPECTRIO_AVX2
// The 16 weights of one panel row, as two float32 vectors.
inline void load_row(const float* p, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(p);
  w1 = _mm256_loadu_ps(p + 8);
}
inline void load_row(const uint16_t* p, __m256& w0, __m256& w1) {
  w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

#define SPECTRIO_ROW(r)                                                  \
  if constexpr (MR > r) {                                                \
    const __m256 b = _mm256_broadcast_ss(x + r * k_dim + k);             \
    c##r##0 = _mm256_fmadd_ps(b, w0, c##r##0);                          \
    c##r##1 = _mm256_fmadd_ps(b, w1, c##r##1);                          \
  }
#define SPECTRIO_STORE(r)                                                \
  if constexpr (MR > r) {                                                \
    if (cols == kPanel) {                                                \
      _mm256_storeu_ps(out + r * n, c##r##0);                            \
      _mm256_storeu_ps(out + r * n + 8, c##r##1);                        \
    } else {                                                             \
      alignas(32) float buf[kPanel];                                     \
      _mm256_store_ps(buf, c##r##0);                                     \
      _mm256_store_ps(buf + 8, c##r##1);                                 \
      for (int64_t c = 0; c < cols; ++c) out[r * n + c] = buf[c];        \
    }                                                                    \
  }

// out[0 .. MR) x [0 .. cols) of one panel; the accumulators are named variables so that
// they stay in registers (an array of them was spilled to the stack every iteration).
template <typename W, int MR>
void panel_tile(const float* __restrict x, int64_t k_dim, const W* __restrict panel,
                float* __restrict out, int64_t n, int64_t cols) {
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z;
  __m256 c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  // the panel is read front to back; fetching 512 bytes ahead hides memory latency
  constexpr int64_t kAhead = 512 / sizeof(W);
  for (int64_t k = 0; k < k_dim; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + k * kPanel + kAhead), _MM_HINT_T0);
    __m256 w0, w1;
    load_row(panel + k * kPanel, w0, w1);
    SPECTRIO_ROW(0) SPECTRIO_ROW(1) SPECTRIO_ROW(2) SPECTRIO_ROW(3) SPECTRIO_ROW(4) SPECTRIO_ROW(5)
  }
  SPECTRIO_STORE(0) SPECTRIO_STORE(1) SPECTRIO_STORE(2)
  SPECTRIO_STORE(3) SPECTRIO_STORE(4) SPECTRIO_STORE(5)
}
#undef SPECTRIO_ROW
#undef SPECTRIO_STORE

template <typename W>
void panel_rows(const float* x, int64_t rows, int64_t k_dim, const W* panel, float* out,
                int64_t n, int64_t cols) {
  using TileFn = void (*)(const float*, int64_t, const W*, float*, int64_t, int64_t);
  constexpr TileFn kTiles[kTileRows + 1] = {nullptr,          panel_tile<W, 1>, panel_tile<W, 2>,
                                            panel_tile<W, 3>, panel_tile<W, 4>, panel_tile<W, 5>,
                                            panel_tile<W, 6>};
  for (int64_t m = 0; m < rows; m += kTileRows) {
    const int64_t mr = std::min(kTileRows, rows - m);
    kTiles[mr](x + m * k_dim, k_dim, panel, out + m * n, n, cols);
  }
}
#else
template <typename W>
void panel_rows(const float* x, int64_t rows, int64_t k_dim, const W* panel, float* out,
                int64_t n, int64_t cols) {
  for (int64_t m = 0; m < rows; ++m) {
    float acc[kPanel] = {};
    for (int64_t k = 0; k < k_dim; ++k)
      for (int64_t c = 0; c < kPanel; ++c)
        acc[c] += x[m * k_dim + k] * widen(panel[k * kPanel + c]);
    for (int64_t c = 0; c < cols; ++c) out[m * n + c] = acc[c];
  }
}
#endif

template <typename W>
void panel_matmul(const float* xp, int64_t rows, int64_t k_dim, const W* pp, int64_t count,
                  float* op, int64_t n, int num_threads) {
#pragma omp parallel num_threads(std::max(1, num_threads))
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, rows - m0);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < count; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      panel_rows(xp + m0 * k_dim, block, k_dim, pp + p * k_dim * kPanel, op + m0 * n + p * kPanel,
                 n, cols);
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> PanelMatmul(const paddle::Tensor& x, const paddle::Tensor& panels,
                                        int64_t n, int num_threads) {
  check_f32_cpu(x, "panel_matmul x");
  PD_CHECK(panels.is_cpu(), "panel_matmul panels: a CPU tensor is expected");
  const bool half = panels.dtype() == paddle::DataType::FLOAT16;
  PD_CHECK(half || panels.dtype() == paddle::DataType::FLOAT32,
           "panel_matmul panels: float32 or float16 is expected");
  PD_CHECK(x.shape().size() == 2 && panels.shape().size() == 3, "panel_matmul: x is 2-D, "
           "panels 3-D");
  const int64_t rows = x.shape()[0], k_dim = x.shape()[1], count = panels.shape()[0];
  PD_CHECK(panels.shape()[1] == k_dim && panels.shape()[2] == kPanel,
           "panel_matmul: panels are [ceil(N / 16), K, 16] for x [M, K]");
  PD_CHECK(n > (count - 1) * kPanel && n <= count * kPanel, "panel_matmul: N does not fit "
           "the panels");
  auto out = paddle::empty({rows, n}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (half) {
    const auto* pp = reinterpret_cast<const uint16_t*>(panels.data<paddle::float16>());
    panel_matmul(x.data<float>(), rows, k_dim, pp, count, out.data<float>(), n, num_threads);
  } else {
    panel_matmul(x.data<float>(), rows, k_dim, panels.data<float>(), count, out.data<float>(), n,
                 num_threads);
  }
  return {out};
}

std::vector<std::vector<int64_t>> PanelMatmulShape(const std::vector<int64_t>& x,
                                                   const std::vector<int64_t>&, int64_t n) {
  return {{x[0], n}};
}

std::vector<paddle::DataType> PanelMatmulDtype(const paddle::DataType& x, const paddle::DataType&) {
  return {x};  // float32 out, whichever the panels' dtype
}

PD_BUILD_OP(spectrio_panel_matmul)
    .Inputs({"X", "Panels"})
    .Outputs({"Out"})
    .Attrs({"n: int64_t", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(PanelMatmul))
    .SetInferShapeFn(PD_INFER_SHAPE(PanelMatmulShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PanelMatmulDtype));

// Packs a weight into the panels spectrio_panel_matmul reads: w [K, N] (or, with
// `rows`, its transpose [N, K], as a tied embedding stores the LM head) into
// [ceil(N / 16), K, 16], the last panel zero-padded. One pass over the weight, so a
// model's serving weights are packed at load in a fraction of what NumPy's copies took.
std::vector<paddle::Tensor> PackPanels(const paddle::Tensor& w, bool rows, int num_threads) {
  check_f32_cpu(w, "pack_panels w");
  PD_CHECK(w.shape().size() == 2, "pack_panels: w is 2-D");
  const int64_t k_dim = rows ? w.shape()[1] : w.shape()[0];
  const int64_t n = rows ? w.shape()[0] : w.shape()[1];
  const int64_t count = (n + kPanel - 1) / kPanel;
  auto out = paddle::empty({count, k_dim, kPanel}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* wp = w.data<float>();
  float* op = out.data<float>();
#pragma omp parallel for schedule(static) num_threads(std::max(1, num_threads))
  for (int64_t p = 0; p < count; ++p) {
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    float* panel = op + p * k_dim * kPanel;
    if (rows) {  // column c of the panel is row p * 16 + c of w
      for (int64_t k = 0; k < k_dim; ++k)
        for (int64_t c = 0; c < kPanel; ++c)
          panel[k * kPanel + c] = c < cols ? wp[(p * kPanel + c) * k_dim + k] : 0.0f;
    } else {
      for (int64_t k = 0; k < k_dim; ++k) {
        const float* src = wp + k * n + p * kPanel;
        for (int64_t c = 0; c < kPanel; ++c) panel[k * kPanel + c] = c < cols ? src[c] : 0.0f;
      }
    }
  }
  return {out};
}

std::vector<std::vector<int64_t>> PackPanelsShape(const std::vector<int64_t>& w, bool rows) {
  const int64_t k_dim = rows ? w[1] : w[0], n = rows ? w[0] : w[1];
  return {{(n + kPanel - 1) / kPanel, k_dim, kPanel}};
}

std::vector<paddle::DataType> PackPanelsDtype(const paddle::DataType& w) { return {w}; }

PD_BUILD_OP(spectrio_pack_panels)
    .Inputs({"W"})
    .Outputs({"Panels"})
    .Attrs({"rows: bool", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(PackPanels))
    .SetInferShapeFn(PD_INFER_SHAPE(PackPanelsShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackPanelsDtype));

// The probe's sum: each thread sums a contiguous share with four independent vector
// accumulators (enough loads in flight to saturate the memory system), then the shares
// are added in thread order.
std::vector<paddle::Tensor> ReadSum(const paddle::Tensor& x, int num_threads) {
  check_f32_cpu(x, "read_sum x");
  const int64_t n = x.numel();
  const float* p = x.data<float>();
  const int threads = std::max(1, num_threads);
  std::vector<double> partial(threads, 0.0);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < threads; ++t) {
    const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
    int64_t i = lo;
    double total = 0.0;
#ifdef SPECTRIO_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; i + 32 <= hi; i += 32) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (float v : lanes) total += v;
#endif
    for (; i < hi; ++i) total += p[i];
    partial[t] = total;
  }
  double sum = 0.0;
  for (double v : partial) sum += v;
  auto out = paddle::empty({1}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  out.data<float>()[0] = static_cast<float>(sum);
  return {out};
}

std::vector<std::vector<int64_t>> ReadSumShape(const std::vector<int64_t>&) { return {{1}}; }

std::vector<paddle::DataType> ReadSumDtype(const paddle::DataType& x) { return {x}; }

PD_BUILD_OP(spectrio_read_sum)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"num_threads: int"})
    .SetKernelFn(PD_KERNEL(ReadSum))
    .SetInferShapeFn(PD_INFER_SHAPE(ReadSumShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ReadSumDtype));
