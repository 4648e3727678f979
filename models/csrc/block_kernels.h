// Products with GGUF's quantized block weights, as the file stores them (issue 58):
// out[m, n] = x[m, :] . W[n, :] for a weight of N rows of K elements, each row a run of
// blocks of one ggml type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 32 elements a block), read in
// place (models/gguf_blocks.py holds the layouts and a NumPy reference of this product).
//
// The activations are quantized first, row by row, in groups of 32: a scale
// dx = max|x| / 127 and q = round(x * 127 / max|x|) in int8, with dx times the group's
// sum of q's. Every weight group of 32 decodes to 32 unsigned bytes u, a scale per half-group
// (elements 0-15 and 16-31) and an offset per half-group, w = d * u + m (Q8_0: signed
// bytes, no offset), so one group's share of the dot product is
//   dx * (d * sum(u * q) + m * sum(q)),
// the integer sum taken 32 products at a time by the CPU's byte multiply-add.
//
// Invariant (batch invariance): a row's outputs are computed by one thread each, from
// that row's own quantized activations, summing the groups in order into 8 float lanes
// that are added in a fixed tree at the end; the AVX2 path and the plain C++ one give the
// same bits. A row's product does not depend on the other rows, the row count or the
// thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "panel_kernels.h"

namespace spectrio {

// ggml's type ids (gguf.GGMLQuantizationType).
enum BlockType : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8 };

constexpr int64_t kGroup = 32;  // elements of an activation group and of a weight group

// Bytes of one block of `type` (32 elements), or 0 for a type the kernels lack.
constexpr int64_t block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    default: return 0;
  }
}

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef SPECTRIO_AVX2
  return _cvtsh_ss(h);  // exact, as half_to_float
#else
  return half_to_float(h);
#endif
}

// One row of K activations (a multiple of 32) quantized per group: dx[g], q[k], and
// sdx[g * stride] = dx[g] * (the sum of the group's 32 q's), the factor of a group's
// offset term (laid out group-major, so a tile reads its rows' factors as one vector).
inline void quantize_row(const float* x, int64_t k_dim, float* dx, float* sdx, int64_t stride,
                         int8_t* q) {
  for (int64_t g = 0; g < k_dim / kGroup; ++g) {
    const float* xs = x + g * kGroup;
    float amax = 0.0f;
    for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xs[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    dx[g] = amax / 127.0f;
    int8_t* qs = q + g * kGroup;
    int32_t sum = 0;
    for (int64_t i = 0; i < kGroup; ++i) {
      qs[i] = static_cast<int8_t>(std::nearbyint(xs[i] * inv));
      sum += qs[i];
    }
    sdx[g * stride] = dx[g] * static_cast<float>(sum);
  }
}

// `rows` rows quantized: dx[m * G + g], sdx[g * rows + m], q[m * K + k]. The `_team` form
// shares the rows among the calling team (an orphaned `omp for`).
inline void quantize_rows(const float* x, int64_t rows, int64_t k_dim, float* dx, float* sdx,
                          int8_t* q) {
  const int64_t groups = k_dim / kGroup;
  for (int64_t m = 0; m < rows; ++m)
    quantize_row(x + m * k_dim, k_dim, dx + m * groups, sdx + m, rows, q + m * k_dim);
}

inline void quantize_rows_team(const float* x, int64_t rows, int64_t k_dim, float* dx,
                               float* sdx, int8_t* q) {
  const int64_t groups = k_dim / kGroup;
#pragma omp for schedule(static)
  for (int64_t m = 0; m < rows; ++m)
    quantize_row(x + m * k_dim, k_dim, dx + m * groups, sdx + m, rows, q + m * k_dim);
}

// Room for the quantized activations (quantize_rows) of `rows` rows of up to `k` values.
struct QuantizedRows {
  std::vector<float> dx, sdx;
  std::vector<int8_t> q;
  QuantizedRows(int64_t rows, int64_t k)
      : dx(static_cast<size_t>(rows * k / kGroup)),
        sdx(static_cast<size_t>(rows * k / kGroup)),
        q(static_cast<size_t>(rows * k)) {}
};

// The block type whose blocks take `bytes` bytes (each type's differ), or 0.
inline int type_of_block_bytes(int64_t bytes) {
  for (int t : {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0})
    if (block_bytes(t) == bytes) return t;
  return 0;
}

// One weight group decoded: u[32] (unsigned, or signed for Q8_0), the scale and offset of
// each half.
struct Group {
  alignas(32) uint8_t u[kGroup];
  float d[2];
  float m[2];
};

// The plain decoder (the reference of the SIMD one, and the path without AVX2).
inline void decode_group(int type, const uint8_t* b, Group& g) {
  switch (type) {
    case kQ8_0:
      g.d[0] = g.d[1] = f16_at(b);
      g.m[0] = g.m[1] = 0.0f;
      std::memcpy(g.u, b + 2, kGroup);
      return;
    case kQ4_0:
    case kQ4_1: {
      const bool off = type == kQ4_1;
      const float d = f16_at(b);
      g.d[0] = g.d[1] = d;
      g.m[0] = g.m[1] = off ? f16_at(b + 2) : -8.0f * d;
      const uint8_t* qs = b + (off ? 4 : 2);
      for (int i = 0; i < 16; ++i) {
        g.u[i] = qs[i] & 0x0f;
        g.u[i + 16] = qs[i] >> 4;
      }
      return;
    }
    case kQ5_0:
    case kQ5_1: {
      const bool off = type == kQ5_1;
      const float d = f16_at(b);
      g.d[0] = g.d[1] = d;
      g.m[0] = g.m[1] = off ? f16_at(b + 2) : -16.0f * d;
      uint32_t qh;
      std::memcpy(&qh, b + (off ? 4 : 2), 4);
      const uint8_t* qs = b + (off ? 8 : 6);
      for (int i = 0; i < 16; ++i) {
        g.u[i] = static_cast<uint8_t>((qs[i] & 0x0f) | (((qh >> i) & 1u) << 4));
        g.u[i + 16] = static_cast<uint8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1u) << 4));
      }
      return;
    }
    default:
      return;
  }
}

