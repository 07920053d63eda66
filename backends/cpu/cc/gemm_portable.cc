// The portable GEMM core, the per-CPU choice of kernels, and the scratch
// buffers both cores use.
//
// The portable core runs wherever the library compiles: plain C++ with GCC
// vector types (16 float32 lanes, which the compiler splits into whatever
// registers the target has). On x86-64 its micro-kernel is also cloned for
// x86-64-v3 (AVX2 + FMA), picked by the loader at run time (an ifunc), so a
// CPU without AVX-512 still gets 256-bit FMAs; the default clone is baseline
// x86-64 (SSE2). Operands of either type are converted to float32 while
// packing, so one micro-kernel serves float32 and bfloat16.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "backends/cpu/cc/gemm.h"

namespace dropless_cpu {
namespace {

// Tile: kRows rows x 16 columns of C in four 16-lane accumulators.
constexpr int kRows = 4;
constexpr int kCols = 16;
// Depth per packed slice: a B slice of kDepth x 96 float32 is 96 KiB.
constexpr int64_t kDepth = 256;

typedef float Lanes __attribute__((vector_size(4 * kCols)));

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// c[r * ldc + j] (+)= sum_k a[k * kRows + r] * b[k * kCols + j] for a
// kRows x kCols tile of float32; `load` adds to c instead of overwriting.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    __GNUC__ >= 11
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void MicroPortable(int64_t kc, const float* a, const float* b, float* c,
                   int64_t ldc, bool load) {
  Lanes acc[kRows];
  for (int r = 0; r < kRows; ++r) {
    if (load) {
      std::memcpy(&acc[r], c + r * ldc, sizeof(Lanes));
    } else {
      acc[r] = Lanes{};
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    Lanes bv;
    std::memcpy(&bv, b + k * kCols, sizeof(Lanes));
    for (int r = 0; r < kRows; ++r) acc[r] += a[k * kRows + r] * bv;
  }
  for (int r = 0; r < kRows; ++r) {
    std::memcpy(c + r * ldc, &acc[r], sizeof(Lanes));
  }
}

}  // namespace

void GemmBlockPortable(Type in, int64_t m, int64_t n, int64_t depth, View a,
                       View b, Out out, Scratch* scratch) {
  if (m <= 0 || n <= 0) return;
  if (depth <= 0) {
    ZeroBlock(m, n, out);
    return;
  }
  const int64_t panels = CeilDiv(n, kCols);
  const int64_t ldc = panels * kCols;
  const int64_t row_panels = CeilDiv(m, kRows);
  const int64_t slice = std::min(depth, kDepth);
  float* packed_b = static_cast<float*>(scratch->Get(0, 4 * slice * ldc));
  float* packed_a = static_cast<float*>(scratch->Get(1, 4 * slice * kRows));
  // The whole block's float32 sums, kept across depth slices.
  float* acc = static_cast<float*>(
      scratch->Get(2, 4 * row_panels * kRows * ldc));

  for (int64_t k0 = 0; k0 < depth; k0 += slice) {
    const int64_t kc = std::min(slice, depth - k0);
    // B's slice as float32 panels [p][k][kCols], zero past n.
    for (int64_t p = 0; p < panels; ++p) {
      float* panel = packed_b + p * kc * kCols;
      for (int64_t k = 0; k < kc; ++k) {
        for (int j = 0; j < kCols; ++j) {
          const int64_t col = p * kCols + j;
          panel[k * kCols + j] =
              col < n ? LoadFloat(in, b.data, (k0 + k) * b.rows + col * b.cols)
                      : 0.0f;
        }
      }
    }
    for (int64_t ip = 0; ip < row_panels; ++ip) {
      // A's rows as a float32 panel [k][kRows], zero past m (those rows of
      // acc are computed but never stored).
      for (int64_t k = 0; k < kc; ++k) {
        for (int r = 0; r < kRows; ++r) {
          const int64_t row = ip * kRows + r;
          packed_a[k * kRows + r] =
              row < m ? LoadFloat(in, a.data, row * a.rows + (k0 + k) * a.cols)
                      : 0.0f;
        }
      }
      for (int64_t p = 0; p < panels; ++p) {
        MicroPortable(kc, packed_a, packed_b + p * kc * kCols,
                      acc + ip * kRows * ldc + p * kCols, ldc, k0 > 0);
      }
    }
  }
  StoreSums(acc, ldc, m, n, out);
}

void StoreSums(const float* acc, int64_t ldc, int64_t m, int64_t n, Out out) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = acc + i * ldc;
    if (out.type == Type::kF32) {
      std::memcpy(static_cast<float*>(out.data) + i * out.ld, row, 4 * n);
    } else {
      uint16_t* to = static_cast<uint16_t*>(out.data) + i * out.ld;
      for (int64_t j = 0; j < n; ++j) to[j] = RoundToBf16(row[j]);
    }
  }
}

