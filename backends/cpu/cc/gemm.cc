// The AVX-512 GEMM core: register-blocked micro-kernels over packed panels.
// Compiled for baseline x86-64 like the rest of the library: every function
// that uses AVX-512 carries a target attribute, and gemm_portable.cc's
// GemmBlock calls GemmBlockAvx512 only on a CPU that cpuid says has it.
//
// C (m x n) = A (m x depth) B (depth x n), blocked as in GotoBLAS: the depth
// is cut into slices of kKc (float32) or 2 * kKc (bfloat16); for each slice
// B is packed into column panels of kNr, and each kMr x kNr tile of C is
// one micro-kernel call that keeps the tile in 24 zmm accumulators and
// streams kKc steps of A and B through them.
//
//  * float32: one step is a broadcast of A(i, k) times 16 columns of B
//    (vfmadd231ps); B packed as [k][kNr].
//  * bfloat16: one step is two depths at once: a broadcast of the pair
//    (A(i, k), A(i, k + 1)) as one 32-bit lane times 16 column pairs
//    (vdpbf16ps, which sums both products into float32); B packed as
//    [k / 2][kNr] pairs. An odd depth is padded with a zero.
//
// A is read in place where its layout allows (the forward's rows: k
// contiguous; the weight gradient's float32 rows: i contiguous) and packed
// otherwise (bfloat16 pairs across rows, a partial panel, odd depths).
// Everything is summed in float32 and rounded once at the end.
//
// Without AVX512_BF16 (Skylake-X, Ice Lake: `dot_bf16` false), bfloat16
// takes the float32 path instead: B and A widened to float32 while packing
// (exact: bfloat16 is the high half of a float32), and bfloat16 outputs
// rounded by integer arithmetic; no AVX512_BF16 instruction runs.

#include "backends/cpu/cc/gemm.h"

