// XLA FFI handlers of the cpu backend: the grouped GEMM and its weight
// gradient, over row groups whose sizes are read here, in the call.
//
//   dropless_cpu_gmm   lhs [M, C] x rhs [E, C, N] ([E, N, C] with the
//                      attribute transpose_rhs) -> out [M, N]; group g owns
//                      rows [sum(gs[:g]), sum(gs[:g + 1])); rows at or past
//                      sum(gs) are written as zeros and never read.
//   dropless_cpu_tgmm  lhs [M, A] x rhs [M, B] -> out [E, A, B], out[g] =
//                      lhs_g^T rhs_g; rows past the groups are never read,
//                      an empty group gives zeros.
//
// Operands float32 or bfloat16 (both of one type), outputs float32 or
// bfloat16, sums in float32. The work is cut into blocks (a row chunk of a
// group times a column block; or a block of one group's gradient) that the
// threads of XLA's CPU thread pool (the FFI's ThreadPool context) and the
// calling thread claim one at a time from a shared counter, so a skewed
// routing still keeps every thread busy. Sizes that are not valid (negative,
// or past M) are clamped here so that nothing is read out of bounds; the
// Python side sanitises them before the call and poisons the result.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "backends/cpu/cc/gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace dropless_cpu {
namespace {

// Block sizes of the work split. Rows per block of the forward: taller
// blocks reuse each packed weight slice more; 256 rows still gives a
// few blocks per group at E=8. Columns per block: two 48-wide panels.
constexpr int64_t kRowsPerBlock = 256;
constexpr int64_t kColsPerBlock = 96;
// The weight gradient's blocks: rows of A per block (the packed B slice,
// depth x 96 columns of one group's rows, is reused across them).
constexpr int64_t kGradRowsPerBlock = 128;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Runs body(i) for i in [0, count) on the calling thread and up to
// pool.num_threads() helpers. Helpers are tasks on XLA's pool; the FFI says
// they may run late, on the caller, or not in parallel at all, so the
// caller claims work too and waits only for blocks already claimed.
// What the last ParallelFor saw, for tests: XLA's pool size, and how many
// threads (the caller included) ran at least one block.
std::atomic<int64_t> last_pool_threads{-1};
std::atomic<int64_t> last_workers{0};

void ParallelFor(ffi::ThreadPool& pool, int64_t count,
                 const std::function<void(int64_t)>& body) {
  if (count <= 0) return;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<int64_t> workers{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t count = 0;
    const std::function<void(int64_t)>* body = nullptr;
  };
  auto state = std::make_shared<State>();
  state->count = count;
  state->body = &body;
  auto work = [](State* s) {
    int64_t finished = 0;
    for (int64_t i; (i = s->next.fetch_add(1)) < s->count;) {
      (*s->body)(i);
      ++finished;
    }
    if (finished > 0) s->workers.fetch_add(1);
    if (finished > 0 &&
        s->done.fetch_add(finished) + finished == s->count) {
      std::lock_guard<std::mutex> lock(s->mu);
      s->cv.notify_all();
    }
  };
  const int64_t pool_threads = pool.num_threads();
  // The caller works too: pool size - 1 helpers keep one thread per pool
  // thread (the pool is sized to the cores), not one more.
  const int64_t helpers =
      std::min<int64_t>(std::max<int64_t>(pool_threads - 1, 0), count - 1);
  for (int64_t h = 0; h < helpers; ++h) {
    // The shared_ptr keeps the state alive for a helper that starts after
    // the call has returned; it then finds no work and never reads `body`.
    pool.Schedule([state, work]() { work(state.get()); });
  }
  work(state.get());
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == count; });
  last_pool_threads.store(pool_threads);
  last_workers.store(state->workers.load());
}

// E [A, B] gradients are often a fresh buffer of 100+ MiB that XLA's
// allocator maps for this call: asking for 2 MiB pages before the first
// write turns one page fault per 4 KiB into one per 2 MiB. Advice only: the
// kernel may ignore it, and pages already mapped keep their size.
void AdviseHugePages(void* data, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 4 * kHuge) return;
  const uintptr_t begin =
      (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) &
                        ~(kHuge - 1);
  if (end > begin) {
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
}

