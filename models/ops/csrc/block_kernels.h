// Products with GGUF's quantized block weights, as the file stores them (issue 58):
// out[m, n] = x[m, :] . W[n, :] for a weight of N rows of K elements, each row a run of
// blocks of one ggml type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 32 elements a block; the
// K-quants Q4_K, Q5_K, Q6_K: super-blocks of 256, eight groups of 32 with their own
// scales), read in place (models/ops/gguf_blocks.py holds the layouts and a NumPy reference
// of this product).
//
// The activations are quantized first, row by row, in groups of 32: a scale
// dx = max|x| / 127 and q = round(x * 127 / max|x|) in int8, with dx times the group's
// sum of q's. Every weight group of 32 decodes to 32 unsigned bytes u, a scale per half-group
// (elements 0-15 and 16-31) and an offset per half-group, w = d * u + m (Q8_0: signed
// bytes, no offset; Q6_K: signed values q - 32 with a scale per half, no offset), so one
// group's share of the dot product is
//   dx * (d * sum(u * q) + m * sum(q)),
// the integer sum taken 32 products at a time by the CPU's byte multiply-add.
//
// Two layouts of the weight: the blocks as stored (every type; block_tile below), and,
// for the tiled types (all but Q5_K), the tiled layout the serving matrices hold
// (repack_tiles, further below: 8 output columns side by side, so a vector holds 8 outputs
// and no horizontal sums are needed; every weight group is unpacked once for all rows of a
// call).
//
// Invariant (batch invariance): a row's outputs are computed by one thread each, from
// that row's own quantized activations, summing the groups in order (stored blocks: into
// 8 float lanes that are added in a fixed tree at the end; tiles: into one float per
// output, the chain written out above tile_rows); the AVX2 path and the plain C++ one
// give the same bits. A row's product does not depend on the other rows, the row count or
// the thread count.
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
enum BlockType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14
};

constexpr int64_t kGroup = 32;  // elements of an activation group and of a weight group
constexpr int64_t kSuper = 256;  // elements of a K-quant super-block (8 groups)

// Bytes of one block of `type`, or 0 for a type the kernels lack.
constexpr int64_t block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

constexpr bool is_k_quant(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

// Elements of one block of `type`: K is a multiple of it.
constexpr int64_t block_elements(int type) { return is_k_quant(type) ? kSuper : kGroup; }

// Bytes of a weight row of `k_dim` elements (a multiple of block_elements(type)).
constexpr int64_t row_bytes_of(int type, int64_t k_dim) {
  return k_dim / block_elements(type) * block_bytes(type);
}

// f(std::integral_constant<int, type>{}) for a type with a kernel (nothing for another):
// the one switch from a runtime type to the kernels' template parameter.
template <typename F>
inline void dispatch_type(int type, F&& f) {
  switch (type) {
    case kQ8_0: return f(std::integral_constant<int, kQ8_0>{});
    case kQ4_0: return f(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int, kQ5_1>{});
    case kQ4_K: return f(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int, kQ6_K>{});
    default: return;
  }
}

// Whether a type's decoded values are signed (no offset): the products then take the
// sign trick of the byte multiply-add.
constexpr bool signed_values(int type) { return type == kQ8_0 || type == kQ6_K; }

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

// One weight group decoded: u[32] (unsigned, or signed for Q8_0 and Q6_K), the scale and
// offset of each half (the offsets of a group's halves are always equal).
struct Group {
  alignas(32) uint8_t u[kGroup];
  float d[2];
  float m[2];
};

// A K-quant's 6-bit scale and minimum of group j (0-7) from the 12 packed bytes: groups
// 0-3 keep them in the low 6 bits of bytes j and j + 4, groups 4-7 in the nibbles of byte
// j + 4 with their top 2 bits in the spare high bits of bytes j - 4 and j.
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Group g of a weight row: its block, and for the K-quants its index in the super-block.
inline const uint8_t* group_block(int type, const uint8_t* row, int64_t g, int& j) {
  if (is_k_quant(type)) {
    j = static_cast<int>(g & 7);
    return row + (g >> 3) * block_bytes(type);
  }
  j = 0;
  return row + g * block_bytes(type);
}

// Q4_K / Q5_K group j's scale d * sc and offset -dmin * min (both exact in float32: a
// float16 times a 6-bit integer).
inline void k_group_scales(const uint8_t* b, int j, float& d, float& m) {
  int sc, mn;
  k_scale_min(b + 4, j, sc, mn);
  d = f16_at(b) * static_cast<float>(sc);
  m = -(f16_at(b + 2) * static_cast<float>(mn));
}

// Group j of block b decoded in plain C++ (the reference of the SIMD decoder, and the path
// without AVX2); j is 0 but for the K-quants.
inline void decode_block_group(int type, const uint8_t* b, int j, Group& g) {
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
    case kQ4_K:
    case kQ5_K: {
      // d, dmin, 12 bytes of scales; Q5_K: 32 bytes of fifth bits (bit j of byte i: element
      // i of group j); 128 bytes of nibbles, groups 2c and 2c + 1 the low and high nibbles
      // of bytes 32c .. 32c + 31
      k_group_scales(b, j, g.d[0], g.m[0]);
      g.d[1] = g.d[0];
      g.m[1] = g.m[0];
      const bool five = type == kQ5_K;
      const uint8_t* qs = b + (five ? 48 : 16) + 32 * (j >> 1);
      const int shift = 4 * (j & 1);
      for (int i = 0; i < 32; ++i) {
        const int high = five ? ((b[16 + i] >> j) & 1) << 4 : 0;
        g.u[i] = static_cast<uint8_t>(((qs[i] >> shift) & 0x0f) | high);
      }
      return;
    }
    case kQ6_K: {
      // 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16), d. Group
      // j = 4h + t: low nibbles of bytes 64h + 32(t & 1) + i shifted by 4(t >> 1), high
      // bits of byte 32h + i shifted by 2t; the value is q - 32.
      const int h = j >> 2, t = j & 3;
      const uint8_t* ql = b + 64 * h + 32 * (t & 1);
      const uint8_t* qh = b + 128 + 32 * h;
      const float d = f16_at(b + 208);
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      g.d[0] = d * static_cast<float>(sc[2 * j]);
      g.d[1] = d * static_cast<float>(sc[2 * j + 1]);
      g.m[0] = g.m[1] = 0.0f;
      for (int i = 0; i < 32; ++i) {
        const int q = ((ql[i] >> (4 * (t >> 1))) & 0x0f) | (((qh[i] >> (2 * t)) & 3) << 4);
        g.u[i] = static_cast<uint8_t>(static_cast<int8_t>(q - 32));
      }
      return;
    }
    default:
      return;
  }
}