#if defined(__x86_64__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace dropless_cpu {
namespace {

#define DROPLESS_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

// Tile of the micro-kernels: kMr rows x kNv zmm vectors of 16 columns.
// 8 x 48 keeps 24 accumulators, 3 B vectors and a broadcast in the 32 zmm
// registers; 8 rows waste little on small groups (64 rows per expert at
// E=64), and 48 columns give 3 loads per 24 FMAs.
constexpr int kMr = 8;
constexpr int kNv = 3;
constexpr int kNr = 16 * kNv;
// Depth slice (float32 steps; bfloat16 takes 2 * kKc depths per slice): a
// packed B slice of kKc x 2 * kNr float32 is 192 KiB, inside a 1 MiB L2.
constexpr int64_t kKc = 512;
// A slice of depth up to kKcSingle is not cut (saves the float32 C
// round trip between slices for the common depths of 512 to 768).
constexpr int64_t kKcSingle = 768;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The mask of the first `count` of 16 lanes (none if count <= 0).
inline __mmask16 FirstLanes(int64_t count) {
  return count >= 16 ? 0xFFFF
                     : (count <= 0 ? 0 : (__mmask16)((1u << count) - 1));
}

inline uint16_t Bf16At(const void* data, int64_t index) {
  return static_cast<const uint16_t*>(data)[index];
}

// --- Micro-kernels -----------------------------------------------------------

// One depth step of a tile, per operand type. A and B hold 32-bit `Lane`s:
// LoadB reads 16 of B's lanes, Broadcast one of A's to all 16, and Fma
// adds their products to acc in float32.
struct StepF32 {
  using Lane = float;
  using Vec = __m512;
  DROPLESS_TARGET static Vec LoadB(const float* b) { return _mm512_load_ps(b); }
  DROPLESS_TARGET static Vec Broadcast(float a) { return _mm512_set1_ps(a); }
  DROPLESS_TARGET static __m512 Fma(__m512 acc, Vec a, Vec b) {
    return _mm512_fmadd_ps(a, b, acc);
  }
};

// A lane holds a pair of bfloat16 depths (2k, 2k + 1); vdpbf16ps sums both
// products into float32.
struct StepBf16 {
  using Lane = uint32_t;
  using Vec = __m512bh;
  DROPLESS_TARGET static Vec LoadB(const uint32_t* b) {
    return (__m512bh)_mm512_load_si512(b);
  }
  DROPLESS_TARGET static Vec Broadcast(uint32_t a) {
    return (__m512bh)_mm512_set1_epi32(a);
  }
  DROPLESS_TARGET static __m512 Fma(__m512 acc, Vec a, Vec b) {
    return _mm512_dpbf16_ps(acc, a, b);
  }
};

// c[r * ldc + j] (+)= sum_k a[r * a_rs + k * a_ks] * b[k * kNr + j] for a
// kMr x kNr tile over `steps` lanes of depth (float32 values, or bfloat16
// pairs for StepBf16); `load` adds to c's float32 values instead of
// overwriting.
template <typename Step>
DROPLESS_TARGET void Micro(int64_t steps, const typename Step::Lane* a,
                           int64_t a_rs, int64_t a_ks,
                           const typename Step::Lane* b, float* c,
                           int64_t ldc, bool load) {
  __m512 acc[kMr][kNv];
#pragma GCC unroll 8
  for (int r = 0; r < kMr; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNv; ++v) {
      acc[r][v] = load ? _mm512_loadu_ps(c + r * ldc + 16 * v)
                       : _mm512_setzero_ps();
    }
  }
  const typename Step::Lane* rows[kMr];
  for (int r = 0; r < kMr; ++r) rows[r] = a + r * a_rs;
  for (int64_t k = 0; k < steps; ++k) {
    typename Step::Vec bv[kNv];
#pragma GCC unroll 4
    for (int v = 0; v < kNv; ++v) bv[v] = Step::LoadB(b + 16 * v);
    const int64_t at = k * a_ks;
#pragma GCC unroll 8
    for (int r = 0; r < kMr; ++r) {
      const typename Step::Vec x = Step::Broadcast(rows[r][at]);
#pragma GCC unroll 4
      for (int v = 0; v < kNv; ++v) acc[r][v] = Step::Fma(acc[r][v], x, bv[v]);
    }
    b += kNr;
  }
#pragma GCC unroll 8
  for (int r = 0; r < kMr; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNv; ++v) {
      _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
    }
  }
}

// --- Packing B ---------------------------------------------------------------

