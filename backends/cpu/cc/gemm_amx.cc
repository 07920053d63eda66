// The AMX GEMM core for bfloat16 operands (Sapphire Rapids and later), and
// the scalar emulation of the tile unit that tests it on any CPU.
//
// C (m x n, float32) = A (m x depth) B (depth x n), both bfloat16, summed in
// float32 by tdpbf16ps on AMX tiles: eight tile registers of up to 16 rows
// x 64 bytes, all configured here as 16 x 64:
//   C tiles 0-3  16 x 16 float32 accumulators: a 2 x 2 block of 32 x 32;
//   A tiles 4-5  16 rows x 32 bfloat16 depths (16 pairs) each: rows 0-15
//                and 16-31 of the block;
//   B tiles 6-7  16 depth pairs x 16 columns x 2 bfloat16 (the VNNI
//                layout: row k2 holds B(2 k2, j), B(2 k2 + 1, j) for its 16
//                columns j) each: columns 0-15 and 16-31 of the block.
// One depth step of 32 loads two A tiles and two B tiles and issues four
// tdpbf16ps, each 16 x 16 x 32 multiply-adds.
//
// The depth is cut into slices of kKc; per slice B is packed into panels of
// 16 columns in the VNNI layout, zero past n and past the slice's depth
// (rounded up to a multiple of 32). A is read in place when its rows hold
// their depths contiguously, the block has all 32 rows and the slice needs
// no padding (the forward's and dX's full blocks); otherwise it is packed
// into 32 rows of the padded depth, zero past m and the depth (the weight
// gradient's transposed rows, ragged row panels, ragged depths). So a
// ragged edge is always a zero-padded tile, never a differently shaped one,
// and one tile configuration serves the whole block. A block of 16 rows or
// fewer, or a last column pair with one 16-column tile, skips the tiles
// and products it does not need. The float32 sums go to a buffer of the
// whole block (re-loaded into the C tiles for the next slice) and are
// written once at the end, bfloat16 outputs rounded to nearest even.
//
// The packing and blocking above are one template, GemmTiles, over a tile
// unit: AmxTiles executes AMX instructions (target attributes, like the
// rest of the library's vector code: the file is compiled for baseline
// x86-64), EmulatedTiles is C++ that does what the SDM says each
// instruction does, on tiles in memory. GemmBlockAmx runs the first only
// where AmxUsable() (gemm_portable.cc's dispatch); GemmBlockAmxEmulated,
// the kernel set "amx-emulated", runs the second anywhere, so a CPU
// without AMX tests kAmx's packing, tile addressing and blocking.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backends/cpu/cc/gemm.h"