// Group g of a weight row, decoded (decode_block_group).
inline void decode_group(int type, const uint8_t* row, int64_t g, Group& out) {
  int j;
  const uint8_t* b = group_block(type, row, g, j);
  decode_block_group(type, b, j, out);
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

// 32 bytes at p.
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Each byte's bits [lo, lo + width) moved to bits [to, to + width), the rest cleared (the
// 16-bit shifts carry bits across bytes only where the mask clears them).
inline __m256i bits_to(__m256i v, int lo, int to, int width) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << width) - 1) << to));
  const __m256i moved = lo >= to ? _mm256_srl_epi16(v, _mm_cvtsi32_si128(lo - to))
                                 : _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - lo));
  return _mm256_and_si256(moved, mask);
}

// Group g of a weight row decoded in registers: its 32 values (decode_block_group's u),
// the scale of each half and their offset.
template <int T>
inline __m256i decode_simd(const uint8_t* row, int64_t g, float d[2], float& m) {
  int j;
  const uint8_t* b = group_block(T, row, g, j);
  if constexpr (T == kQ4_K || T == kQ5_K) {
    k_group_scales(b, j, d[0], m);
    d[1] = d[0];
    const bool five = T == kQ5_K;
    const __m256i lo = bits_to(load32(b + (five ? 48 : 16) + 32 * (j >> 1)), 4 * (j & 1), 0, 4);
    if constexpr (T == kQ4_K) return lo;
    else return _mm256_or_si256(lo, bits_to(load32(b + 16), j, 4, 1));
  } else if constexpr (T == kQ6_K) {
    const int h = j >> 2, t = j & 3;
    const float dd = f16_at(b + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    d[0] = dd * static_cast<float>(sc[2 * j]);
    d[1] = dd * static_cast<float>(sc[2 * j + 1]);
    m = 0.0f;
    const __m256i lo = bits_to(load32(b + 64 * h + 32 * (t & 1)), 4 * (t >> 1), 0, 4);
    const __m256i hi = bits_to(load32(b + 128 + 32 * h), 2 * t, 4, 2);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
  } else {
    d[0] = d[1] = f16_at(b);
    if constexpr (T == kQ8_0) {
      m = 0.0f;
      return load32(b + 2);
    } else if constexpr (T == kQ4_0) {
      m = -8.0f * d[0];
      return nibbles(b + 2);
    } else if constexpr (T == kQ4_1) {
      m = f16_at(b + 2);
      return nibbles(b + 4);
    } else if constexpr (T == kQ5_0) {
      m = -16.0f * d[0];
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      return _mm256_or_si256(nibbles(b + 6), high_bits(qh));
    } else {
      static_assert(T == kQ5_1, "a block type without a decoder");
      m = f16_at(b + 2);
      uint32_t qh;
      std::memcpy(&qh, b + 4, 4);
      return _mm256_or_si256(nibbles(b + 8), high_bits(qh));
    }
  }
}

// The scales of a group's halves in the lanes of its dots (lanes 0-3: elements 0-15).
template <int T>
inline __m256 half_scales(const float d[2]) {
  if constexpr (T == kQ6_K) return _mm256_set_m128(_mm_set1_ps(d[1]), _mm_set1_ps(d[0]));
  else return _mm256_set1_ps(d[0]);
}

// sum over each 32-bit lane's 4 elements of w * q (w unsigned, or signed for Q8_0, Q6_K)
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
  constexpr bool kSigned = signed_values(T);
  constexpr bool kOffset = !kSigned;  // every offset type's halves share their offset
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
    float d[NC][2], m[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) wv[c] = decode_simd<T>(w + c * row_bytes, g, d[c], m[c]);
    __m256 dv[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) dv[c] = half_scales<T>(d[c]);
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
        for (int c = 0; c < NC; ++c) offv[c] = _mm_fmadd_ps(_mm_set1_ps(m[c]), f, offv[c]);
      } else {
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c)
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r)
            offs[c][r] = std::fma(m[c], sdx[g * rows + r], offs[c][r]);
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
      decode_group(T, w + c * row_bytes, g, wg);
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
  const int64_t row_bytes = row_bytes_of(T, k_dim);
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
  dispatch_type(type, [&](auto t) {
    block_matmul_typed<decltype(t)::value>(w, n, k_dim, dx, sdx, q, rows, out);
  });
}


