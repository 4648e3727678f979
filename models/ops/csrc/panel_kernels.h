// The panel product shared by spectrio's CPU kernels (spectrio_ops.cc, spectrio_layer.cc):
// out = x @ w for a [K, N] weight packed into 16-column panels ([ceil(N / 16), K, 16], each
// panel contiguous; pack_panels in models/ops/serving_matrix.py), float32 or float16 weights.
//
// Invariant (batch invariance): every output element is summed over K in order, in one
// FMA chain, by one thread, whatever the row count, the tile it falls in or the thread
// count. A row's product therefore does not depend on the other rows multiplied with it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// The instruction-set path is the build's (models/ops/cpu_paths.py chooses its flags at run
// time from CPUID): the AVX2 path where these are defined, the AVX-512 panel tile too where
// AVX-512 is, the plain C++ below otherwise.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECTRIO_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPECTRIO_AVX512 1
#endif
#endif

namespace spectrio {

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
#ifndef SPECTRIO_PREFETCH_BYTES
#define SPECTRIO_PREFETCH_BYTES 512
#endif
  constexpr int64_t kAhead = SPECTRIO_PREFETCH_BYTES / sizeof(W);
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

#ifdef SPECTRIO_AVX512
// AVX-512: a panel row is one register, so a tile holds twice the rows. Each output is the
// same chain of fused multiply-adds over K as in the AVX2 tile, so both give the same bits.
inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

#define SPECTRIO_ROW16(r) \
  if constexpr (MR > r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k_dim + k]), w, c##r);
#define SPECTRIO_STORE16(r) \
  if constexpr (MR > r) _mm512_mask_storeu_ps(out + r * n, mask, c##r);

template <typename W, int MR>
void panel_tile16(const float* __restrict x, int64_t k_dim, const W* __restrict panel,
                  float* __restrict out, int64_t n, int64_t cols) {
  const __m512 z = _mm512_setzero_ps();
  __m512 c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z;
  __m512 c6 = z, c7 = z, c8 = z, c9 = z, c10 = z, c11 = z;
  constexpr int64_t kAhead = SPECTRIO_PREFETCH_BYTES / sizeof(W);
  for (int64_t k = 0; k < k_dim; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + k * kPanel + kAhead), _MM_HINT_T0);
    const __m512 w = load_row16(panel + k * kPanel);
    SPECTRIO_ROW16(0) SPECTRIO_ROW16(1) SPECTRIO_ROW16(2) SPECTRIO_ROW16(3)
    SPECTRIO_ROW16(4) SPECTRIO_ROW16(5) SPECTRIO_ROW16(6) SPECTRIO_ROW16(7)
    SPECTRIO_ROW16(8) SPECTRIO_ROW16(9) SPECTRIO_ROW16(10) SPECTRIO_ROW16(11)
  }
  const __mmask16 mask = static_cast<__mmask16>(cols >= kPanel ? 0xffffu : (1u << cols) - 1u);
  SPECTRIO_STORE16(0) SPECTRIO_STORE16(1) SPECTRIO_STORE16(2) SPECTRIO_STORE16(3)
  SPECTRIO_STORE16(4) SPECTRIO_STORE16(5) SPECTRIO_STORE16(6) SPECTRIO_STORE16(7)
  SPECTRIO_STORE16(8) SPECTRIO_STORE16(9) SPECTRIO_STORE16(10) SPECTRIO_STORE16(11)
}
#undef SPECTRIO_ROW16
#undef SPECTRIO_STORE16

constexpr int64_t kTileRows16 = 12;

template <typename W>
void panel_rows(const float* x, int64_t rows, int64_t k_dim, const W* panel, float* out,
                int64_t n, int64_t cols) {
  using TileFn = void (*)(const float*, int64_t, const W*, float*, int64_t, int64_t);
  constexpr TileFn kTiles[kTileRows16 + 1] = {
      nullptr,             panel_tile16<W, 1>, panel_tile16<W, 2>,  panel_tile16<W, 3>,
      panel_tile16<W, 4>,  panel_tile16<W, 5>, panel_tile16<W, 6>,  panel_tile16<W, 7>,
      panel_tile16<W, 8>,  panel_tile16<W, 9>, panel_tile16<W, 10>, panel_tile16<W, 11>,
      panel_tile16<W, 12>};
  for (int64_t m = 0; m < rows; m += kTileRows16) {
    const int64_t mr = std::min(kTileRows16, rows - m);
    kTiles[mr](x + m * k_dim, k_dim, panel, out + m * n, n, cols);
  }
}
#else
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
#endif  // SPECTRIO_AVX512
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


// The product inside an OpenMP parallel region: the team shares the panels (an orphaned
// `omp for`, ending in its barrier), each panel computed whole by one thread.
template <typename W>
void panel_matmul_team(const float* xp, int64_t rows, int64_t k_dim, const W* pp, int64_t count,
                       float* op, int64_t n) {
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

template <typename W>
void panel_matmul(const float* xp, int64_t rows, int64_t k_dim, const W* pp, int64_t count,
                  float* op, int64_t n, int num_threads) {
#pragma omp parallel num_threads(std::max(1, num_threads))
  panel_matmul_team(xp, rows, k_dim, pp, count, op, n);
}

}  // namespace spectrio