// The 8 lanes' sum, in the fixed tree both paths use.
inline float lane_sum(const float* a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

#ifdef SPECTRIO_AVX2
// 32 bytes whose byte j is 0x10 where bit j of `bits` is set, 0 elsewhere.
inline __m256i high_bits(uint32_t bits) {
  // byte j of the result looks at byte j / 8 of `bits`: shuffle within each 128-bit half
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                       3, 3, 3, 3, 3, 3, 3));
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// The 32 nibbles of 16 bytes: low nibbles as elements 0-15, high ones as 16-31.
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
  return _mm256_set_m128i(hi, lo);
}

// A group decoded in registers: its bytes, its scale, and the offset of each half.
template <int T>
inline __m256i decode_simd(const uint8_t* b, float& d, float m[2]) {
  d = f16_at(b);
  if constexpr (T == kQ8_0) {
    m[0] = m[1] = 0.0f;
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else if constexpr (T == kQ4_0) {
    m[0] = m[1] = -8.0f * d;
    return nibbles(b + 2);
  } else if constexpr (T == kQ4_1) {
    m[0] = m[1] = f16_at(b + 2);
    return nibbles(b + 4);
  } else if constexpr (T == kQ5_0) {
    m[0] = m[1] = -16.0f * d;
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    return _mm256_or_si256(nibbles(b + 6), high_bits(qh));
  } else {
    static_assert(T == kQ5_1, "a block type without a decoder");
    m[0] = m[1] = f16_at(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    return _mm256_or_si256(nibbles(b + 8), high_bits(qh));
  }
}

// sum over each 32-bit lane's 4 elements of w * q (w unsigned, or signed for Q8_0)
inline __m256i lane_dots(__m256i w, __m256i q, bool is_signed) {
  if (is_signed) {
    q = _mm256_sign_epi8(q, w);
    w = _mm256_sign_epi8(w, w);
  }
  const __m256i pairs = _mm256_maddubs_epi16(w, q);
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#endif

// A tile of NC output columns (weight rows `w`, `w + row_bytes`, ...) x MR activation rows.
// Its sizes are compile-time constants so that the accumulators stay in registers; every
// output's arithmetic is the same whatever tile computes it: its groups' dots summed in
// order into 8 lanes, and its offset terms, fma(m, sdx, acc), in order beside them.
template <int T, int NC, int MR>
void block_tile(const uint8_t* w, int64_t row_bytes, int64_t groups, const float* dx,
                const float* sdx, int64_t rows, const int8_t* q, int64_t k_dim, float* out,
                int64_t out_stride) {
  constexpr bool kSigned = T == kQ8_0;
  constexpr bool kOffset = T != kQ8_0;  // every offset type's halves share their offset
  constexpr int64_t bb = block_bytes(T);
  alignas(16) float offs[NC][4] = {};
  alignas(32) float lanes[NC][MR][8];
#ifdef SPECTRIO_AVX2
  __m256 acc[NC][MR];
  __m128 offv[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) {
    offv[c] = _mm_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wv[NC];
    float d[NC], m[NC][2];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) wv[c] = decode_simd<T>(w + c * row_bytes + g * bb, d[c], m[c]);
    __m256 dv[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) dv[c] = _mm256_set1_ps(d[c]);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256i qv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * k_dim + g * kGroup));
      const __m256 dxv = _mm256_broadcast_ss(dx + r * groups + g);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        // d * dx in every lane: the same rounding as the scalar product
        const __m256 dots = _mm256_cvtepi32_ps(lane_dots(wv[c], qv, kSigned));
        acc[c][r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(dv[c], dxv), acc[c][r]);
      }
    }
    if constexpr (kOffset) {
      if constexpr (MR == 4) {
        const __m128 f = _mm_loadu_ps(sdx + g * rows);
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) offv[c] = _mm_fmadd_ps(_mm_set1_ps(m[c][0]), f, offv[c]);
      } else {
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c)
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r)
            offs[c][r] = std::fma(m[c][0], sdx[g * rows + r], offs[c][r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) {
    if constexpr (MR == 4) _mm_store_ps(offs[c], offv[c]);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm256_store_ps(lanes[c][r], acc[c][r]);
  }
#else
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r)
      for (int l = 0; l < 8; ++l) lanes[c][r][l] = 0.0f;
  Group wg;
  for (int64_t g = 0; g < groups; ++g) {
    for (int c = 0; c < NC; ++c) {
      decode_group(T, w + c * row_bytes + g * bb, wg);
      for (int r = 0; r < MR; ++r) {
        const int8_t* qs = q + r * k_dim + g * kGroup;
        const float dxr = dx[r * groups + g];
        for (int l = 0; l < 8; ++l) {
          int32_t dot = 0;
          for (int i = 4 * l; i < 4 * l + 4; ++i) {
            const int32_t wi = kSigned ? static_cast<int8_t>(wg.u[i]) : wg.u[i];
            dot += wi * qs[i];
          }
          lanes[c][r][l] = std::fma(static_cast<float>(dot), wg.d[l / 4] * dxr, lanes[c][r][l]);
        }
        if constexpr (kOffset) offs[c][r] = std::fma(wg.m[0], sdx[g * rows + r], offs[c][r]);
      }
    }
  }