// Transposes 16 rows of 16 32-bit lanes in place.
DROPLESS_TARGET inline void Transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // Per 128-bit lane L, r[4g + c] now holds column 4L + c of rows 4g..4g+3.
  for (int g = 0; g < 4; ++g) {
    const __m512d t0 = _mm512_castps_pd(t[4 * g]);
    const __m512d t1 = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * g + 2]);
    const __m512d t3 = _mm512_castps_pd(t[4 * g + 3]);
    r[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  // Gather lane L of rows group 0..3 into column 4L + c.
  for (int c = 0; c < 4; ++c) {
    const __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);
    const __m512 u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 u2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 u3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_f32x4(u0, u2, 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
    t[8 + c] = _mm512_shuffle_f32x4(u1, u3, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Packs the 32-bit lanes src(k, j) = src[k + j * ld] (k contiguous) for
// k < kc, j < n into dst[p][k][kNr] panels, zero past n: a transpose of
// 16 x 16 blocks. Used for float32 weights [N, C] and for bfloat16 weight
// pairs, two depths in one lane.
DROPLESS_TARGET void PackTransposed32(const uint32_t* src, int64_t ld,
                                      int64_t kc, int64_t n, uint32_t* dst) {
  const int64_t panels = CeilDiv(n, kNr);
  for (int64_t p = 0; p < panels; ++p) {
    uint32_t* panel = dst + p * kc * kNr;
    for (int64_t j0 = p * kNr; j0 < (p + 1) * kNr; j0 += 16) {
      const int64_t jn = std::min<int64_t>(16, std::max<int64_t>(0, n - j0));
      const int64_t col = j0 - p * kNr;
      int64_t k0 = 0;
      if (jn == 16) {
        for (; k0 + 16 <= kc; k0 += 16) {
          __m512 r[16];
          for (int j = 0; j < 16; ++j) {
            r[j] = _mm512_loadu_ps(src + (j0 + j) * ld + k0);
          }
          Transpose16(r);
          for (int k = 0; k < 16; ++k) {
            _mm512_store_ps(panel + (k0 + k) * kNr + col, r[k]);
          }
        }
      }
      for (int64_t k = k0; k < kc; ++k) {
        uint32_t* out = panel + k * kNr + col;
        for (int64_t j = 0; j < 16; ++j) {
          out[j] = j < jn ? src[(j0 + j) * ld + k] : 0;
        }
      }
    }
  }
}

// Rows of B that a packing loop asks the cache for ahead of reading them.
// A row of the weights or the gradient is often its own 4 KiB page (N=1024
// float32), and hardware prefetchers stop at page boundaries.
constexpr int64_t kAhead = 8;

// Asks for the cache lines of bytes [0, bytes) at p.
inline void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t at = 0; at < bytes; at += 64) {
    _mm_prefetch(c + at, _MM_HINT_T0);
  }
}

// float32 src(k, j) = src[k * ld + j] (j contiguous) -> dst[p][k][kNr].
DROPLESS_TARGET void PackRowsF32(const float* src, int64_t ld, int64_t kc,
                                 int64_t n, float* dst) {
  const int64_t panels = CeilDiv(n, kNr);
  for (int64_t k = 0; k < kc; ++k) {
    if (k + kAhead < kc) PrefetchBytes(src + (k + kAhead) * ld, 4 * n);
    const float* row = src + k * ld;
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t j0 = p * kNr;
      float* out = dst + p * kc * kNr + k * kNr;
      for (int v = 0; v < kNv; ++v) {
        const __mmask16 mask = FirstLanes(n - j0 - 16 * v);
        _mm512_store_ps(out + 16 * v,
                        _mm512_maskz_loadu_ps(mask, row + j0 + 16 * v));
      }
    }
  }
}

// bfloat16 src(k, j) = src[k * ld + j] (j contiguous) -> pairs
// dst[p][k / 2][kNr], the high half of each lane from row k + 1 (zero past
// depth), zero past n. `width` is kNr for B panels and kMr for A panels.
template <int kWidth>
DROPLESS_TARGET void PackRowPairsBf16(const uint16_t* src, int64_t ld,
                                      int64_t depth, int64_t n,
                                      uint32_t* dst) {
  const int64_t kc2 = CeilDiv(depth, 2);
  const int64_t panels = CeilDiv(n, kWidth);
  for (int64_t k2 = 0; k2 < kc2; ++k2) {
    if (2 * (k2 + kAhead) + 1 < depth) {
      PrefetchBytes(src + 2 * (k2 + kAhead) * ld, 2 * n);
      PrefetchBytes(src + (2 * (k2 + kAhead) + 1) * ld, 2 * n);
    }
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t j0 = p * kWidth;
      const uint16_t* lo = src + 2 * k2 * ld + j0;
      const bool has_hi = 2 * k2 + 1 < depth;
      uint32_t* out = dst + p * kc2 * kWidth + k2 * kWidth;
      for (int v = 0; v < kWidth; v += 16) {
        const int64_t left = n - j0 - v;
        const int64_t take = std::min<int64_t>(std::min(left, 16L), kWidth - v);
        const __mmask16 mask = FirstLanes(take);
        const __m512i a =
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo + v));
        const __m512i b =
            has_hi ? _mm512_cvtepu16_epi32(
                         _mm256_maskz_loadu_epi16(mask, lo + ld + v))
                   : _mm512_setzero_si512();
        const __m512i pair = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
        if (kWidth - v >= 16) {
          _mm512_store_si512(out + v, pair);
        } else {
          _mm512_mask_storeu_epi32(out + v, (__mmask16)((1u << (kWidth - v)) - 1),
                                   pair);
        }
      }
    }
  }
}