// ---------------------------------------------------------------------------------------
// The tiled layout (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): the weight rows regrouped at load
// (repack_tiles; models/ops/gguf_blocks.py's tile_blocks is its definition) into tiles of
// kTile = 8 output columns, [ceil(N / 8), K / 32, 8 * block bytes] uint8, the last tile's
// missing columns zero (a zero scale: their outputs are 0 and dropped). Per tile and group,
// the 8 columns' fields lie side by side, so that one vector holds a field of all 8:
//   d[8] (float16)  [m[8] (float16): Q4_1, Q5_1]  [h[32]: Q5_0, Q5_1]  quants
// * quants, 8 bits (Q8_0): 8 chunks of 32 bytes; byte 4c + e of chunk s is element
//   4s + e of column c (one 256-bit load: 4 consecutive elements of each column);
// * quants, 4 bits: 4 words of 32 bytes; byte 4c + e of word r is the stored byte
//   4r + e of column c's block, whose low nibble is element 4r + e (chunk r) and high
//   nibble element 16 + 4r + e (chunk r + 4): chunk s is word s & 3 masked or shifted;
// * h (5-bit types): byte 4c + e has bit s set where element 4s + e of column c has its
//   fifth bit.
// The stored bytes per group are the blocks' own (the memory floor counts them).
//
// The product over it, per output (row x, column c): for each group g in order (the
// chain referred to above),
//   acc = fma(float(dot_g), d_g * dx_g, acc), off = fma(m_g, sdx_g, off)
// with dot_g the exact integer sum of the group's 32 products u * q, then out = acc + off
// (Q8_0: no offset, out = acc). Q4_0 / Q5_0's offset is m = -8 d / -16 d. The AVX2 path
// holds the 8 columns of a tile in the lanes of one vector per row (no horizontal sums);
// the plain C++ path makes the same chain per output. Whatever the row count, the rows'
// grouping into register chunks or the thread count, every output takes this chain: a
// row's product does not depend on the other rows of the call.

constexpr int64_t kTile = 8;  // output columns of a tile

// Whether `type` has the tiled layout (Q5_K keeps its blocks as stored).
constexpr bool tiled_type(int type) {
  return type == kQ8_0 || type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1 ||
         type == kQ4_K || type == kQ6_K;
}

// Bytes of one group of a tile: 8 blocks' worth (the 32-element types).
constexpr int64_t tile_group_bytes(int type) { return kTile * block_bytes(type); }

// The K-quants' tiles (Q4_K, Q6_K) hold whole super-blocks of 8 columns, their fields
// side by side (ktile_* below): Q4_K keeps its 6-bit scales and minimums one per byte
// (64 + 64 bytes for the 96 packed ones, so 1,184 bytes for 8 blocks of 144), Q6_K the
// same 1,680 bytes as its 8 blocks.
constexpr int64_t kK4Dmin = 16, kK4Sc = 32, kK4Mn = 96, kK4Qs = 160, kK4Bytes = 1184;
constexpr int64_t kK6Sc = 16, kK6Ql = 144, kK6Qh = 1168, kK6Bytes = 1680;

// Bytes of one unit of a tile: a group (the 32-element types) or a super-block.
constexpr int64_t tile_unit_bytes(int type) {
  return type == kQ4_K ? kK4Bytes : type == kQ6_K ? kK6Bytes : tile_group_bytes(type);
}

constexpr bool has_offset_field(int type) { return type == kQ4_1 || type == kQ5_1; }
constexpr bool has_high_bits(int type) { return type == kQ5_0 || type == kQ5_1; }

// Byte offsets, within a tile's group, of the high bits and of the quants.
constexpr int64_t tile_high_at(int type) { return has_offset_field(type) ? 32 : 16; }
constexpr int64_t tile_quants_at(int type) {
  return tile_high_at(type) + (has_high_bits(type) ? 32 : 0);
}

// Byte offsets within a stored block: its offset field, its fifth bits, its quants.
constexpr int64_t block_high_at(int type) { return has_offset_field(type) ? 4 : 2; }
constexpr int64_t block_quants_at(int type) {
  return block_high_at(type) + (has_high_bits(type) ? 4 : 0);
}

// Stored block b of a 32-element type into column c of its tile group `o` (the layout
// above).
inline void repack_group_block(int type, const uint8_t* b, int64_t c, uint8_t* o) {
  std::memcpy(o + 2 * c, b, 2);
  if (has_offset_field(type)) std::memcpy(o + 16 + 2 * c, b + 2, 2);
  uint8_t* quants = o + tile_quants_at(type);
  const uint8_t* qs = b + block_quants_at(type);
  if (type == kQ8_0) {
    for (int s = 0; s < 8; ++s) std::memcpy(quants + 32 * s + 4 * c, qs + 4 * s, 4);
  } else {
    for (int r = 0; r < 4; ++r) std::memcpy(quants + 32 * r + 4 * c, qs + 4 * r, 4);
  }
  if (has_high_bits(type)) {
    uint32_t qh;
    std::memcpy(&qh, b + block_high_at(type), 4);
    uint8_t* h = o + tile_high_at(type) + 4 * c;
    for (int e = 0; e < 4; ++e) {
      uint8_t v = 0;
      for (int s = 0; s < 8; ++s) v |= static_cast<uint8_t>(((qh >> (4 * s + e)) & 1u) << s);
      h[e] = v;
    }
  }
}

