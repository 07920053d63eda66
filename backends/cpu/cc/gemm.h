// The GEMM core of the cpu backend: one block of C = A B, AVX-512.
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
#include <memory>

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

// The kernels a call can run, fastest first. Which ones this CPU can run
// is found once, at run time (cpuid), so one build serves every x86-64 CPU
// and never executes an instruction the CPU lacks:
//   kAvx512Bf16  AVX-512 F/BW/VL + FMA + AVX512_BF16 (Zen 4, Sapphire
//                Rapids): float32 and bfloat16 operands and outputs.
//   kAvx512      the same without AVX512_BF16 (Skylake-X, Ice Lake): float32
//                operands and outputs only; bfloat16 goes to kPortable.
//   kPortable    C++ with GCC vector types, compiled for baseline x86-64 and
//                cloned for x86-64-v3 (AVX2 + FMA) where the compiler can;
//                any other architecture gets the plain build.
enum class Kernels { kPortable, kAvx512, kAvx512Bf16 };

// The best kernels this CPU runs, lowered by the environment variable
// DROPLESS_CPU_KERNELS ("portable" or "avx512"; never raised past what the
// CPU has). Read once per process.
Kernels SelectedKernels();

// "avx512-bf16", "avx512" or "portable".
const char* KernelsName(Kernels kernels);

// out[i, j] = sum_{k < depth} a(i, k) * b(k, j) for i < m, j < n, summed in
// float32 and written as out.type (bfloat16 rounded to nearest even). a and
// b are of type `in`. depth == 0 writes zeros. Never reads a or b outside
// i < m, j < n, k < depth. Runs the best of SelectedKernels() that handles
// these types.
void GemmBlock(Type in, int64_t m, int64_t n, int64_t depth, View a, View b,
               Out out, Scratch* scratch);

// The same, by one implementation: GemmBlockAvx512 only where
// SelectedKernels() allows it (it is absent off x86-64).
void GemmBlockAvx512(Type in, int64_t m, int64_t n, int64_t depth, View a,
                     View b, Out out, Scratch* scratch);
void GemmBlockPortable(Type in, int64_t m, int64_t n, int64_t depth, View a,
                       View b, Out out, Scratch* scratch);

// Writes zeros to rows [0, m) x [0, n) of out.
void ZeroBlock(int64_t m, int64_t n, Out out);

}  // namespace dropless_cpu

#endif  // DROPLESS_BACKENDS_CPU_CC_GEMM_H_