// Any layout, one element at a time: src(k, j) at data[k * ks + j * js].
// dst[p][k][w] (float32) or [p][k / 2][w] pairs (bfloat16), zero padded.
void PackGeneric(Type type, const void* data, int64_t ks, int64_t js,
                 int64_t depth, int64_t n, int width, void* dst) {
  const int64_t panels = CeilDiv(n, width);
  if (type == Type::kF32) {
    const float* src = static_cast<const float*>(data);
    float* out = static_cast<float*>(dst);
    for (int64_t p = 0; p < panels; ++p) {
      for (int64_t k = 0; k < depth; ++k) {
        for (int w = 0; w < width; ++w) {
          const int64_t j = p * width + w;
          *out++ = j < n ? src[k * ks + j * js] : 0.0f;
        }
      }
    }
    return;
  }
  uint32_t* out = static_cast<uint32_t*>(dst);
  const int64_t kc2 = CeilDiv(depth, 2);
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t k2 = 0; k2 < kc2; ++k2) {
      for (int w = 0; w < width; ++w) {
        const int64_t j = p * width + w;
        const int64_t k = 2 * k2;
        uint32_t lo = 0, hi = 0;
        if (j < n) {
          lo = Bf16At(data, k * ks + j * js);
          if (k + 1 < depth) hi = Bf16At(data, (k + 1) * ks + j * js);
        }
        *out++ = lo | (hi << 16);
      }
    }
  }
}