// Stored super-block b of a K-quant into column c of its tile's super-block `o`:
// * Q4_K: d[8], dmin[8] (float16); sc[8 groups][8 columns] and mn[8][8], the 6-bit scale
//   and minimum of each group one per byte; then 4 runs of 8 words of 32 bytes: byte
//   4c + e of word r of run p is the stored byte 32p + 4r + e of column c, whose low
//   nibble is element 4r + e of group 2p and high nibble that of group 2p + 1.
// * Q6_K: d[8] (float16); sc[16 half-groups][8 columns] (int8); 4 runs of 8 words of 32
//   bytes of low nibbles, as Q4_K's from the stored ql (run p: ql bytes 32p ..; its low
//   nibbles are group 4(p >> 1) + (p & 1), its high ones that group + 2); then per group
//   2 words of 32 bytes of high bits: bits 2s, 2s + 1 of byte 4c + e of word w are the 2
//   high bits of element 4(4w + s) + e of column c.
inline void repack_super_block(int type, const uint8_t* b, int64_t c, uint8_t* o) {
  if (type == kQ4_K) {
    std::memcpy(o + 2 * c, b, 2);
    std::memcpy(o + kK4Dmin + 2 * c, b + 2, 2);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      k_scale_min(b + 4, j, sc, mn);
      o[kK4Sc + 8 * j + c] = static_cast<uint8_t>(sc);
      o[kK4Mn + 8 * j + c] = static_cast<uint8_t>(mn);
    }
    for (int p = 0; p < 4; ++p)
      for (int r = 0; r < 8; ++r)
        std::memcpy(o + kK4Qs + 256 * p + 32 * r + 4 * c, b + 16 + 32 * p + 4 * r, 4);
    return;
  }
  // Q6_K: ql[128], qh[64], sc[16], d
  std::memcpy(o + 2 * c, b + 208, 2);
  for (int h = 0; h < 16; ++h) o[kK6Sc + 8 * h + c] = b[192 + h];
  for (int p = 0; p < 4; ++p)
    for (int r = 0; r < 8; ++r)
      std::memcpy(o + kK6Ql + 256 * p + 32 * r + 4 * c, b + 32 * p + 4 * r, 4);
  for (int j = 0; j < 8; ++j) {
    const int h = j >> 2, t = j & 3;  // group j = 4h + t: bits 2t of qh[32h + i]
    for (int w = 0; w < 2; ++w)
      for (int e = 0; e < 4; ++e) {
        uint8_t v = 0;
        for (int s4 = 0; s4 < 4; ++s4) {
          const int i = 4 * (4 * w + s4) + e;
          v |= static_cast<uint8_t>(((b[128 + 32 * h + i] >> (2 * t)) & 3) << (2 * s4));
        }
        o[kK6Qh + 64 * j + 32 * w + 4 * c + e] = v;
      }
  }
}

// Tile t of the tiled layout from `n` stored rows of `row_bytes`, each of `units` blocks
// (groups of 32, or a K-quant's super-blocks): `dst` receives units * tile_unit_bytes(type)
// bytes, the missing columns of a last tile zero.
inline void repack_tile(int type, const uint8_t* rows, int64_t row_bytes, int64_t n,
                        int64_t units, int64_t t, uint8_t* dst) {
  const int64_t bb = block_bytes(type), ub = tile_unit_bytes(type);
  std::memset(dst, 0, static_cast<size_t>(units * ub));
  const int64_t cols = std::min(kTile, n - t * kTile);
  for (int64_t c = 0; c < cols; ++c) {
    const uint8_t* row = rows + (t * kTile + c) * row_bytes;
    for (int64_t u = 0; u < units; ++u) {
      if (is_k_quant(type))
        repack_super_block(type, row + u * bb, c, dst + u * ub);
      else
        repack_group_block(type, row + u * bb, c, dst + u * ub);
    }
  }
}

// Element i (0-31) of group j of column c in a K-quant tile's super-block `o`: Q4_K's
// unsigned value, Q6_K's signed q - 32.
inline int32_t ktile_value(int type, const uint8_t* o, int c, int j, int i) {
  const int s = i / 4, e = i % 4;
  if (type == kQ4_K) return (o[kK4Qs + 256 * (j >> 1) + 32 * s + 4 * c + e] >> (4 * (j & 1))) & 15;
  const int h = j >> 2, t = j & 3, p = 2 * h + (t & 1);
  const int low = (o[kK6Ql + 256 * p + 32 * s + 4 * c + e] >> (4 * (t >> 1))) & 15;
  const int high = (o[kK6Qh + 64 * j + 32 * (s >> 2) + 4 * c + e] >> (2 * (s & 3))) & 3;
  return (low | (high << 4)) - 32;
}

