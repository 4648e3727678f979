// spectrio's own CPU kernels for the serving forward (float32), loaded by
// spectrio/models/ops/native_ops.py, which compiles this file once per machine and falls back
// to plain Paddle ops wherever it cannot.
//
// * spectrio_add_rms_norm: (rmsnorm(x + delta) * weight, x + delta) in one op, or with an
//   empty delta (rmsnorm(x) * weight, x). In Python a residual add and an RMSNorm are six
//   Paddle ops, each dispatched for a few microseconds of work at decode sizes, and more
//   after a forward's weights have streamed through the caches; a forward runs one after
//   its layers, a draft substep three.
// * spectrio_panel_matmul: out = x @ w for a [K, N] weight packed into 16-column panels
//   ([ceil(N / 16), K, 16], each panel contiguous; pack_panels in models/ops/serving_matrix.py).
//   MKL's SGEMM leaves its GEMV path at two rows, and the layers' projections then cost
//   two to three times one row's; streaming each contiguous panel once through a
//   register tile of up to 6 rows x 16 columns keeps a few rows at one row's memory
//   traffic, and the same tile is a full-rate GEMM micro-kernel for many rows. The LM
//   head is packed the same way. Panels may also be float16 (the MTP layer's and the
//   draft head's, whose products only pick drafts): each weight is widened to float32 in
//   registers, so the product reads half the bytes and sums in float32 as before.
// * spectrio_block_matmul: out = x @ W.T for a weight kept in one of GGUF's quantized
//   block types (block_kernels.h), read where it lies (a memory-mapped file), or regrouped
//   once into the tiled layout of 8 output columns (spectrio_repack_tiles), which the
//   kernels read at the memory's rate.
// * spectrio_repack_tiles: stored blocks into that tiled layout (at load).
// * spectrio_embed_rows: rows of a block weight (stored or tiled) in float32, as gguf-py
//   dequantizes them: a step's embedding rows, from a quantized file's embedding (or the
//   tied head's tiles, which hold the same blocks).
// * spectrio_read_sum: the sum of a float32 tensor, each byte read once with wide loads by
//   `num_threads` threads. It is the read-bandwidth probe of models/ops/memory_floor.py: a
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

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "paddle/extension.h"
#include "checks.h"
#include "panel_kernels.h"
#include "block_kernels.h"

using spectrio::check_f32_cpu;