#endif
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) out[r * out_stride + c] = lane_sum(lanes[c][r]) + offs[c][r];
}

#ifndef SPECTRIO_TILE_COLS
#define SPECTRIO_TILE_COLS 2
#endif
constexpr int64_t kTileCols = SPECTRIO_TILE_COLS;  // output columns a tile decodes together

template <int T, int NC>
void block_rows(const uint8_t* w, int64_t row_bytes, int64_t groups, const float* dx,
                const float* sdx, const int8_t* q, int64_t k_dim, int64_t rows, float* out,
                int64_t n) {
  int64_t m = 0;
  auto tile = [&](auto mr) {
    constexpr int MR = decltype(mr)::value;
    block_tile<T, NC, MR>(w, row_bytes, groups, dx + m * groups, sdx + m, rows, q + m * k_dim,
                          k_dim, out + m * n, n);
    m += MR;
  };
  while (rows - m >= 4) tile(std::integral_constant<int, 4>{});
  if (rows - m >= 2) tile(std::integral_constant<int, 2>{});
  if (rows - m >= 1) tile(std::integral_constant<int, 1>{});
}

template <int T>
void block_matmul_typed(const uint8_t* w, int64_t n, int64_t k_dim, const float* dx,
                        const float* sdx, const int8_t* q, int64_t rows, float* out) {
  const int64_t groups = k_dim / kGroup;
  const int64_t row_bytes = groups * block_bytes(T);
  const int64_t tiles = (n + kTileCols - 1) / kTileCols;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    int64_t j = t * kTileCols;
    if (j + kTileCols <= n) {
      block_rows<T, kTileCols>(w + j * row_bytes, row_bytes, groups, dx, sdx, q, k_dim, rows,
                               out + j, n);
    } else {
      for (; j < n; ++j)
        block_rows<T, 1>(w + j * row_bytes, row_bytes, groups, dx, sdx, q, k_dim, rows, out + j,
                         n);
    }
  }
}

// The product inside an OpenMP parallel region (an orphaned `omp for`): the team shares
// the weight rows; `dx`, `sdx` and `q` are the quantized activations (quantize_rows).
inline void block_matmul_team(int type, const uint8_t* w, int64_t n, int64_t k_dim,
                              const float* dx, const float* sdx, const int8_t* q, int64_t rows,
                              float* out) {
  switch (type) {
    case kQ8_0: return block_matmul_typed<kQ8_0>(w, n, k_dim, dx, sdx, q, rows, out);
    case kQ4_0: return block_matmul_typed<kQ4_0>(w, n, k_dim, dx, sdx, q, rows, out);
    case kQ4_1: return block_matmul_typed<kQ4_1>(w, n, k_dim, dx, sdx, q, rows, out);
    case kQ5_0: return block_matmul_typed<kQ5_0>(w, n, k_dim, dx, sdx, q, rows, out);
    case kQ5_1: return block_matmul_typed<kQ5_1>(w, n, k_dim, dx, sdx, q, rows, out);
    default: return;
  }
}

}  // namespace spectrio