ffi::Error TypeOf(ffi::DataType dtype, const char* what, Type* type) {
  if (dtype == ffi::DataType::F32) {
    *type = Type::kF32;
  } else if (dtype == ffi::DataType::BF16) {
    *type = Type::kBF16;
  } else {
    return ffi::Error::InvalidArgument(std::string(what) +
                                       " must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

// What both handlers check first: lhs, rhs and out each float32 or
// bfloat16 (else an error naming the first that is not), then lhs and rhs
// of one type and of ranks 2 and rhs_rank, out of rank out_rank (else
// InvalidArgument(layout)). Sets *in (lhs's type) and *out_type.
ffi::Error CheckOperands(const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
                         const ffi::AnyBuffer& out, size_t rhs_rank,
                         size_t out_rank, const char* layout, Type* in,
                         Type* out_type) {
  Type rhs_type;
  if (auto e = TypeOf(lhs.element_type(), "lhs", in); e.failure()) return e;
  if (auto e = TypeOf(rhs.element_type(), "rhs", &rhs_type); e.failure()) {
    return e;
  }
  if (auto e = TypeOf(out.element_type(), "out", out_type); e.failure()) {
    return e;
  }
  if (*in != rhs_type || lhs.dimensions().size() != 2 ||
      rhs.dimensions().size() != rhs_rank ||
      out.dimensions().size() != out_rank) {
    return ffi::Error::InvalidArgument(layout);
  }
  return ffi::Error::Success();
}

inline size_t Width(Type type) { return type == Type::kF32 ? 4 : 2; }

// Group offsets from the sizes: starts[g], and the rows in groups (sizes
// clamped to [0, rows - start] so that no group reaches past the rows).
int64_t GroupStarts(ffi::Buffer<ffi::S32> group_sizes, int64_t rows,
                    std::vector<int64_t>* starts,
                    std::vector<int64_t>* sizes) {
  const int64_t groups = group_sizes.element_count();
  const int32_t* gs = group_sizes.typed_data();
  starts->resize(groups);
  sizes->resize(groups);
  int64_t at = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = std::min<int64_t>(std::max<int32_t>(gs[g], 0),
                                           rows - at);
    (*starts)[g] = at;
    (*sizes)[g] = size;
    at += size;
  }
  return at;
}

ffi::Error GmmImpl(ffi::ThreadPool pool, ffi::AnyBuffer lhs,
                   ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                   ffi::Result<ffi::AnyBuffer> out, bool transpose_rhs) {
  Type in, out_type;
  if (auto e = CheckOperands(
          lhs, rhs, *out, 3, 2,
          "dropless_cpu_gmm: lhs [M, C] and rhs [E, C, N] of one type", &in,
          &out_type);
      e.failure()) {
    return e;
  }
  const auto ld = lhs.dimensions();
  const auto rd = rhs.dimensions();
  const auto od = out->dimensions();
  const int64_t m = ld[0], c = ld[1], e = rd[0];
  const int64_t n = transpose_rhs ? rd[1] : rd[2];
  if ((transpose_rhs ? rd[2] : rd[1]) != c || od[0] != m || od[1] != n ||
      static_cast<int64_t>(group_sizes.element_count()) != e) {
    return ffi::Error::InvalidArgument(
        "dropless_cpu_gmm: shapes do not match");
  }
  std::vector<int64_t> starts, sizes;
  const int64_t used = GroupStarts(group_sizes, m, &starts, &sizes);
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  const size_t in_width = Width(in), out_width = Width(out_type);
  char* out_data = static_cast<char*>(out->untyped_data());
  // Rows past the groups: zeros, whatever lhs holds there.
  std::fill(out_data + used * n * out_width, out_data + m * n * out_width, 0);

  struct Block {
    int64_t group, row, rows, col;
  };
  std::vector<Block> blocks;
  for (int64_t g = 0; g < e; ++g) {
    if (sizes[g] == 0) continue;
    // Even chunks of at most kRowsPerBlock rows, multiples of 8.
    const int64_t chunks = CeilDiv(sizes[g], kRowsPerBlock);
    const int64_t chunk = CeilDiv(CeilDiv(sizes[g], chunks), 8) * 8;
    for (int64_t col = 0; col < n; col += kColsPerBlock) {
      for (int64_t r = 0; r < sizes[g]; r += chunk) {
        blocks.push_back({g, starts[g] + r, std::min(chunk, sizes[g] - r),
                          col});
      }
    }
  }
  const char* lhs_data = static_cast<const char*>(lhs.untyped_data());
  const char* rhs_data = static_cast<const char*>(rhs.untyped_data());
  ParallelFor(pool, blocks.size(), [&](int64_t i) {
    thread_local Scratch scratch;
    const Block& b = blocks[i];
    const int64_t cols = std::min(kColsPerBlock, n - b.col);
    const char* w = rhs_data + b.group * c * n * in_width;
    View a{lhs_data + b.row * c * in_width, c, 1};
    // Weight (k, j): w[k][col + j], or w[col + j][k] transposed.
    View wv = transpose_rhs ? View{w + b.col * c * in_width, 1, c}
                            : View{w + b.col * in_width, n, 1};
    Out o{out_data + (b.row * n + b.col) * out_width, n, out_type};
    GemmBlock(in, b.rows, cols, c, a, wv, o, &scratch);
  });
  return ffi::Error::Success();
}

ffi::Error TgmmImpl(ffi::ThreadPool pool, ffi::AnyBuffer lhs,
                    ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                    ffi::Result<ffi::AnyBuffer> out) {
  // Also the message of the row check below.
  constexpr char kLayout[] =
      "dropless_cpu_tgmm: lhs [M, A] and rhs [M, B] of one type";
  Type in, out_type;
  if (auto e = CheckOperands(lhs, rhs, *out, 2, 3, kLayout, &in, &out_type);
      e.failure()) {
    return e;
  }
  const auto ld = lhs.dimensions();
  const auto rd = rhs.dimensions();
  const auto od = out->dimensions();
  if (ld[0] != rd[0]) return ffi::Error::InvalidArgument(kLayout);
  const int64_t m = ld[0], a_width = ld[1], b_width = rd[1], e = od[0];
  if (od[1] != a_width || od[2] != b_width ||
      static_cast<int64_t>(group_sizes.element_count()) != e) {
    return ffi::Error::InvalidArgument(
        "dropless_cpu_tgmm: shapes do not match");
  }
  std::vector<int64_t> starts, sizes;
  GroupStarts(group_sizes, m, &starts, &sizes);
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  const size_t in_width = Width(in), out_width = Width(out_type);
  const int64_t row_blocks = CeilDiv(a_width, kGradRowsPerBlock);
  const int64_t col_blocks = CeilDiv(b_width, kColsPerBlock);
  const int64_t per_group = row_blocks * col_blocks;
  const char* lhs_data = static_cast<const char*>(lhs.untyped_data());
  const char* rhs_data = static_cast<const char*>(rhs.untyped_data());
  char* out_data = static_cast<char*>(out->untyped_data());
  ParallelFor(pool, e * per_group, [&](int64_t i) {
    thread_local Scratch scratch;
    const int64_t g = i / per_group;
    const int64_t row = (i % per_group) / col_blocks * kGradRowsPerBlock;
    const int64_t col = (i % col_blocks) * kColsPerBlock;
    const int64_t rows = std::min(kGradRowsPerBlock, a_width - row);
    const int64_t cols = std::min(kColsPerBlock, b_width - col);
    const int64_t start = starts[g];
    // A(i, k) = lhs[start + k][row + i]: the group's rows transposed.
    View a{lhs_data + (start * a_width + row) * in_width, 1, a_width};
    View b{rhs_data + (start * b_width + col) * in_width, b_width, 1};
    // Streamed: E of these [A, B] blocks go straight to memory.
    Out o{out_data + ((g * a_width + row) * b_width + col) * out_width,
          b_width, out_type, /*stream=*/true};
    GemmBlock(in, rows, cols, sizes[g], a, b, o, &scratch);
  });
  return ffi::Error::Success();
}

// The FFI signature both handlers share: XLA's thread pool, then
// (lhs, rhs, group_sizes) -> out; the forward adds its attribute.
auto GroupedBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::AnyBuffer>();
}

}  // namespace
}  // namespace dropless_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DroplessCpuGmm, dropless_cpu::GmmImpl,
    dropless_cpu::GroupedBinding().Attr<bool>("transpose_rhs"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessCpuTgmm, dropless_cpu::TgmmImpl,
                              dropless_cpu::GroupedBinding());