#if DROPLESS_CPU_AMX
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace dropless_cpu {
namespace {

// Every tile: 16 rows of 64 bytes.
constexpr int kTileRows = 16;
constexpr int kTileBytes = 64;
// bfloat16 depths per A tile row (16 pairs), float32 columns per C tile.
constexpr int kTileDepth = kTileBytes / 2;
constexpr int kTileCols = kTileBytes / 4;
// Rows of C per 2 x 2 block of tiles (its columns: 2 * kTileCols).
constexpr int kMr = 2 * kTileRows;
// Depths per slice (a multiple of kTileDepth): a packed B slice of a
// 96-column block is kKc x 96 bfloat16 = 192 KiB, an A panel 64 KiB.
constexpr int64_t kKc = 1024;
static_assert(kKc % kTileDepth == 0, "slices are whole depth steps");

// Tile registers: C at (row half, column half), A per row half, B per
// column half.
constexpr int kC00 = 0, kC01 = 1, kC10 = 2, kC11 = 3;
constexpr int kA0 = 4, kA1 = 5;
constexpr int kB0 = 6, kB1 = 7;
constexpr int kTiles = 8;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ldtilecfg's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // Bytes per row, per tile.
  uint8_t rows[16];    // Rows, per tile.
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// All eight tiles 16 x 64 bytes.
TileConfig BlockConfig() {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette = 1;
  for (int t = 0; t < kTiles; ++t) {
    config.colsb[t] = kTileBytes;
    config.rows[t] = kTileRows;
  }
  return config;
}

// --- The emulated tile unit --------------------------------------------------

// AMX's tile registers and instructions in C++, per the Intel SDM
// (ldtilecfg, tilerelease, tilezero, tileloadd, tilestored, tdpbf16ps):
// the same bytes read and written, the same zeroing of a tile past its
// configured rows and bytes, the same faults (here: a message and abort)
// for a configuration or shapes the hardware refuses, and tdpbf16ps's
// arithmetic: per row and column of C, the products of even and of odd
// bfloat16 of each pair summed in two float32 temporaries by FMAs rounded
// to nearest even, then C + even + odd; input denormals read as zero and
// denormal results flushed to zero, as the instruction does (MXCSR is not
// consulted). One object is one thread's tile unit.
class EmulatedTiles {
 public:
  void Configure(const TileConfig* config) {
    Require(config->palette == 1, "ldtilecfg: palette other than 1");
    Require(config->start_row == 0, "ldtilecfg: start_row not 0");
    for (uint8_t byte : config->reserved) {
      Require(byte == 0, "ldtilecfg: reserved bytes not 0");
    }
    for (int t = 0; t < 16; ++t) {
      const int rows = config->rows[t];
      const int colsb = config->colsb[t];
      if (t >= kTiles) {
        Require(rows == 0 && colsb == 0, "ldtilecfg: tile past palette 1's 8");
        continue;
      }
      Require(rows <= kTileRows && colsb <= kTileBytes,
              "ldtilecfg: tile larger than 16 x 64 bytes");
      Require((rows == 0) == (colsb == 0), "ldtilecfg: half-configured tile");
      tiles_[t].rows = rows;
      tiles_[t].colsb = colsb;
      std::memset(tiles_[t].data, 0, sizeof(tiles_[t].data));
    }
    configured_ = true;
  }

  void Release() {
    configured_ = false;
    for (Tile& tile : tiles_) tile.rows = tile.colsb = 0;
  }

  template <int kTile>
  void Zero() {
    std::memset(Configured(kTile).data, 0, sizeof(Tile::data));
  }

  // tileloadd: rows r < rows of colsb bytes from base + r * stride (bytes);
  // the rest of the tile zero.
  template <int kTile>
  void Load(const void* base, int64_t stride) {
    Tile& tile = Configured(kTile);
    std::memset(tile.data, 0, sizeof(tile.data));
    for (int r = 0; r < tile.rows; ++r) {
      std::memcpy(tile.data[r], static_cast<const char*>(base) + r * stride,
                  tile.colsb);
    }
  }

  // tilestored: rows r < rows of colsb bytes to base + r * stride (bytes).
  template <int kTile>
  void Store(void* base, int64_t stride) {
    const Tile& tile = Configured(kTile);
    for (int r = 0; r < tile.rows; ++r) {
      std::memcpy(static_cast<char*>(base) + r * stride, tile.data[r],
                  tile.colsb);
    }
  }

  // tdpbf16ps C, A, B: C (M x N float32) += A (M x K pairs) B (K x N pairs).
  template <int kC, int kA, int kB>
  void Dot() {
    static_assert(kC != kA && kC != kB && kA != kB, "#UD: tiles not distinct");
    Tile& c = Configured(kC);
    const Tile& a = Configured(kA);
    const Tile& b = Configured(kB);
    Require(c.colsb % 4 == 0 && a.colsb % 4 == 0 && b.colsb % 4 == 0,
            "tdpbf16ps: bytes per row not a multiple of 4");
    Require(c.rows == a.rows, "tdpbf16ps: C and A rows differ");
    Require(a.colsb / 4 == b.rows, "tdpbf16ps: A's pairs are not B's rows");
    Require(c.colsb == b.colsb, "tdpbf16ps: C and B widths differ");
    const int depth_pairs = a.colsb / 4;
    const int columns = c.colsb / 4;
    for (int m = 0; m < c.rows; ++m) {
      float even[kTileCols] = {}, odd[kTileCols] = {};
      for (int k = 0; k < depth_pairs; ++k) {
        const float a0 = Bf16(a.data[m], 2 * k);
        const float a1 = Bf16(a.data[m], 2 * k + 1);
        for (int n = 0; n < columns; ++n) {
          even[n] = Ftz(std::fma(a0, Bf16(b.data[k], 2 * n), even[n]));
          odd[n] = Ftz(std::fma(a1, Bf16(b.data[k], 2 * n + 1), odd[n]));
        }
      }
      for (int n = 0; n < columns; ++n) {
        float sum;
        std::memcpy(&sum, c.data[m] + 4 * n, 4);
        sum = Ftz(Ftz(Daz(sum) + even[n]) + odd[n]);
        std::memcpy(c.data[m] + 4 * n, &sum, 4);
      }
      std::memset(c.data[m] + c.colsb, 0, kTileBytes - c.colsb);
    }
    for (int m = c.rows; m < kTileRows; ++m) {
      std::memset(c.data[m], 0, kTileBytes);
    }
  }

 private:
  struct Tile {
    int rows = 0;
    int colsb = 0;
    alignas(64) uint8_t data[kTileRows][kTileBytes];
  };

  static void Require(bool ok, const char* what) {
    if (ok) return;
    std::fprintf(stderr, "dropless_cpu amx-emulated: %s\n", what);
    std::abort();
  }

  Tile& Configured(int t) {
    Require(configured_ && tiles_[t].rows > 0,
            "tile instruction on an unconfigured tile");
    return tiles_[t];
  }

  static float Daz(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
    std::memcpy(&x, &bits, 4);
    return x;
  }

  static float Ftz(float x) { return Daz(x); }

  // bfloat16 `index` of a tile row, as float32, denormals read as zero.
  static float Bf16(const uint8_t* row, int index) {
    uint16_t half;
    std::memcpy(&half, row + 2 * index, 2);
    const uint32_t bits = uint32_t{half} << 16;
    float value;
    std::memcpy(&value, &bits, 4);
    return Daz(value);
  }

  bool configured_ = false;
  Tile tiles_[kTiles];
};

// --- Packing -----------------------------------------------------------------

// B's slice, depths [k0, k0 + kc) x columns [0, n), into AMX's VNNI layout:
// panels of 16 columns, each kc32 / 2 rows of 16 columns x 2 bfloat16 (a B
// tile's row, 64 bytes: B(2 k2, j) then B(2 k2 + 1, j) for each column j),
// zero past kc and n. A step's B tile is 16 consecutive rows of a panel.
void PackBVnni(View b, int64_t k0, int64_t kc, int64_t kc32, int64_t n,
               uint16_t* dst) {
  const uint16_t* src = static_cast<const uint16_t*>(b.data);
  const int64_t panels = CeilDiv(n, kTileCols);
  std::memset(dst, 0, 2 * panels * kc32 * kTileCols);
  auto at = [&](int64_t k, int64_t j) -> uint16_t& {
    return dst[(j / kTileCols) * kc32 * kTileCols + (k / 2) * 2 * kTileCols +
               (j % kTileCols) * 2 + k % 2];
  };
  if (b.cols == 1) {
    // The forward's weights [C, N] and the weight gradient's cotangent
    // rows: row k holds its columns contiguously.
    for (int64_t k = 0; k < kc; ++k) {
      const uint16_t* row = src + (k0 + k) * b.rows;
      for (int64_t j = 0; j < n; ++j) at(k, j) = row[j];
    }
  } else {
    // Transposed weights [N, C] (b.rows == 1): column j holds its depths.
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* col = src + k0 * b.rows + j * b.cols;
      for (int64_t k = 0; k < kc; ++k) at(k, j) = col[k * b.rows];
    }
  }
}

// A's rows [i0, i0 + rows) at depths [k0, k0 + kc) as kMr rows of kc32
// bfloat16 (row r at dst + r * kc32), zero past `rows` and kc.
void PackA(View a, int64_t i0, int64_t rows, int64_t k0, int64_t kc,
           int64_t kc32, uint16_t* dst) {
  const uint16_t* src = static_cast<const uint16_t*>(a.data);
  std::memset(dst, 0, 2 * kMr * kc32);
  if (a.cols == 1) {
    // Rows holding their depths contiguously (a ragged panel or depth).
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(dst + r * kc32, src + (i0 + r) * a.rows + k0, 2 * kc);
    }
    return;
  }
  // The weight gradient's rows transposed (a.rows == 1): depth k holds the
  // panel's rows contiguously.
  for (int64_t k = 0; k < kc; ++k) {
    const uint16_t* at = src + i0 * a.rows + (k0 + k) * a.cols;
    for (int64_t r = 0; r < rows; ++r) dst[r * kc32 + k] = at[r * a.rows];
  }
}

