// The AVX2 + FMA GEMM core (x86-64-v3: Haswell, Zen 1-3 and later), for
// float32 and, converted to float32 while packing, bfloat16 (AVX2 has no
// bfloat16 dot). Compiled for baseline x86-64 like the rest of the library:
// every function here carries a target attribute, and gemm_portable.cc's
// GemmBlock calls GemmBlockAvx2 only on a CPU that cpuid says has AVX2 and
// FMA.
//
// The blocking of gemm.cc (GotoBLAS), sized for 16 ymm registers: a 6 x 16
// tile of C is 12 accumulators; one depth step is two 8-wide loads of the
// packed B panel, and per row a broadcast of A(i, k) and two vfmadd231ps.
// B is packed per depth slice into [k][16] float32 panels (bfloat16 widened
// on the way: it is the high half of a float32). A is read in place where
// it is float32 with k contiguous (the forward's and dX's rows), and
// otherwise packed into a float32 panel per 6 rows: bfloat16 rows, the
// weight gradient's transposed rows (i contiguous, one cache line per
// depth), partial panels. Everything is summed in float32 and rounded once
// at the end, as the other cores do.

#include "backends/cpu/cc/gemm.h"

#if defined(__x86_64__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace dropless_cpu {
namespace {

#define DROPLESS_AVX2 __attribute__((target("avx2,fma")))

// Tile: kMr rows x kNr columns (two ymm vectors): 12 accumulators, two B
// vectors and a broadcast in the 16 ymm registers.
constexpr int kMr = 6;
constexpr int kNr = 16;
// Depth slice: a packed B slice of kKc x 96 float32 (a block's columns) is
// 96 KiB, inside a 512 KiB L2; a row panel of A (6 x kKc) stays in L1.
constexpr int64_t kKc = 256;
// A depth up to kKcSingle is not cut (saves the float32 C round trip
// between slices for the forward's common depths, 512).
constexpr int64_t kKcSingle = 512;
// Rows of B that packing asks the cache for ahead of reading them: a row of
// the weights is often its own page, where hardware prefetchers stop.
constexpr int64_t kAhead = 8;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t at = 0; at < bytes; at += 64) {
    _mm_prefetch(c + at, _MM_HINT_T0);
  }
}