// Group j's scale of column c (Q6_K: of half `half`) and its offset (Q4_K; 0 for Q6_K),
// both exact in float32.
inline float ktile_scale(int type, const uint8_t* o, int c, int j, int half) {
  if (type == kQ4_K) return f16_at(o + 2 * c) * static_cast<float>(o[kK4Sc + 8 * j + c]);
  return f16_at(o + 2 * c) *
         static_cast<float>(static_cast<int8_t>(o[kK6Sc + 8 * (2 * j + half) + c]));
}
inline float ktile_offset(int type, const uint8_t* o, int c, int j) {
  if (type != kQ4_K) return 0.0f;
  return -(f16_at(o + kK4Dmin + 2 * c) * static_cast<float>(o[kK4Mn + 8 * j + c]));
}

// Element i (0-31) of column c in a tile's group `o`, as the product takes it: unsigned
// (or signed for Q8_0).
inline int32_t tile_value(int type, const uint8_t* o, int c, int i) {
  const int s = i / 4, e = i % 4;
  const uint8_t* quants = o + tile_quants_at(type);
  if (type == kQ8_0) return static_cast<int8_t>(quants[32 * s + 4 * c + e]);
  const uint8_t byte = quants[32 * (s & 3) + 4 * c + e];
  int32_t u = s < 4 ? (byte & 0x0f) : (byte >> 4);
  if (has_high_bits(type)) u |= ((o[tile_high_at(type) + 4 * c + e] >> s) & 1) << 4;
  return u;
}

// The scale of column c in a tile's group, and its offset.
inline float tile_scale(const uint8_t* o, int c) { return f16_at(o + 2 * c); }
inline float tile_offset(int type, const uint8_t* o, int c) {
  if (has_offset_field(type)) return f16_at(o + 16 + 2 * c);
  if (type == kQ4_0) return -8.0f * tile_scale(o, c);
  if (type == kQ5_0) return -16.0f * tile_scale(o, c);
  return 0.0f;
}

constexpr int64_t kTileRowBlock = 16;  // rows whose accumulators a tile keeps at once

#ifdef SPECTRIO_AVX2
// Chunk s (0-7) of a tile's group: 4 consecutive elements of each of the 8 columns.
template <int T>
inline __m256i tile_chunk(const uint8_t* o, int s) {
  const uint8_t* quants = o + tile_quants_at(T);
  if constexpr (T == kQ8_0) {
    return load32(quants + 32 * s);
  } else {
    const __m256i word = load32(quants + 32 * (s & 3));
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256i u = s < 4 ? _mm256_and_si256(word, low4)
                      : _mm256_and_si256(_mm256_srli_epi16(word, 4), low4);
    if constexpr (has_high_bits(T)) u = _mm256_or_si256(u, bits_to(load32(o + tile_high_at(T)), s, 4, 1));
    return u;
  }
}

// One group of a tile for `rows` rows (MR of them where MR > 0: the accumulators can then
// stay in registers), its weights unpacked once into registers: each row's 8 columns'
// dots, exact in int32, then acc[r] = fma(dots, d * dx, acc[r]) and off[r] = fma(m, sdx,
// off[r]). `q` and `dx` are row 0's at this group (rows at strides of k_dim and groups),
// `sdx` row 0's factor (the rows' at a stride of 1).
template <int T, int MR>
inline void tile_group(const uint8_t* o, const int8_t* q, int64_t k_dim, const float* dx,
                       int64_t groups, const float* sdx, int64_t rows, __m256* acc,
                       __m256* off) {
  if constexpr (MR > 0) rows = MR;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i wv[8];
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
    wv[s] = tile_chunk<T>(o, s);
    if constexpr (T == kQ8_0) wv[s] = _mm256_sign_epi8(wv[s], wv[s]);  // |w|
  }
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  __m256 m = _mm256_setzero_ps();
  if constexpr (has_offset_field(T))
    m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
  else if constexpr (T != kQ8_0)
    m = _mm256_mul_ps(_mm256_set1_ps(T == kQ4_0 ? -8.0f : -16.0f), d);
  const uint8_t* signs = o + tile_quants_at(T);  // Q8_0: w, whose signs q takes
#pragma GCC unroll 4
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* qr = q + r * k_dim;
    auto bcast = [&](int s) {
      int32_t word;
      std::memcpy(&word, qr + 4 * s, 4);
      return _mm256_set1_epi32(word);
    };
    __m256i dots;
    if constexpr (T == kQ8_0) {
      // the sign trick: |w| * (q with w's sign); |w| <= 128 and |q| <= 127 keep each pair
      // of products within int16, so every chunk is widened to int32 before the next
      dots = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m256i qs = _mm256_sign_epi8(bcast(s), load32(signs + 32 * s));
        dots = _mm256_add_epi32(dots, _mm256_madd_epi16(_mm256_maddubs_epi16(wv[s], qs), ones));
      }
    } else {
      // unsigned values u <= 15 (31): a pair of products is at most 3810 (7874), so the
      // int16 sums of 8 (4) chunks stay exact before they are widened
      constexpr int kPerWiden = has_high_bits(T) ? 4 : 8;
      __m256i pairs = _mm256_maddubs_epi16(wv[0], bcast(0));
#pragma GCC unroll 8
      for (int s = 1; s < kPerWiden; ++s)
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wv[s], bcast(s)));
      dots = _mm256_madd_epi16(pairs, ones);
      if constexpr (kPerWiden == 4) {
        pairs = _mm256_maddubs_epi16(wv[4], bcast(4));
#pragma GCC unroll 8
        for (int s = 5; s < 8; ++s)
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wv[s], bcast(s)));
        dots = _mm256_add_epi32(dots, _mm256_madd_epi16(pairs, ones));
      }
    }
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots),
                             _mm256_mul_ps(d, _mm256_set1_ps(dx[r * groups])), acc[r]);
    if constexpr (T != kQ8_0) off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sdx[r]), off[r]);
  }
}
#endif