void ZeroBlock(int64_t m, int64_t n, Out out) {
  const size_t width = out.type == Type::kF32 ? 4 : 2;
  char* base = static_cast<char*>(out.data);
  for (int64_t i = 0; i < m; ++i) {
    std::memset(base + i * out.ld * width, 0, n * width);
  }
}

Scratch::Scratch() {
  for (int i = 0; i < kSlots; ++i) {
    buffers_[i] = nullptr;
    sizes_[i] = 0;
  }
}

Scratch::~Scratch() {
  for (int i = 0; i < kSlots; ++i) std::free(buffers_[i]);
}

void* Scratch::Get(int slot, size_t bytes) {
  if (sizes_[slot] < bytes) {
    std::free(buffers_[slot]);
    const size_t rounded = (bytes + 4095) / 4096 * 4096;
    buffers_[slot] = std::aligned_alloc(64, rounded);
    sizes_[slot] = buffers_[slot] ? rounded : 0;
  }
  return buffers_[slot];
}

Kernels CpuKernels() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") &&
                    __builtin_cpu_supports("fma");
  if (!avx2) return Kernels::kPortable;
  const bool avx512 = __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (!avx512) return Kernels::kAvx2;
  if (!__builtin_cpu_supports("avx512bf16")) return Kernels::kAvx512;
  // AMX on top of AVX512_BF16 (every AMX CPU has it; kAmx runs float32 by
  // it): only where the CPU, the OS and this build all allow the tiles.
  return AmxUsable() ? Kernels::kAmx : Kernels::kAvx512Bf16;
#else
  return Kernels::kPortable;
#endif
}

namespace {

// What `name` asks for: a set, or the CPU's best for anything else.
Kernels Named(const char* name) {
  const Kernels sets[] = {Kernels::kPortable,    Kernels::kAvx2,
                          Kernels::kAvx512,      Kernels::kAvx512Bf16,
                          Kernels::kAmx,         Kernels::kAmxEmulated};
  if (name != nullptr) {
    for (Kernels set : sets) {
      if (std::strcmp(name, KernelsName(set)) == 0) return set;
    }
  }
  return CpuKernels();
}

// What a request for `asked` runs here. The CPU's sets are ordered, each
// running everything the ones below it run, so "lower" is the smaller of
// the two; the emulation runs on every CPU.
Kernels Allowed(Kernels asked) {
  if (asked == Kernels::kAmxEmulated) return asked;
  return std::min(asked, CpuKernels());
}

std::atomic<Kernels>& Selection() {
  static std::atomic<Kernels> selection{
      Allowed(Named(std::getenv("DROPLESS_CPU_KERNELS")))};
  return selection;
}

// The set that runs float32 under kAmx or kAmxEmulated (AMX multiplies
// bfloat16 only): the best of the others this CPU has (kAvx512Bf16 where
// there is AMX).
Kernels Float32Kernels() {
  static const Kernels kernels =
      std::min(CpuKernels(), Kernels::kAvx512Bf16);
  return kernels;
}

}  // namespace

Kernels SelectedKernels() {
  return Selection().load(std::memory_order_relaxed);
}

Kernels UseKernels(const char* name) {
  const Kernels chosen = Allowed(Named(name));
  Selection().store(chosen);
  return chosen;
}

const char* KernelsName(Kernels kernels) {
  switch (kernels) {
    case Kernels::kAmxEmulated:
      return "amx-emulated";
    case Kernels::kAmx:
      return "amx";
    case Kernels::kAvx512Bf16:
      return "avx512-bf16";
    case Kernels::kAvx512:
      return "avx512";
    case Kernels::kAvx2:
      return "avx2";
    case Kernels::kPortable:
      return "portable";
  }
  return "portable";
}

void GemmBlock(Type in, int64_t m, int64_t n, int64_t depth, View a, View b,
               Out out, Scratch* scratch) {
  Kernels kernels = SelectedKernels();
  if (kernels == Kernels::kAmx || kernels == Kernels::kAmxEmulated) {
    if (in == Type::kBF16) {
      if (kernels == Kernels::kAmx) {
        GemmBlockAmx(in, m, n, depth, a, b, out, scratch);
      } else {
        GemmBlockAmxEmulated(in, m, n, depth, a, b, out, scratch);
      }
      return;
    }
    kernels = Float32Kernels();
  }
#if defined(__x86_64__)
  if (kernels >= Kernels::kAvx512) {
    GemmBlockAvx512(in, m, n, depth, a, b, out, scratch,
                    /*dot_bf16=*/kernels == Kernels::kAvx512Bf16);
    return;
  }
  if (kernels == Kernels::kAvx2) {
    GemmBlockAvx2(in, m, n, depth, a, b, out, scratch);
    return;
  }
#endif
  GemmBlockPortable(in, m, n, depth, a, b, out, scratch);
}

}  // namespace dropless_cpu
