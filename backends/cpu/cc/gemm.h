// The GEMM core of the cpu backend: one block of C = A B, by the kernel set
// this CPU runs best (AMX, AVX-512, AVX2 or portable C++).
//
// A block is what one task of the grouped GEMM computes (a row chunk of one
// group times a column block of its weights, or a block of one group's
// weight gradient). The operands are strided views, so the same code serves
// the forward (rows x weights), the transposed weights (dX) and the
// transposed rows (dW); see gemm.cc for how each layout is packed.

#ifndef DROPLESS_BACKENDS_CPU_CC_GEMM_H_
#define DROPLESS_BACKENDS_CPU_CC_GEMM_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

// Whether this build holds the AMX kernel: x86-64 and a compiler whose
// target attributes and intrinsics know AMX (GCC 11, Clang 12 and later).
#if defined(__x86_64__) &&                                  \
    ((defined(__clang__) && __clang_major__ >= 12) ||       \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define DROPLESS_CPU_AMX 1
#else
#define DROPLESS_CPU_AMX 0
#endif

namespace dropless_cpu {

enum class Type { kF32, kBF16 };

// A read-only matrix view: element (i, k) is data[i * rows + k * cols], in
// elements of the view's type.
struct View {
  const void* data;
  int64_t rows;  // Stride between rows (i).
  int64_t cols;  // Stride between columns (k).
};

// Where a block's result goes: element (i, j) at data[i * ld + j].
struct Out {
  void* data;
  int64_t ld;
  Type type;
  // Write whole aligned cache lines around the caches (non-temporal): for
  // outputs written once and read much later, such as a weight gradient of
  // many experts, this saves reading each line before writing it.
  bool stream = false;
};

// Per-thread packing and accumulator buffers, grown on demand.
class Scratch {
 public:
  Scratch();
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  // A 64-byte aligned buffer of at least `bytes`, one per slot.
  void* Get(int slot, size_t bytes);

 private:
  static constexpr int kSlots = 3;
  void* buffers_[kSlots];
  size_t sizes_[kSlots];
};

// The kernel sets a call can run, slowest first. Which ones this CPU can
// run is found once, at run time (cpuid), so one build serves every x86-64
// CPU and never executes an instruction the CPU lacks:
//   kAmx         AMX-TILE + AMX-BF16 with the tile state enabled by the OS
//                and granted to the process (Linux arch_prctl), on top of
//                kAvx512Bf16 (Sapphire Rapids and later): gemm_amx.cc for
//                bfloat16 (tdpbf16ps on 16 x 16 float32 tiles), kAvx512Bf16
//                for float32. Only in builds whose compiler knows AMX
//                (DROPLESS_CPU_AMX).
//   kAvx512Bf16  AVX-512 F/BW/VL + FMA + AVX512_BF16 (Zen 4, Sapphire
//                Rapids): gemm.cc for float32 and bfloat16.
//   kAvx512      the same without AVX512_BF16 (Skylake-X, Ice Lake): gemm.cc
//                for both types, bfloat16 widened to float32 while packing.
//   kAvx2        AVX2 + FMA (x86-64-v3: Haswell, Zen 1-3): gemm_avx2.cc for
//                both types, bfloat16 widened to float32 while packing.
//   kPortable    C++ with GCC vector types (gemm_portable.cc), compiled for
//                baseline x86-64 and cloned for x86-64-v3 where the
//                compiler can; any other architecture gets the plain build.
// kAmxEmulated stands outside that order: kAmx's packing and blocking
// driving a scalar C++ emulation of the tile unit (gemm_amx.cc), for
// bfloat16; float32 runs the best of the other sets this CPU has. It runs
// on every CPU, slowly, and exists to test kAmx's data movement where no
// AMX is: cpuid never picks it, only its name does (DROPLESS_CPU_KERNELS
// or UseKernels).
enum class Kernels { kPortable, kAvx2, kAvx512, kAvx512Bf16, kAmx,
                     kAmxEmulated };

// The best kernels this CPU runs, lowered by the environment variable
// DROPLESS_CPU_KERNELS ("portable", "avx2", "avx512", "avx512-bf16";
// never raised past what the CPU has; "amx-emulated" runs everywhere),
// read at the first call, or by UseKernels since.
Kernels SelectedKernels();

// The best set this CPU runs, whatever was asked (never kAmxEmulated).
// The first call asks Linux for the AMX tile state where the CPU has AMX.
Kernels CpuKernels();

// Makes `name`'s set the selection (for tests: every set of this CPU in one
// process), or the CPU's best if the CPU lacks it or the name is unknown.
// Returns the selection. Blocks already running finish on the old set.
Kernels UseKernels(const char* name);

// "amx", "avx512-bf16", "avx512", "avx2", "portable" or "amx-emulated".
const char* KernelsName(Kernels kernels);

// Element `index` of float32 or bfloat16 data, as float32 (bfloat16 is the
// high half of a float32: exact).
inline float LoadFloat(Type type, const void* data, int64_t index) {
  if (type == Type::kF32) return static_cast<const float*>(data)[index];
  const uint32_t bits = uint32_t{static_cast<const uint16_t*>(data)[index]}
                        << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// float32 -> bfloat16, rounded to nearest even; NaN stays NaN (quietened),
// as AVX512_BF16's vcvtneps2bf16 does.
inline uint16_t RoundToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x40);
  }
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// RoundToBf16 on every lane of *bits, a GCC vector of uint32 holding
// float32 bits: the bfloat16 lands in each lane's high half. The vector
// cores call it from their target-attributed code (by pointer: a 256/512-
// bit vector passed by value would change the baseline ABI).
template <typename U>
inline void RoundToBf16Lanes(U* bits) {
  const U nan = (U)((*bits & 0x7FFFFFFFu) > 0x7F800000u);
  const U rounded = *bits + 0x7FFFu + ((*bits >> 16) & 1u);
  *bits = (nan & (*bits | 0x400000u)) | (~nan & rounded);
}

// out[i, j] = sum_{k < depth} a(i, k) * b(k, j) for i < m, j < n, summed in
// float32 and written as out.type (bfloat16 rounded to nearest even). a and
// b are of type `in`. depth == 0 writes zeros. Never reads a or b outside
// i < m, j < n, k < depth. Runs the best of SelectedKernels() that handles
// these types.
void GemmBlock(Type in, int64_t m, int64_t n, int64_t depth, View a, View b,
               Out out, Scratch* scratch);

// The same, by one implementation: GemmBlockAvx512 and GemmBlockAvx2 only
// where CpuKernels() allows them (they are absent off x86-64).
// GemmBlockAvx512 multiplies bfloat16 by vdpbf16ps if `dot_bf16` (only on
// kAvx512Bf16 and kAmx), else widens it to float32.
void GemmBlockAvx512(Type in, int64_t m, int64_t n, int64_t depth, View a,
                     View b, Out out, Scratch* scratch, bool dot_bf16);
void GemmBlockAvx2(Type in, int64_t m, int64_t n, int64_t depth, View a,
                   View b, Out out, Scratch* scratch);
void GemmBlockPortable(Type in, int64_t m, int64_t n, int64_t depth, View a,
                       View b, Out out, Scratch* scratch);

// AMX's kernel for bfloat16 operands (gemm_amx.cc): GemmBlockAmx executes
// AMX instructions, so only where AmxUsable(); GemmBlockAmxEmulated runs
// the same packing and blocking on an emulated tile unit, on any CPU.
// Both take bfloat16 operands only (`in` is there to say so).
void GemmBlockAmx(Type in, int64_t m, int64_t n, int64_t depth, View a,
                  View b, Out out, Scratch* scratch);
void GemmBlockAmxEmulated(Type in, int64_t m, int64_t n, int64_t depth,
                          View a, View b, Out out, Scratch* scratch);

// Whether GemmBlockAmx may run here: this build has it (DROPLESS_CPU_AMX),
// cpuid reports AMX-TILE and AMX-BF16, XCR0 says the OS saves the tile
// state (bits 17 and 18), and Linux granted this process the tile data
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)). Asked once per
// process; false when any step fails, and kAmx is then not offered.
bool AmxUsable();

// Writes zeros to rows [0, m) x [0, n) of out.
void ZeroBlock(int64_t m, int64_t n, Out out);

// Writes rows [0, m) x [0, n) of the float32 sums `acc` (row stride ldc) to
// out, as out.type (bfloat16 rounded to nearest even).
void StoreSums(const float* acc, int64_t ldc, int64_t m, int64_t n, Out out);

}  // namespace dropless_cpu

#endif  // DROPLESS_BACKENDS_CPU_CC_GEMM_H_