#ifdef SPECTRIO_AVX2
// One super-block of a K-quant tile for `rows` rows (MR of them where MR > 0), group by
// group in order, each group's weights unpacked once into registers. Q4_K as the tiles
// above: acc = fma(float(dot), d_j * dx, acc), off = fma(m_j, sdx, off). Q6_K, signed
// values with a scale per half-group: acc = fma(float(dot_lo), d_lo * dx, acc), then the
// same with the high half. `q`, `dx` and `sdx` are row 0's at the super-block's first
// group (rows at strides of k_dim, groups and 1; sdx's groups at a stride of `stride`,
// the call's row count).
template <int T, int MR>
inline void ktile_super(const uint8_t* o, const int8_t* q, int64_t k_dim, const float* dx,
                        int64_t groups, const float* sdx, int64_t stride, int64_t rows,
                        __m256* acc, __m256* off) {
  if constexpr (MR > 0) rows = MR;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  auto bytes8 = [&](int64_t at) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + at)); };
  for (int j = 0; j < 8; ++j) {
    const int8_t* qj = q + j * kGroup;
    auto bcast = [&](int64_t r, int s) {
      int32_t word;
      std::memcpy(&word, qj + r * k_dim + 4 * s, 4);
      return _mm256_set1_epi32(word);
    };
    __m256i wv[8];
    if constexpr (T == kQ4_K) {
      const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(kK4Sc + 8 * j))));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + kK4Dmin)));
      const __m256 m = _mm256_xor_ps(  // -(dmin * mn), exact
          _mm256_set1_ps(-0.0f),
          _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(kK4Mn + 8 * j)))));
      const uint8_t* run = o + kK4Qs + 256 * (j >> 1);
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) wv[s] = bits_to(load32(run + 32 * s), 4 * (j & 1), 0, 4);
#pragma GCC unroll 4
      for (int64_t r = 0; r < rows; ++r) {
        // u <= 15: a pair of products is at most 3810, so 8 chunks stay exact in int16
        __m256i pairs = _mm256_maddubs_epi16(wv[0], bcast(r, 0));
#pragma GCC unroll 8
        for (int s = 1; s < 8; ++s) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wv[s], bcast(r, s)));
        const __m256i dots = _mm256_madd_epi16(pairs, ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots),
                                 _mm256_mul_ps(scale, _mm256_set1_ps(dx[r * groups + j])), acc[r]);
        off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sdx[j * stride + r]), off[r]);
      }
    } else {  // Q6_K
      const int h = j >> 2, t = j & 3;
      const __m256 d_lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(kK6Sc + 8 * (2 * j)))));
      const __m256 d_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(kK6Sc + 8 * (2 * j + 1)))));
      const uint8_t* run = o + kK6Ql + 256 * (2 * h + (t & 1));
      const uint8_t* high = o + kK6Qh + 64 * j;
      __m256i av[8];
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m256i u = _mm256_or_si256(bits_to(load32(run + 32 * s), 4 * (t >> 1), 0, 4),
                                          bits_to(load32(high + 32 * (s >> 2)), 2 * (s & 3), 4, 2));
        wv[s] = _mm256_sub_epi8(u, _mm256_set1_epi8(32));  // signed, |v| <= 32
        av[s] = _mm256_sign_epi8(wv[s], wv[s]);
      }
#pragma GCC unroll 4
      for (int64_t r = 0; r < rows; ++r) {
        // the sign trick; |v| <= 32 and |q| <= 127: 4 chunks' pairs stay exact in int16
        __m256i lo = _mm256_maddubs_epi16(av[0], _mm256_sign_epi8(bcast(r, 0), wv[0]));
        __m256i hi = _mm256_maddubs_epi16(av[4], _mm256_sign_epi8(bcast(r, 4), wv[4]));
#pragma GCC unroll 3
        for (int s = 1; s < 4; ++s) {
          lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(av[s], _mm256_sign_epi8(bcast(r, s), wv[s])));
          hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(av[s + 4], _mm256_sign_epi8(bcast(r, s + 4), wv[s + 4])));
        }
        const __m256 x = _mm256_set1_ps(dx[r * groups + j]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(lo, ones)), _mm256_mul_ps(d_lo, x), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(hi, ones)), _mm256_mul_ps(d_hi, x), acc[r]);
      }
    }
  }
}