// Packs B's slice (depth kc from k0, all n columns) into kNr panels.
void PackB(Type type, View b, int64_t k0, int64_t kc, int64_t n, void* dst) {
  if (type == Type::kF32) {
    const float* src = static_cast<const float*>(b.data) + k0 * b.rows;
    if (b.cols == 1) {
      PackRowsF32(src, b.rows, kc, n, static_cast<float*>(dst));
    } else if (b.rows == 1) {
      PackTransposed32(reinterpret_cast<const uint32_t*>(src), b.cols, kc, n,
                       static_cast<uint32_t*>(dst));
    } else {
      PackGeneric(type, src, b.rows, b.cols, kc, n, kNr, dst);
    }
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(b.data) + k0 * b.rows;
  if (b.cols == 1) {
    PackRowPairsBf16<kNr>(src, b.rows, kc, n, static_cast<uint32_t*>(dst));
  } else if (b.rows == 1 && b.cols % 2 == 0 && kc % 2 == 0 &&
             reinterpret_cast<uintptr_t>(src) % 4 == 0) {
    // Column j holds its depths contiguously: each pair is one 32-bit lane.
    PackTransposed32(reinterpret_cast<const uint32_t*>(src), b.cols / 2,
                     kc / 2, n, static_cast<uint32_t*>(dst));
  } else {
    PackGeneric(type, src, b.rows, b.cols, kc, n, kNr, dst);
  }
}

// --- bfloat16 widened to float32 (no AVX512_BF16) ---------------------------

// Up to 16 bfloat16 at p (lanes of `mask`) as float32, zero elsewhere.
DROPLESS_TARGET inline __m512 WidenBf16(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// B's bfloat16 slice (depths [k0, k0 + kc), n columns) as float32 panels
// dst[p][k][kNr], zero past n: PackRowsF32 and PackTransposed32's layouts.
DROPLESS_TARGET void PackBWidened(View b, int64_t k0, int64_t kc, int64_t n,
                                  float* dst) {
  const uint16_t* src = static_cast<const uint16_t*>(b.data);
  const int64_t panels = CeilDiv(n, kNr);
  if (b.cols == 1) {
    for (int64_t k = 0; k < kc; ++k) {
      const uint16_t* row = src + (k0 + k) * b.rows;
      if (k + kAhead < kc) PrefetchBytes(row + kAhead * b.rows, 2 * n);
      for (int64_t p = 0; p < panels; ++p) {
        float* out = dst + p * kc * kNr + k * kNr;
        for (int v = 0; v < kNv; ++v) {
          const int64_t j = p * kNr + 16 * v;
          _mm512_store_ps(out + 16 * v, WidenBf16(row + j, FirstLanes(n - j)));
        }
      }
    }
    return;
  }
  for (int64_t p = 0; p < panels; ++p) {
    float* panel = dst + p * kc * kNr;
    for (int64_t j0 = p * kNr; j0 < (p + 1) * kNr; j0 += 16) {
      const int64_t col = j0 - p * kNr;
      int64_t k = 0;
      if (b.rows == 1 && j0 + 16 <= n) {
        // Column j holds its depths contiguously: widen 16 x 16 blocks and
        // transpose them.
        for (; k + 16 <= kc; k += 16) {
          __m512 r[16];
          for (int j = 0; j < 16; ++j) {
            r[j] = WidenBf16(src + (j0 + j) * b.cols + k0 + k, 0xFFFF);
          }
          Transpose16(r);
          for (int i = 0; i < 16; ++i) {
            _mm512_store_ps(panel + (k + i) * kNr + col, r[i]);
          }
        }
      }
      for (; k < kc; ++k) {
        for (int64_t j = 0; j < 16; ++j) {
          panel[k * kNr + col + j] =
              j0 + j < n ? LoadFloat(Type::kBF16, src,
                                     (k0 + k) * b.rows + (j0 + j) * b.cols)
                         : 0.0f;
        }
      }
    }
  }
}

// A's bfloat16 rows [i0, i0 + rows) at depths [k0, k0 + kc) as float32:
// rows of kc (a_rs = kc, a_ks = 1) when k is contiguous and the panel is
// full, else a panel [k][kMr] zero past `rows` (a_rs = 1, a_ks = kMr).
DROPLESS_TARGET void WidenA(View a, int64_t i0, int64_t rows, int64_t k0,
                            int64_t kc, float* dst, int64_t* a_rs,
                            int64_t* a_ks) {
  const uint16_t* src = static_cast<const uint16_t*>(a.data);
  if (a.cols == 1 && rows == kMr) {
    for (int r = 0; r < kMr; ++r) {
      const uint16_t* row = src + (i0 + r) * a.rows + k0;
      for (int64_t k = 0; k < kc; k += 16) {
        const __mmask16 mask = FirstLanes(kc - k);
        _mm512_mask_storeu_ps(dst + r * kc + k, mask, WidenBf16(row + k, mask));
      }
    }
    *a_rs = kc;
    *a_ks = 1;
    return;
  }
  for (int64_t k = 0; k < kc; ++k) {
    const int64_t at = i0 * a.rows + (k0 + k) * a.cols;
    if (a.rows == 1) {
      // The weight gradient's rows: i contiguous.
      _mm256_storeu_ps(dst + k * kMr,
                       _mm512_castps512_ps256(
                           WidenBf16(src + at, FirstLanes(rows))));
      continue;
    }
    for (int r = 0; r < kMr; ++r) {
      dst[k * kMr + r] =
          r < rows ? LoadFloat(Type::kBF16, src, at + r * a.rows) : 0.0f;
    }
  }
  *a_rs = 1;
  *a_ks = kMr;
}

// 16 float32 -> bfloat16, rounded to nearest even, NaN kept (quietened),
// without AVX512_BF16's vcvtneps2bf16.
DROPLESS_TARGET inline __m256i RoundBf16x16(__m512 v) {
  typedef uint32_t Lanes __attribute__((vector_size(64)));
  Lanes bits = (Lanes)_mm512_castps_si512(v);
  RoundToBf16Lanes(&bits);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)bits, 16));
}