// --- The blocking, over either tile unit -------------------------------------

// out = a b for bfloat16 a and b (gemm.h's GemmBlock contract) on `tiles`.
// Inlined into each entry point (flatten), so that AmxTiles' instructions
// compile inside GemmBlockAmx's target attributes.
template <typename Tiles>
void GemmTiles(Tiles& tiles, int64_t m, int64_t n, int64_t depth, View a,
               View b, Out out, Scratch* scratch) {
  if (m <= 0 || n <= 0) return;
  if (depth <= 0) {
    ZeroBlock(m, n, out);
    return;
  }
  const int64_t slice = std::min(depth, kKc);
  const int64_t slice32 = CeilDiv(slice, kTileDepth) * kTileDepth;
  const int64_t col_tiles = CeilDiv(n, kTileCols);
  const int64_t ldc = col_tiles * kTileCols;
  const int64_t row_panels = CeilDiv(m, kMr);
  uint16_t* packed_b =
      static_cast<uint16_t*>(scratch->Get(0, 2 * slice32 * ldc));
  uint16_t* packed_a =
      static_cast<uint16_t*>(scratch->Get(1, 2 * kMr * slice32));
  float* acc =
      static_cast<float*>(scratch->Get(2, 4 * row_panels * kMr * ldc));
  const int64_t c_stride = 4 * ldc;  // Bytes between rows of acc.

  static const TileConfig config = BlockConfig();
  tiles.Configure(&config);
  for (int64_t k0 = 0; k0 < depth; k0 += slice) {
    const int64_t kc = std::min(slice, depth - k0);
    const int64_t kc32 = CeilDiv(kc, kTileDepth) * kTileDepth;
    const int64_t steps = kc32 / kTileDepth;
    PackBVnni(b, k0, kc, kc32, n, packed_b);
    for (int64_t ip = 0; ip < row_panels; ++ip) {
      const int64_t i0 = ip * kMr;
      const int64_t rows = std::min<int64_t>(kMr, m - i0);
      const bool two_rows = rows > kTileRows;
      // A's two row tiles: in place, or packed (ld in elements).
      const uint16_t* a_rows;
      int64_t a_ld;
      if (a.cols == 1 && rows == kMr && kc == kc32) {
        a_rows = static_cast<const uint16_t*>(a.data) + i0 * a.rows + k0;
        a_ld = a.rows;
      } else {
        PackA(a, i0, rows, k0, kc, kc32, packed_a);
        a_rows = packed_a;
        a_ld = kc32;
      }
      const uint16_t* a_lower = a_rows + kTileRows * a_ld;
      for (int64_t jt = 0; jt < col_tiles; jt += 2) {
        const bool two_cols = jt + 1 < col_tiles;
        float* c = acc + i0 * ldc + jt * kTileCols;
        float* c_lower = c + kTileRows * ldc;
        if (k0 == 0) {
          tiles.template Zero<kC00>();
          tiles.template Zero<kC01>();
          tiles.template Zero<kC10>();
          tiles.template Zero<kC11>();
        } else {
          tiles.template Load<kC00>(c, c_stride);
          if (two_cols) tiles.template Load<kC01>(c + kTileCols, c_stride);
          if (two_rows) tiles.template Load<kC10>(c_lower, c_stride);
          if (two_rows && two_cols) {
            tiles.template Load<kC11>(c_lower + kTileCols, c_stride);
          }
        }
        const uint16_t* b_left = packed_b + jt * kc32 * kTileCols;
        const uint16_t* b_right = b_left + kc32 * kTileCols;
        for (int64_t s = 0; s < steps; ++s) {
          const int64_t at = s * kTileDepth;
          // A step's B tile: 16 rows of 16 pairs, 1 KiB.
          const int64_t b_at = s * kTileRows * kTileCols * 2;
          tiles.template Load<kA0>(a_rows + at, 2 * a_ld);
          tiles.template Load<kB0>(b_left + b_at, kTileBytes);
          tiles.template Dot<kC00, kA0, kB0>();
          if (two_cols) {
            tiles.template Load<kB1>(b_right + b_at, kTileBytes);
            tiles.template Dot<kC01, kA0, kB1>();
          }
          if (two_rows) {
            tiles.template Load<kA1>(a_lower + at, 2 * a_ld);
            tiles.template Dot<kC10, kA1, kB0>();
            if (two_cols) tiles.template Dot<kC11, kA1, kB1>();
          }
        }
        tiles.template Store<kC00>(c, c_stride);
        if (two_cols) tiles.template Store<kC01>(c + kTileCols, c_stride);
        if (two_rows) tiles.template Store<kC10>(c_lower, c_stride);
        if (two_rows && two_cols) {
          tiles.template Store<kC11>(c_lower + kTileCols, c_stride);
        }
      }
    }
  }
  tiles.Release();
  StoreSums(acc, ldc, m, n, out);
}

