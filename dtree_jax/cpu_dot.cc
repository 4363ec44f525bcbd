// A few-row fp32 dot for XLA:CPU, called through XLA's FFI (dtree_jax/cpu_dot.py builds and registers it).
//
//   out[M, N] = x[M, K] @ w,   w packed as panels [P, K, 64]: panel p holds columns 64p .. 64p + 63 (zero past N).
//
// A panel is read once for up to 6 rows (AVX-512; 3 with AVX2) and stays in L2 for the next rows, so 5 or 9 rows
// cost little more than one: the weights are read once per call, where XLA:CPU's dots (YNNPACK) cost 1.4x / 1.9x
// one row at 5 / 9 rows on our Intel hosts.  Every output element is the sum over k in order, one FMA per term,
// whatever M is and whichever rows share a call: a row's result never depends on the other rows (tests check it
// bit for bit), so a verify of N rows computes what N one-row steps would.  Columns are split across XLA's
// intra-op thread pool; the calling thread takes work too and waits only for chunks that are running.

#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "dtree-jax's CPU dot needs AVX-512F, or AVX2 with FMA"
#endif

namespace ffi = xla::ffi;
constexpr int64_t kPanel = 64;           // columns per panel (the packed layout's last dimension)
constexpr int64_t kPrefetchRows = 256;   // how far ahead (in k) a multi-row pass prefetches its panel into L2

// The vector registers: AVX-512 (16 floats) where the compiler targets it, else AVX2 (8 floats).  A pass covers
// Vecs<R> registers of columns per row: the whole 64-column panel with AVX-512; with AVX2 (16 registers) the whole
// panel for one row (a contiguous stream) and half of it for two or three.
#if defined(__AVX512F__)
using Reg = __m512;
#define SIMD(op) _mm512_##op
constexpr int kMaxRows = 6;  // 6 rows x 4 accumulators + 4 weights + 1 broadcast <= 32 registers
#else
using Reg = __m256;
#define SIMD(op) _mm256_##op
constexpr int kMaxRows = 3;  // 3 rows x 4 accumulators + 1 broadcast + weights, some as FMA memory operands
#endif
constexpr int kWidth = sizeof(Reg) / sizeof(float);
template <int R>
constexpr int Vecs() { return kWidth == 8 && R == 1 ? 8 : 4; }

// R rows of x [R, K] against one panel [K, 64]; `out` [R, N] gets columns col .. min(col + 64, N) - 1.
template <int R>
static inline void panel(const float* x, int64_t K, const float* w, float* out, int64_t N, int64_t col) {
  constexpr int kVecs = Vecs<R>();
  constexpr int64_t kPassCols = kVecs * kWidth;
  for (int64_t pass = 0; pass < kPanel; pass += kPassCols) {
    Reg acc[R][kVecs];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) acc[r][v] = SIMD(setzero_ps)();
    const float* wp = w + pass;
    for (int64_t k = 0; k < K; ++k, wp += kPanel) {
      Reg wv[kVecs];
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) wv[v] = SIMD(loadu_ps)(wp + kWidth * v);
      if (R >= 2) {  // one row keeps up with the hardware prefetcher; more rows fall behind it
#pragma GCC unroll 4
        for (int line = 0; line < kPassCols / 16; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchRows * kPanel + 16 * line), _MM_HINT_T1);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        Reg xb = SIMD(set1_ps)(x[r * K + k]);
#pragma GCC unroll 8
        for (int v = 0; v < kVecs; ++v) acc[r][v] = SIMD(fmadd_ps)(xb, wv[v], acc[r][v]);
      }
    }
    int64_t first = col + pass;
    if (first >= N) return;
    if (first + kPassCols <= N) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int v = 0; v < kVecs; ++v) SIMD(storeu_ps)(out + r * N + first + kWidth * v, acc[r][v]);
    } else {
      alignas(64) float tmp[kPassCols];
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < kVecs; ++v) SIMD(storeu_ps)(tmp + kWidth * v, acc[r][v]);
        for (int64_t c = first; c < N; ++c) out[r * N + c] = tmp[c - first];
      }
    }
  }
}

// All M rows against panels p0 .. p1 - 1, in row groups of up to kMaxRows per panel.
static void rows(const float* x, int64_t M, int64_t K, const float* w, float* out, int64_t N, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* wp = w + p * K * kPanel;
    int64_t col = p * kPanel, r = 0;
    for (; M - r >= kMaxRows; r += kMaxRows) panel<kMaxRows>(x + r * K, K, wp, out + r * N, N, col);
    switch (M - r) {
      case 5: panel<5>(x + r * K, K, wp, out + r * N, N, col); break;
      case 4: panel<4>(x + r * K, K, wp, out + r * N, N, col); break;
      case 3: panel<3>(x + r * K, K, wp, out + r * N, N, col); break;
      case 2: panel<2>(x + r * K, K, wp, out + r * N, N, col); break;
      case 1: panel<1>(x + r * K, K, wp, out + r * N, N, col); break;
      default: break;
    }
  }
}

// Chunks of panels handed out to the threads; shared with tasks that may start after the call has returned.
struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

static ffi::Error FewRowDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                             ffi::ResultBuffer<ffi::F32> out) {
  auto wd = w.dimensions();
  auto od = out->dimensions();
  if (wd.size() != 3 || wd[2] != kPanel || od.size() < 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cpu_dot: weights must be panels [P, K, 64]");
  int64_t P = wd[0], K = wd[1], N = od[od.size() - 1];
  if (K == 0 || x.element_count() % K != 0 || N > P * kPanel || out->element_count() != x.element_count() / K * N)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cpu_dot: x [..., K], panels [P, K, 64], out [..., N <= 64P]");
  int64_t M = x.element_count() / K;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t per_chunk = std::max<int64_t>(1, P / (4 * threads));
  int64_t chunks = (P + per_chunk - 1) / per_chunk;
  if (threads <= 1 || chunks <= 1 || M * K * P * kPanel < (int64_t{1} << 17)) {  // too small to split
    rows(xp, M, K, wp, op, N, 0, P);
    return ffi::Error::Success();
  }
  auto progress = std::make_shared<Progress>();
  auto work = [=](Progress& s) {
    for (int64_t i; (i = s.next.fetch_add(1)) < chunks;) {
      rows(xp, M, K, wp, op, N, i * per_chunk, std::min(P, (i + 1) * per_chunk));
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min(threads, chunks); ++t) pool.Schedule([progress, work] { work(*progress); });
  work(*progress);
  while (progress->done.load(std::memory_order_acquire) < chunks) _mm_pause();  // chunks running elsewhere
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DtreeJaxFewRowDot, FewRowDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