std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& x, const paddle::Tensor& delta,
                                       const paddle::Tensor& weight, float eps) {
  check_f32_cpu(x, "add_rms_norm x");
  check_f32_cpu(delta, "add_rms_norm delta");
  check_f32_cpu(weight, "add_rms_norm weight");
  const int64_t d = x.shape().back();
  const bool no_delta = delta.numel() == 0;  // norm alone: "summed" is x
  PD_CHECK(no_delta || delta.shape() == x.shape(), "add_rms_norm: x and delta differ in shape");
  PD_CHECK(weight.numel() == d, "add_rms_norm: weight is [d]");
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  auto normed = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto summed = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  const float* dp = no_delta ? nullptr : delta.data<float>();
  const float* wp = weight.data<float>();
  float* np_ = normed.data<float>();
  float* sp = summed.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * d;
    const float* dr = no_delta ? nullptr : dp + r * d;
    float* sr = sp + r * d;
    float sq = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
      const float s = no_delta ? xr[i] : xr[i] + dr[i];
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

using spectrio::kPanel;

namespace {

// Asks the kernel to back the whole 2 MiB pages inside [p, p + bytes) with huge pages,
// before they are first written (Linux; a no-op elsewhere or where transparent huge pages
// are off). Panels are streamed front to back at every forward: with 4 KiB pages each
// page is a TLB miss and a restart of the hardware prefetcher.
void prefer_huge_pages(void* p, size_t bytes) {
#ifdef __linux__
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace
using spectrio::panel_matmul;

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
  prefer_huge_pages(op, count * k_dim * kPanel * sizeof(float));
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

std::vector<paddle::Tensor> BlockMatmul(const paddle::Tensor& x, const paddle::Tensor& w, int type,
                                        int64_t n, int num_threads) {
  check_f32_cpu(x, "block_matmul x");
  PD_CHECK(w.is_cpu() && w.dtype() == paddle::DataType::UINT8,
           "block_matmul w: a CPU uint8 tensor of blocks is expected");
  const int64_t bb = spectrio::block_bytes(type);
  PD_CHECK(bb > 0, "block_matmul: no kernel for ggml type ", type);
  PD_CHECK(x.shape().size() == 2, "block_matmul: x is 2-D");
  const int64_t rows = x.shape()[0], k_dim = x.shape()[1];
  const int64_t elements = spectrio::block_elements(type);
  PD_CHECK(k_dim % elements == 0, "block_matmul: K must be a multiple of ", elements,
           " for ggml type ", type, ", got ", k_dim);
  const int64_t row_bytes = spectrio::row_bytes_of(type, k_dim);
  // the tiled layout (repack_tiles) is 3-D, with its own sizes; stored blocks are not
  const bool tiled = spectrio::tiled_shape(w.shape(), type, n, k_dim);
  PD_CHECK(n >= 0 && (tiled || (w.shape().size() < 3 && w.numel() == n * row_bytes)),
           "block_matmul: w holds ", w.numel(), " bytes, not ", n, " rows of ", row_bytes,
           " nor their tiles");
  auto out = paddle::empty({rows, n}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  spectrio::QuantizedRows a(rows, k_dim);
  spectrio::quantize_rows(x.data<float>(), rows, k_dim, a.dx.data(), a.sdx.data(), a.q.data());
  const uint8_t* wp = w.data<uint8_t>();
  float* op = out.data<float>();
#pragma omp parallel num_threads(std::max(1, num_threads))
  {
    if (tiled)
      spectrio::tiled_matmul_team(type, wp, n, k_dim, a.dx.data(), a.sdx.data(), a.q.data(), rows,
                                  op);
    else
      spectrio::block_matmul_team(type, wp, n, k_dim, a.dx.data(), a.sdx.data(), a.q.data(), rows,
                                  op);
  }
  return {out};
}

std::vector<std::vector<int64_t>> BlockMatmulShape(const std::vector<int64_t>& x,
                                                   const std::vector<int64_t>&, int, int64_t n) {
  return {{x[0], n}};
}

std::vector<paddle::DataType> BlockMatmulDtype(const paddle::DataType& x, const paddle::DataType&) {
  return {x};
}

PD_BUILD_OP(spectrio_block_matmul)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .Attrs({"type: int", "n: int64_t", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(BlockMatmul))
    .SetInferShapeFn(PD_INFER_SHAPE(BlockMatmulShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(BlockMatmulDtype));

// Stored blocks, `n` rows of K elements of `type` (uint8, n * row bytes), regrouped into
// the tiled layout block_kernels.h describes: [ceil(n / 8), K / 32, 8 * block bytes].
std::vector<paddle::Tensor> RepackTiles(const paddle::Tensor& w, int type, int64_t n,
                                        int64_t k_dim, int num_threads) {
  PD_CHECK(w.is_cpu() && w.dtype() == paddle::DataType::UINT8,
           "repack_tiles w: a CPU uint8 tensor of blocks is expected");
  PD_CHECK(spectrio::tiled_type(type), "repack_tiles: no tiled layout for ggml type ", type);
  const int64_t elements = spectrio::block_elements(type);
  PD_CHECK(n > 0 && k_dim > 0 && k_dim % elements == 0, "repack_tiles: N > 0 and K a positive ",
           "multiple of ", elements, " are expected for ggml type ", type);
  const int64_t row_bytes = spectrio::row_bytes_of(type, k_dim);
  PD_CHECK(w.numel() == n * row_bytes, "repack_tiles: w holds ", w.numel(), " bytes, not ", n,
           " rows of ", row_bytes);
  const int64_t groups = k_dim / elements, tiles = (n + spectrio::kTile - 1) / spectrio::kTile;
  const int64_t tb = spectrio::tile_unit_bytes(type);  // groups: a K-quant's super-blocks
  auto out = paddle::empty({tiles, groups, tb}, paddle::DataType::UINT8, paddle::CPUPlace());
  const uint8_t* src = w.data<uint8_t>();
  uint8_t* dst = out.data<uint8_t>();
  prefer_huge_pages(dst, static_cast<size_t>(tiles * groups * tb));
#pragma omp parallel for schedule(static) num_threads(std::max(1, num_threads))
  for (int64_t t = 0; t < tiles; ++t)
    spectrio::repack_tile(type, src, row_bytes, n, groups, t, dst + t * groups * tb);
  return {out};
}

std::vector<std::vector<int64_t>> RepackTilesShape(const std::vector<int64_t>&, int type,
                                                   int64_t n, int64_t k_dim) {
  return {{(n + spectrio::kTile - 1) / spectrio::kTile, k_dim / spectrio::block_elements(type),
           spectrio::tile_unit_bytes(type)}};
}

std::vector<paddle::DataType> RepackTilesDtype(const paddle::DataType& w) { return {w}; }

PD_BUILD_OP(spectrio_repack_tiles)
    .Inputs({"W"})
    .Outputs({"Tiles"})
    .Attrs({"type: int", "n: int64_t", "k: int64_t", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(RepackTiles))
    .SetInferShapeFn(PD_INFER_SHAPE(RepackTilesShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RepackTilesDtype));

// Rows `ids` of a weight of `n` rows of K elements of GGUF blocks of `type`, held as stored
// ([n, row bytes] uint8) or tiled (spectrio_repack_tiles), in float32 [R, K], equal bit for
// bit to gguf-py's dequantization (block_kernels.h).
std::vector<paddle::Tensor> EmbedRows(const paddle::Tensor& w, const paddle::Tensor& ids,
                                      int type, int64_t n, int64_t k_dim) {
  PD_CHECK(w.is_cpu() && w.dtype() == paddle::DataType::UINT8,
           "embed_rows w: a CPU uint8 tensor of blocks is expected");
  PD_CHECK(spectrio::block_bytes(type) > 0, "embed_rows: no kernel for ggml type ", type);
  PD_CHECK(k_dim > 0 && k_dim % spectrio::block_elements(type) == 0,
           "embed_rows: K must be a positive multiple of ", spectrio::block_elements(type),
           " for ggml type ", type, ", got ", k_dim);
  PD_CHECK(ids.is_cpu() && ids.dtype() == paddle::DataType::INT64 && ids.shape().size() == 1,
           "embed_rows ids: a 1-D CPU int64 tensor is expected");
  const int64_t row_bytes = spectrio::row_bytes_of(type, k_dim);
  const bool tiled = spectrio::tiled_shape(w.shape(), type, n, k_dim);
  PD_CHECK(tiled || (w.shape().size() == 2 && w.shape()[0] == n && w.shape()[1] == row_bytes),
           "embed_rows: w is neither [", n, ", ", row_bytes, "] blocks nor their tiles");
  const int64_t rows = ids.shape()[0];
  const int64_t* id = ids.data<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    PD_CHECK(id[r] >= 0 && id[r] < n, "embed_rows: id ", id[r], " is outside 0..", n - 1);
  auto out = paddle::empty({rows, k_dim}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const uint8_t* src = w.data<uint8_t>();
  float* dst = out.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    if (tiled)
      spectrio::dequantize_tiled_row(type, src, k_dim, id[r], dst + r * k_dim);
    else
      spectrio::dequantize_row(type, src + id[r] * row_bytes, k_dim, dst + r * k_dim);
  }
  return {out};
}

std::vector<std::vector<int64_t>> EmbedRowsShape(const std::vector<int64_t>&,
                                                 const std::vector<int64_t>& ids, int, int64_t,
                                                 int64_t k_dim) {
  return {{ids[0], k_dim}};
}

std::vector<paddle::DataType> EmbedRowsDtype(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(spectrio_embed_rows)
    .Inputs({"W", "Ids"})
    .Outputs({"Out"})
    .Attrs({"type: int", "n: int64_t", "k: int64_t"})
    .SetKernelFn(PD_KERNEL(EmbedRows))
    .SetInferShapeFn(PD_INFER_SHAPE(EmbedRowsShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(EmbedRowsDtype));