// --- The AMX tile unit -------------------------------------------------------

#if DROPLESS_CPU_AMX

#define DROPLESS_AMX                                                  \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl," \
                        "avx512bf16")))

// Compiler-level ordering for the tile instructions: GCC's tileloadd and
// ldtilecfg asm do not say they read the buffers (or all 64 bytes of the
// configuration) that the packing just wrote.
#define DROPLESS_MEMORY_BARRIER() __asm__ __volatile__("" ::: "memory")

// The same interface as EmulatedTiles, by AMX instructions. The
// intrinsics take tile numbers as literal tokens, hence one
// specialisation per tile (and per product GemmTiles issues).
struct AmxTiles {
  DROPLESS_AMX void Configure(const TileConfig* config) {
    DROPLESS_MEMORY_BARRIER();
    _tile_loadconfig(config);
  }
  DROPLESS_AMX void Release() { _tile_release(); }
  template <int kTile>
  void Zero();
  template <int kTile>
  void Load(const void* base, int64_t stride);
  template <int kTile>
  void Store(void* base, int64_t stride);
  template <int kC, int kA, int kB>
  void Dot();
};

#define DROPLESS_AMX_TILE(t)                                         \
  template <>                                                        \
  DROPLESS_AMX inline void AmxTiles::Zero<t>() {                     \
    _tile_zero(t);                                                   \
  }                                                                  \
  template <>                                                        \
  DROPLESS_AMX inline void AmxTiles::Load<t>(const void* base,       \
                                             int64_t stride) {       \
    DROPLESS_MEMORY_BARRIER();                                       \
    _tile_loadd(t, base, stride);                                    \
  }                                                                  \
  template <>                                                        \
  DROPLESS_AMX inline void AmxTiles::Store<t>(void* base,            \
                                              int64_t stride) {      \
    _tile_stored(t, base, stride);                                   \
  }