// Eight consecutive elements at data[index] as float32.
DROPLESS_AVX2 inline __m256 Load8(Type type, const void* data, int64_t index) {
  if (type == Type::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(data) + index);
  }
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
      static_cast<const uint16_t*>(data) + index));
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// Eight float32 -> bfloat16, rounded to nearest even, NaN kept (quietened).
DROPLESS_AVX2 inline __m128i ToBf16x8(__m256 v) {
  typedef uint32_t Lanes __attribute__((vector_size(32)));
  Lanes bits = (Lanes)_mm256_castps_si256(v);
  RoundToBf16Lanes(&bits);
  const __m256i high = _mm256_srli_epi32((__m256i)bits, 16);
  // packus interleaves per 128-bit lane: keep quadwords 0 and 2.
  const __m256i packed = _mm256_packus_epi32(high, high);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// --- Micro-kernel ------------------------------------------------------------

// c[r * ldc + j] (+)= sum_k a[r * a_rs + k * a_ks] * b[k * kNr + j] for a
// kMr x kNr float32 tile over kc depths; `load` adds to c.
DROPLESS_AVX2 void Micro(int64_t kc, const float* a, int64_t a_rs,
                         int64_t a_ks, const float* b, float* c, int64_t ldc,
                         bool load) {
  __m256 acc[kMr][2];
#pragma GCC unroll 6
  for (int r = 0; r < kMr; ++r) {
    acc[r][0] = load ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();
    acc[r][1] = load ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();
  }
  const float* rows[kMr];
  for (int r = 0; r < kMr; ++r) rows[r] = a + r * a_rs;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(b);
    const __m256 b1 = _mm256_load_ps(b + 8);
    const int64_t at = k * a_ks;
#pragma GCC unroll 6
    for (int r = 0; r < kMr; ++r) {
      const __m256 x = _mm256_broadcast_ss(rows[r] + at);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
    b += kNr;
  }
#pragma GCC unroll 6
  for (int r = 0; r < kMr; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}

// --- Packing -----------------------------------------------------------------

// Transposes 8 rows of 8 float32 in place.
DROPLESS_AVX2 inline void Transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // Per 128-bit lane, s[4h + c] holds column c (and c + 4) of rows 4h..4h+3.
  for (int h = 0; h < 2; ++h) {
    s[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
  }
}

// Packs B's slice (depths [k0, k0 + kc), all n columns) into float32
// panels dst[p][k][kNr], zero past n.
DROPLESS_AVX2 void PackB(Type type, View b, int64_t k0, int64_t kc, int64_t n,
                         float* dst) {
  const int64_t panels = CeilDiv(n, kNr);
  const int64_t width = type == Type::kF32 ? 4 : 2;
  if (b.cols == 1) {
    // The forward's weights [C, N]: row k holds columns j contiguously.
    for (int64_t k = 0; k < kc; ++k) {
      const int64_t row = (k0 + k) * b.rows;
      if (k + kAhead < kc) {
        PrefetchBytes(static_cast<const char*>(b.data) +
                          (row + kAhead * b.rows) * width,
                      n * width);
      }
      for (int64_t p = 0; p < panels; ++p) {
        float* out = dst + p * kc * kNr + k * kNr;
        for (int64_t v = 0; v < kNr; v += 8) {
          const int64_t j = p * kNr + v;
          if (j + 8 <= n) {
            _mm256_store_ps(out + v, Load8(type, b.data, row + j));
          } else {
            for (int64_t w = 0; w < 8; ++w) {
              out[v + w] = j + w < n ? LoadFloat(type, b.data, row + j + w)
                                     : 0.0f;
            }
          }
        }
      }
    }
    return;
  }
  for (int64_t p = 0; p < panels; ++p) {
    float* panel = dst + p * kc * kNr;
    for (int64_t v = 0; v < kNr; v += 8) {
      const int64_t j0 = p * kNr + v;
      int64_t k = 0;
      if (b.rows == 1 && j0 + 8 <= n) {
        // dX's weights [N, C]: column j holds its depths contiguously;
        // transpose 8 x 8 blocks.
        for (; k + 8 <= kc; k += 8) {
          __m256 r[8];
          for (int j = 0; j < 8; ++j) {
            r[j] = Load8(type, b.data, (k0 + k) + (j0 + j) * b.cols);
          }
          Transpose8(r);
          for (int i = 0; i < 8; ++i) {
            _mm256_store_ps(panel + (k + i) * kNr + v, r[i]);
          }
        }
      }
      for (; k < kc; ++k) {
        for (int64_t w = 0; w < 8; ++w) {
          const int64_t j = j0 + w;
          panel[k * kNr + v + w] =
              j < n ? LoadFloat(type, b.data, (k0 + k) * b.rows + j * b.cols)
                    : 0.0f;
        }
      }
    }
  }
}

// Packs A's rows [i0, i0 + rows) at depths [k0, k0 + kc) into a float32
// panel [k][kMr], zero past `rows`; dst has room for 8 - kMr more floats.
// The weight gradient's A (i contiguous, rows [0, m) of the block) gives kMr
// neighbouring values per depth: read as 8 where those stay below m, each
// store's 8 - kMr extra lanes overwritten by the next depth's.
DROPLESS_AVX2 void PackA(Type type, View a, int64_t i0, int64_t rows,
                         int64_t m, int64_t k0, int64_t kc, float* dst) {
  if (a.rows == 1 && rows == kMr && i0 + 8 <= m) {
    for (int64_t k = 0; k < kc; ++k) {
      _mm256_storeu_ps(dst + k * kMr,
                       Load8(type, a.data, i0 + (k0 + k) * a.cols));
    }
    return;
  }
  for (int64_t k = 0; k < kc; ++k) {
    const int64_t at = i0 * a.rows + (k0 + k) * a.cols;
    for (int r = 0; r < kMr; ++r) {
      dst[k * kMr + r] = r < rows ? LoadFloat(type, a.data, at + r * a.rows)
                                  : 0.0f;
    }
  }
}

// Widens bfloat16 rows [i0, i0 + kMr) at depths [k0, k0 + kc), k contiguous
// (a.cols == 1), to float32 rows dst[r][kc].
DROPLESS_AVX2 void WidenRows(View a, int64_t i0, int64_t k0, int64_t kc,
                             float* dst) {
  for (int r = 0; r < kMr; ++r) {
    const int64_t at = (i0 + r) * a.rows + k0;
    int64_t k = 0;
    for (; k + 8 <= kc; k += 8) {
      _mm256_storeu_ps(dst + r * kc + k, Load8(Type::kBF16, a.data, at + k));
    }
    for (; k < kc; ++k) {
      dst[r * kc + k] = LoadFloat(Type::kBF16, a.data, at + k);
    }
  }
}

// --- Output ------------------------------------------------------------------

// Rows [0, m) x [0, n) of the float32 tile c (row stride ldc) into out.
DROPLESS_AVX2 void StoreTile(const float* c, int64_t ldc, int64_t m, int64_t n,
                             Out out) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = c + i * ldc;
    int64_t j = 0;
    if (out.type == Type::kF32) {
      float* to = static_cast<float*>(out.data) + i * out.ld;
      for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(row + j);
        if (out.stream && reinterpret_cast<uintptr_t>(to + j) % 32 == 0) {
          _mm256_stream_ps(to + j, v);
        } else {
          _mm256_storeu_ps(to + j, v);
        }
      }
      for (; j < n; ++j) to[j] = row[j];
    } else {
      uint16_t* to = static_cast<uint16_t*>(out.data) + i * out.ld;
      for (; j + 8 <= n; j += 8) {
        const __m128i v = ToBf16x8(_mm256_loadu_ps(row + j));
        __m128i* at = reinterpret_cast<__m128i*>(to + j);
        if (out.stream && reinterpret_cast<uintptr_t>(at) % 16 == 0) {
          _mm_stream_si128(at, v);
        } else {
          _mm_storeu_si128(at, v);
        }
      }
      for (; j < n; ++j) to[j] = RoundToBf16(row[j]);
    }
  }
}

}  // namespace