// --- Output ------------------------------------------------------------------

// Rows [0, m) x [0, n) of the float32 tile c (row stride ldc) into out;
// bfloat16 by vcvtneps2bf16 only if `dot_bf16` (the CPU has AVX512_BF16).
DROPLESS_TARGET void StoreTile(const float* c, int64_t ldc, int64_t m,
                               int64_t n, Out out, bool dot_bf16) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = c + i * ldc;
    for (int64_t j = 0; j < n; j += 16) {
      const int64_t left = n - j;
      const __mmask16 mask = FirstLanes(left);
      const __m512 v = _mm512_maskz_loadu_ps(mask, row + j);
      if (out.type == Type::kF32) {
        float* to = static_cast<float*>(out.data) + i * out.ld + j;
        if (out.stream && left >= 16 &&
            reinterpret_cast<uintptr_t>(to) % 64 == 0) {
          _mm512_stream_ps(to, v);
        } else {
          _mm512_mask_storeu_ps(to, mask, v);
        }
      } else {
        const __m256i bf = dot_bf16 ? (__m256i)_mm512_cvtneps_pbh(v)
                                    : RoundBf16x16(v);
        uint16_t* to = static_cast<uint16_t*>(out.data) + i * out.ld + j;
        if (out.stream && left >= 16 &&
            reinterpret_cast<uintptr_t>(to) % 32 == 0) {
          _mm256_stream_si256(reinterpret_cast<__m256i*>(to), bf);
        } else {
          _mm256_mask_storeu_epi16(to, mask, bf);
        }
      }
    }
  }
}

}  // namespace