DROPLESS_AMX_TILE(0)
DROPLESS_AMX_TILE(1)
DROPLESS_AMX_TILE(2)
DROPLESS_AMX_TILE(3)
DROPLESS_AMX_TILE(4)
DROPLESS_AMX_TILE(5)
DROPLESS_AMX_TILE(6)
DROPLESS_AMX_TILE(7)
#undef DROPLESS_AMX_TILE

#define DROPLESS_AMX_DOT(c, a, b)                     \
  template <>                                         \
  DROPLESS_AMX inline void AmxTiles::Dot<c, a, b>() { \
    _tile_dpbf16ps(c, a, b);                          \
  }
static_assert(kC00 == 0 && kC01 == 1 && kC10 == 2 && kC11 == 3 &&
                  kA0 == 4 && kA1 == 5 && kB0 == 6 && kB1 == 7,
              "the specialisations below name the tiles by number");
DROPLESS_AMX_DOT(0, 4, 6)
DROPLESS_AMX_DOT(1, 4, 7)
DROPLESS_AMX_DOT(2, 5, 6)
DROPLESS_AMX_DOT(3, 5, 7)
#undef DROPLESS_AMX_DOT

#endif  // DROPLESS_CPU_AMX

}  // namespace

#if DROPLESS_CPU_AMX