// For the Python loader and the logs: the kernels GemmBlock runs on this CPU
// ("amx", "avx512-bf16", "avx512", "avx2", "portable" or the test-only
// "amx-emulated"; gemm.h says what each covers), and the best this CPU
// could run.
extern "C" __attribute__((visibility("default"))) const char*
DroplessCpuKernels() {
  return dropless_cpu::KernelsName(dropless_cpu::SelectedKernels());
}

extern "C" __attribute__((visibility("default"))) const char*
DroplessCpuBestKernels() {
  return dropless_cpu::KernelsName(dropless_cpu::CpuKernels());
}

// Selects the set called `name` for the calls that follow, as
// DROPLESS_CPU_KERNELS does at the first call (never past what the CPU
// runs: the CPU's best for a set it lacks or an unknown name; the
// emulation "amx-emulated" runs on every CPU); returns the selection's
// name. For tests, which check every set of the CPU in one process.
extern "C" __attribute__((visibility("default"))) const char*
DroplessCpuUseKernels(const char* name) {
  return dropless_cpu::KernelsName(dropless_cpu::UseKernels(name));
}

// The jaxlib whose FFI headers this library was compiled against (the
// build passes DROPLESS_JAXLIB_VERSION), and the headers' FFI API version as
// major * 1000 + minor. XLA accepts handlers of its own API version or
// older, and refuses newer ones (for every target, at CPU client start), so
// the loader registers nothing when the running jaxlib is older.
#ifndef DROPLESS_JAXLIB_VERSION
#define DROPLESS_JAXLIB_VERSION ""
#endif

extern "C" __attribute__((visibility("default"))) const char*
DroplessCpuBuiltForJaxlib() {
  return DROPLESS_JAXLIB_VERSION;
}

extern "C" __attribute__((visibility("default"))) int64_t
DroplessCpuFfiApiVersion() {
  return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR;
}

// For tests: XLA's thread-pool size seen by the last call (-1 before any),
// and how many threads ran its blocks.
extern "C" __attribute__((visibility("default"))) int64_t
DroplessCpuLastPoolThreads() {
  return dropless_cpu::last_pool_threads.load();
}

extern "C" __attribute__((visibility("default"))) int64_t
DroplessCpuLastWorkers() {
  return dropless_cpu::last_workers.load();
}