// One unit of a tile (a group; a K-quant's super-block) for `rows` rows: `u` indexes the
// units, `q`, `dx`, `sdx` are row 0's at the tile's first group, sdx's groups at a stride
// of `stride` (the call's row count).
template <int T, int MR>
inline void tile_unit(const uint8_t* tile, int64_t u, const int8_t* q, int64_t k_dim,
                      const float* dx, int64_t groups, const float* sdx, int64_t stride,
                      int64_t rows, __m256* acc, __m256* off) {
  if constexpr (is_k_quant(T)) {
    ktile_super<T, MR>(tile + u * tile_unit_bytes(T), q + u * kSuper, k_dim, dx + 8 * u, groups,
                       sdx + 8 * u * stride, stride, rows, acc, off);
  } else {
    tile_group<T, MR>(tile + u * tile_group_bytes(T), q + u * kGroup, k_dim, dx + u, groups,
                      sdx + u * stride, rows, acc, off);
  }
}
#endif

#ifdef SPECTRIO_AVX2
// The accumulators' sums into out[r * n + c] for the tile's `cols` real columns.
template <int T>
inline void store_tile_row(__m256 acc, __m256 off, float* dst, int64_t cols) {
  const __m256 v = T == kQ8_0 || T == kQ6_K ? acc : _mm256_add_ps(acc, off);
  if (cols == kTile) {
    _mm256_storeu_ps(dst, v);
  } else {
    alignas(32) float lanes[kTile];
    _mm256_store_ps(lanes, v);
    std::copy_n(lanes, cols, dst);
  }
}

// MR rows (1-4, a decode step's) with their accumulators in registers.
template <int T, int MR>
void tile_few_rows(const uint8_t* tile, int64_t groups, const float* dx, const float* sdx,
                   const int8_t* q, int64_t k_dim, int64_t rows, float* out, int64_t n,
                   int64_t cols) {
  __m256 acc[MR], off[MR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  const int64_t units = groups * kGroup / block_elements(T);
  for (int64_t u = 0; u < units; ++u)
    tile_unit<T, MR>(tile, u, q, k_dim, dx, groups, sdx, rows, MR, acc, off);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) store_tile_row<T>(acc[r], off[r], out + r * n, cols);
}
#endif

// A K-quant tile times `rows` rows in plain C++: the chain of ktile_super per output.
inline void ktile_rows_plain(int type, const uint8_t* tile, int64_t groups, const float* dx,
                             const float* sdx, const int8_t* q, int64_t k_dim, int64_t rows,
                             float* out, int64_t n, int64_t cols) {
  const int64_t ub = tile_unit_bytes(type);
  for (int64_t m = 0; m < rows; ++m) {
    const int8_t* qm = q + m * k_dim;
    for (int c = 0; c < cols; ++c) {
      float acc = 0.0f, off = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* o = tile + (g / 8) * ub;
        const int j = static_cast<int>(g % 8);
        int32_t dot[2] = {0, 0};
        for (int i = 0; i < kGroup; ++i)
          dot[i / 16] += ktile_value(type, o, c, j, i) * qm[g * kGroup + i];
        const float x = dx[m * groups + g];
        if (type == kQ6_K) {
          acc = std::fma(static_cast<float>(dot[0]), ktile_scale(type, o, c, j, 0) * x, acc);
          acc = std::fma(static_cast<float>(dot[1]), ktile_scale(type, o, c, j, 1) * x, acc);
        } else {
          acc = std::fma(static_cast<float>(dot[0] + dot[1]), ktile_scale(type, o, c, j, 0) * x, acc);
          off = std::fma(ktile_offset(type, o, c, j), sdx[g * rows + m], off);
        }
      }
      out[m * n + c] = type == kQ6_K ? acc : acc + off;
    }
  }
}

// One tile (8 columns, `cols` of them real) times `rows` rows: out[r * n + c].
template <int T>
void tile_rows(const uint8_t* tile, int64_t groups, const float* dx, const float* sdx,
               const int8_t* q, int64_t k_dim, int64_t rows, float* out, int64_t n,
               int64_t cols) {
#ifdef SPECTRIO_AVX2
  switch (rows) {
    case 1: return tile_few_rows<T, 1>(tile, groups, dx, sdx, q, k_dim, rows, out, n, cols);
    case 2: return tile_few_rows<T, 2>(tile, groups, dx, sdx, q, k_dim, rows, out, n, cols);
    case 3: return tile_few_rows<T, 3>(tile, groups, dx, sdx, q, k_dim, rows, out, n, cols);
    case 4: return tile_few_rows<T, 4>(tile, groups, dx, sdx, q, k_dim, rows, out, n, cols);
    default: break;
  }
  // more rows: blocks of them whose accumulators live in memory, every group's weights
  // unpacked once for the whole block
  for (int64_t m0 = 0; m0 < rows; m0 += kTileRowBlock) {
    const int64_t mb = std::min(kTileRowBlock, rows - m0);
    __m256 acc[kTileRowBlock], off[kTileRowBlock];
    for (int64_t r = 0; r < mb; ++r) acc[r] = off[r] = _mm256_setzero_ps();
    const int64_t units = groups * kGroup / block_elements(T);
    for (int64_t u = 0; u < units; ++u)
      tile_unit<T, 0>(tile, u, q + m0 * k_dim, k_dim, dx + m0 * groups, groups, sdx + m0, rows,
                      mb, acc, off);
    for (int64_t r = 0; r < mb; ++r) store_tile_row<T>(acc[r], off[r], out + (m0 + r) * n, cols);
  }
#else
  if constexpr (is_k_quant(T)) {
    ktile_rows_plain(T, tile, groups, dx, sdx, q, k_dim, rows, out, n, cols);
    return;
  }
  constexpr int64_t tb = tile_group_bytes(T);
  for (int64_t m = 0; m < rows; ++m) {
    const int8_t* qm = q + m * k_dim;
    for (int c = 0; c < cols; ++c) {
      float acc = 0.0f, off = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* o = tile + g * tb;
        int32_t dot = 0;
        for (int i = 0; i < kGroup; ++i) dot += tile_value(T, o, c, i) * qm[g * kGroup + i];
        const float scale = tile_scale(o, c) * dx[m * groups + g];
        acc = std::fma(static_cast<float>(dot), scale, acc);
        if (T != kQ8_0) off = std::fma(tile_offset(T, o, c), sdx[g * rows + m], off);
      }
      out[m * n + c] = T == kQ8_0 ? acc : acc + off;
    }
  }