DROPLESS_AMX __attribute__((flatten)) void GemmBlockAmx(
    Type in, int64_t m, int64_t n, int64_t depth, View a, View b, Out out,
    Scratch* scratch) {
  (void)in;  // bfloat16: gemm_portable.cc's GemmBlock sends float32 elsewhere.
  AmxTiles tiles;
  GemmTiles(tiles, m, n, depth, a, b, out, scratch);
}

bool AmxUsable() {
  static const bool usable = [] {
    unsigned eax, ebx, ecx, edx;
    // CPUID.(EAX=7, ECX=0):EDX: AMX-BF16 is bit 22, AMX-TILE bit 24.
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!(edx & (1u << 22)) || !(edx & (1u << 24))) return false;
    // XGETBV needs OSXSAVE (CPUID.1:ECX bit 27); XCR0 bits 17 (XTILECFG)
    // and 18 (XTILEDATA) say the OS saves the tile state.
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) {
      return false;
    }
    uint32_t lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const uint64_t xcr0 = (uint64_t{hi} << 32) | lo;
    const uint64_t tile_state = (uint64_t{1} << 17) | (uint64_t{1} << 18);
    if ((xcr0 & tile_state) != tile_state) return false;
#if defined(__linux__)
    // Linux (5.16 and later) hands the tile data to a process that asks,
    // once, for all its threads; the first tile instruction without it
    // faults. Refused (older kernel, a sandbox): no AMX.
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) ==
           0;
#else
    return false;  // No known way to ask this OS for the tile state.
#endif
  }();
  return usable;
}

#else  // !DROPLESS_CPU_AMX

void GemmBlockAmx(Type, int64_t, int64_t, int64_t, View, View, Out,
                  Scratch*) {
  // Unreachable: AmxUsable() is false in this build, so kAmx is never
  // selected.
  std::abort();
}

bool AmxUsable() { return false; }

#endif  // DROPLESS_CPU_AMX

__attribute__((flatten)) void GemmBlockAmxEmulated(
    Type in, int64_t m, int64_t n, int64_t depth, View a, View b, Out out,
    Scratch* scratch) {
  (void)in;
  EmulatedTiles tiles;
  GemmTiles(tiles, m, n, depth, a, b, out, scratch);
}

}  // namespace dropless_cpu