DROPLESS_AVX2 void GemmBlockAvx2(Type in, int64_t m, int64_t n, int64_t depth,
                                 View a, View b, Out out, Scratch* scratch) {
  if (m <= 0 || n <= 0) return;
  if (depth <= 0) {
    ZeroBlock(m, n, out);
    return;
  }
  const int64_t slices = depth <= kKcSingle ? 1 : CeilDiv(depth, kKc);
  const int64_t slice = slices == 1 ? depth : kKc;
  const int64_t panels = CeilDiv(n, kNr);
  const int64_t ldc = panels * kNr;
  const int64_t row_panels = CeilDiv(m, kMr);
  float* packed_b = static_cast<float*>(scratch->Get(0, 4 * slice * ldc));
  float* packed_a =
      static_cast<float*>(scratch->Get(1, 4 * (slice * kMr + 8 - kMr)));
  // One tile row when the depth is one slice; the whole block when slices
  // accumulate into it.
  float* acc = static_cast<float*>(
      scratch->Get(2, 4 * (slices == 1 ? kMr : row_panels * kMr) * ldc));
  const bool f32 = in == Type::kF32;

  for (int64_t s = 0; s < slices; ++s) {
    const int64_t k0 = s * slice;
    const int64_t kc = std::min(slice, depth - k0);
    PackB(in, b, k0, kc, n, packed_b);
    for (int64_t ip = 0; ip < row_panels; ++ip) {
      const int64_t i0 = ip * kMr;
      const int64_t rows = std::min<int64_t>(kMr, m - i0);
      // Where the micro-kernel reads A: in place, or a float32 copy.
      const float* a_ptr = packed_a;
      int64_t a_rs = 1, a_ks = kMr;
      if (rows == kMr && a.cols == 1 && f32) {
        a_ptr = static_cast<const float*>(a.data) + i0 * a.rows + k0;
        a_rs = a.rows;
        a_ks = 1;
      } else if (rows == kMr && a.cols == 1) {
        WidenRows(a, i0, k0, kc, packed_a);
        a_rs = kc;
        a_ks = 1;
      } else {
        PackA(in, a, i0, rows, m, k0, kc, packed_a);
      }
      float* c_rows = slices == 1 ? acc : acc + i0 * ldc;
      for (int64_t jp = 0; jp < panels; ++jp) {
        Micro(kc, a_ptr, a_rs, a_ks, packed_b + jp * kc * kNr,
              c_rows + jp * kNr, ldc, s > 0);
      }
      if (slices == 1) {
        const size_t width = out.type == Type::kF32 ? 4 : 2;
        Out tile = out;
        tile.data = static_cast<char*>(out.data) + i0 * out.ld * width;
        StoreTile(acc, ldc, rows, n, tile);
      }
    }
  }
  if (slices > 1) StoreTile(acc, ldc, m, n, out);
  // Non-temporal stores are weakly ordered: make them visible before the
  // block is reported done.
  if (out.stream) _mm_sfence();
}

}  // namespace dropless_cpu

#endif  // defined(__x86_64__)