#endif
}

template <int T>
void tiled_matmul_typed(const uint8_t* w, int64_t n, int64_t k_dim, const float* dx,
                        const float* sdx, const int8_t* q, int64_t rows, float* out) {
  const int64_t groups = k_dim / kGroup;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t tile_bytes = k_dim / block_elements(T) * tile_unit_bytes(T);
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tiles; ++t)
    tile_rows<T>(w + t * tile_bytes, groups, dx, sdx, q, k_dim, rows, out + t * kTile, n,
                 std::min(kTile, n - t * kTile));
}

// The product over the tiled layout inside an OpenMP parallel region (an orphaned `omp
// for`: the team shares the tiles), as block_matmul_team.
inline void tiled_matmul_team(int type, const uint8_t* w, int64_t n, int64_t k_dim,
                              const float* dx, const float* sdx, const int8_t* q, int64_t rows,
                              float* out) {
  dispatch_type(type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (tiled_type(T)) tiled_matmul_typed<T>(w, n, k_dim, dx, sdx, q, rows, out);
  });
}

// Whether a uint8 tensor of `shape` holds the tiled layout of an [n, k_dim] weight of
// `type` ([ceil(n / 8), k_dim / block elements, tile_unit_bytes]); stored blocks are 1- or
// 2-D.
inline bool tiled_shape(const std::vector<int64_t>& shape, int type, int64_t n, int64_t k_dim) {
  return tiled_type(type) && shape.size() == 3 && shape[0] == (n + kTile - 1) / kTile &&
         shape[1] == k_dim / block_elements(type) && shape[2] == tile_unit_bytes(type);
}

// Weight rows dequantized to float32, each value rounded as gguf-py's NumPy
// dequantization rounds it (gguf.quants), so a row equals the float32 copy of the file bit
// for bit: d * (u - 8) and d * (u - 16) for Q4_0 / Q5_0 (the integer first), d * u + m
// with two roundings for the types with an offset (never one fused multiply-add:
// contraction is off for these functions), d * q for the signed types.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
inline float dequantized(int type, int32_t u, float d, float m) {
  if (signed_values(type)) return d * static_cast<float>(u);
  if (type == kQ4_0) return d * static_cast<float>(u - 8);
  if (type == kQ5_0) return d * static_cast<float>(u - 16);
  const float p = d * static_cast<float>(u);
  return p + m;
}

// Row `row` (K elements) of blocks as stored.
inline void dequantize_row(int type, const uint8_t* row, int64_t k_dim, float* out) {
  Group grp;
  for (int64_t g = 0; g < k_dim / kGroup; ++g) {
    decode_group(type, row, g, grp);
    for (int i = 0; i < kGroup; ++i) {
      const int32_t u = signed_values(type) ? static_cast<int8_t>(grp.u[i]) : grp.u[i];
      out[g * kGroup + i] = dequantized(type, u, grp.d[i / 16], grp.m[i / 16]);
    }
  }
}
#pragma GCC pop_options

// Row `row` of a tiled weight (K elements; the tiled layout above), as dequantize_row.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
inline void dequantize_tiled_row(int type, const uint8_t* tiles, int64_t k_dim, int64_t row,
                                 float* out) {
  const int64_t groups = k_dim / kGroup, tb = tile_group_bytes(type);
  const int c = static_cast<int>(row % kTile);
  if (is_k_quant(type)) {
    const int64_t ub = tile_unit_bytes(type);
    const uint8_t* tile = tiles + (row / kTile) * (groups / 8) * ub;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* o = tile + (g / 8) * ub;
      const int j = static_cast<int>(g % 8);
      const float m = ktile_offset(type, o, c, j);
      for (int i = 0; i < kGroup; ++i)
        out[g * kGroup + i] =
            dequantized(type, ktile_value(type, o, c, j, i), ktile_scale(type, o, c, j, i / 16), m);
    }
    return;
  }
  const uint8_t* tile = tiles + (row / kTile) * groups * tb;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* o = tile + g * tb;
    const float d = tile_scale(o, c);
    const float m = has_offset_field(type) ? f16_at(o + 16 + 2 * c) : 0.0f;
    for (int i = 0; i < kGroup; ++i) out[g * kGroup + i] = dequantized(type, tile_value(type, o, c, i), d, m);
  }
}
#pragma GCC pop_options

}  // namespace spectrio