DROPLESS_TARGET void GemmBlockAvx512(Type in, int64_t m, int64_t n,
                                     int64_t depth, View a, View b, Out out,
                                     Scratch* scratch, bool dot_bf16) {
  if (m <= 0 || n <= 0) return;
  if (depth <= 0) {
    ZeroBlock(m, n, out);
    return;
  }
  // bf16: pairs of bfloat16 depths by vdpbf16ps; widen: bfloat16 widened
  // to float32 while packing, then the float32 micro-kernel.
  const bool bf16 = in == Type::kBF16 && dot_bf16;
  const bool widen = in == Type::kBF16 && !dot_bf16;
  const int64_t step = bf16 ? 2 * kKc : kKc;      // depths per slice
  const int64_t single = bf16 ? 2 * kKcSingle : kKcSingle;
  const int64_t slices = depth <= single ? 1 : CeilDiv(depth, step);
  const int64_t slice = slices == 1 ? depth : step;
  const int64_t panels = CeilDiv(n, kNr);
  const int64_t ldc = panels * kNr;
  const int64_t row_panels = CeilDiv(m, kMr);
  // Lanes per packed B row (float32 values or bfloat16 pairs).
  const int64_t lanes_per_slice = bf16 ? CeilDiv(slice, 2) : slice;

  void* packed_b = scratch->Get(0, 4 * lanes_per_slice * ldc);
  void* packed_a = scratch->Get(1, 4 * lanes_per_slice * kMr);
  // One float32 tile when the depth is one slice; the whole block when
  // slices accumulate into it.
  float* acc = static_cast<float*>(
      scratch->Get(2, 4 * (slices == 1 ? kMr : row_panels * kMr) * ldc));

  // A read in place: float32 with k or i contiguous, bfloat16 pairs of a
  // row (k contiguous, even strides and depth so no pair crosses a row).
  const bool a_direct_f32 = in == Type::kF32 && (a.cols == 1 || a.rows == 1);
  const bool a_direct_bf16 =
      bf16 && a.cols == 1 && a.rows % 2 == 0 && depth % 2 == 0 &&
      reinterpret_cast<uintptr_t>(a.data) % 4 == 0;

  for (int64_t s = 0; s < slices; ++s) {
    const int64_t k0 = s * slice;
    const int64_t kc = std::min(slice, depth - k0);
    const int64_t lanes = bf16 ? CeilDiv(kc, 2) : kc;
    if (widen) {
      PackBWidened(b, k0, kc, n, static_cast<float*>(packed_b));
    } else {
      PackB(in, b, k0, kc, n, packed_b);
    }
    for (int64_t ip = 0; ip < row_panels; ++ip) {
      const int64_t i0 = ip * kMr;
      const int64_t rows = std::min<int64_t>(kMr, m - i0);
      if (a_direct_f32 && a.rows == 1 && i0 + 2 * kMr < m) {
        // A's columns, one cache line per depth (the weight gradient's
        // rows, often a page apart): ask for two panels ahead.
        const float* ahead =
            static_cast<const float*>(a.data) + i0 + 2 * kMr + k0 * a.cols;
        for (int64_t k = 0; k < kc; ++k) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead + k * a.cols),
                       _MM_HINT_T0);
        }
      }
      // Where the micro-kernel reads A: in place, or a packed copy.
      const void* a_ptr;
      int64_t a_rs, a_ks;
      if (rows == kMr && a_direct_f32) {
        a_ptr = static_cast<const float*>(a.data) + i0 * a.rows + k0 * a.cols;
        a_rs = a.rows;
        a_ks = a.cols;
      } else if (rows == kMr && a_direct_bf16) {
        a_ptr = reinterpret_cast<const uint32_t*>(
                    static_cast<const uint16_t*>(a.data) + i0 * a.rows) +
                k0 / 2;
        a_rs = a.rows / 2;
        a_ks = 1;
      } else if (widen) {
        WidenA(a, i0, rows, k0, kc, static_cast<float*>(packed_a), &a_rs,
               &a_ks);
        a_ptr = packed_a;
      } else {
        const char* base = static_cast<const char*>(a.data) +
                           (i0 * a.rows + k0 * a.cols) * (bf16 ? 2 : 4);
        if (bf16 && a.rows == 1 && rows == kMr) {
          // The weight gradient's rows: i contiguous, pairs across rows.
          PackRowPairsBf16<kMr>(reinterpret_cast<const uint16_t*>(base),
                                a.cols, kc, kMr,
                                static_cast<uint32_t*>(packed_a));
        } else {
          PackGeneric(in, base, a.cols, a.rows, kc, rows, kMr, packed_a);
        }
        a_ptr = packed_a;
        a_rs = 1;
        a_ks = kMr;
      }
      float* c_rows = slices == 1 ? acc : acc + i0 * ldc;
      for (int64_t jp = 0; jp < panels; ++jp) {
        float* c = c_rows + jp * kNr;
        if (bf16) {
          Micro<StepBf16>(
              lanes, static_cast<const uint32_t*>(a_ptr), a_rs, a_ks,
              static_cast<const uint32_t*>(packed_b) + jp * lanes * kNr, c,
              ldc, s > 0);
        } else {
          Micro<StepF32>(lanes, static_cast<const float*>(a_ptr), a_rs, a_ks,
                         static_cast<const float*>(packed_b) + jp * lanes * kNr,
                         c, ldc, s > 0);
        }
      }
      if (slices == 1) {
        const size_t width = out.type == Type::kF32 ? 4 : 2;
        Out tile = out;
        tile.data = static_cast<char*>(out.data) + i0 * out.ld * width;
        StoreTile(acc, ldc, rows, n, tile, dot_bf16);
      }
    }
  }
  if (slices > 1) StoreTile(acc, ldc, m, n, out, dot_bf16);
  // Non-temporal stores are weakly ordered: make them visible before the
  // block is reported done.
  if (out.stream) _mm_sfence();
}

}  // namespace dropless_cpu

#endif  // defined(__x86_64__)
