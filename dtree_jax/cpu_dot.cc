// A few-row fp32 dot for XLA:CPU, called through XLA's FFI (dtree_jax/cpu_dot.py builds and registers it).
//
//   out[M, N] = x[M, K] @ w,   w packed as panels [P, K, 64]: panel p holds columns 64p .. 64p + 63 (zero past N).
//
// The panels are fp32, or bf16 (a bf16 weight's own bytes, half the fp32 read; each 32-column chunk's columns
// stored in pairs, see load_weights): a bf16 value widened to fp32 is exact (its bits shifted up 16), so both
// give the same sums, bit for bit.
//
// A panel is read from memory once for up to 12 rows, in blocks of 64 panel rows that groups of up to 6 rows take
// in turn from L1, so 5 or 9 rows cost little more than one: the weights are read once per call, where XLA:CPU's
// dots (YNNPACK) cost 1.4x / 1.9x one row at 5 / 9 rows on our Intel hosts.
// Every output element is the sum over k in order, one FMA per term, whatever M is and whichever rows share a
// call: a row's result never depends on the other rows (tests check it bit for bit), so a verify of N rows
// computes what N one-row steps would.  Columns are split across XLA's intra-op thread pool; the calling thread
// takes work too and waits only for chunks that are running.

#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include "xla/ffi/api/ffi.h"
#include "cpu_threads.h"

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "dtree-jax's CPU dot needs AVX-512F, or AVX2 with FMA"
#endif

namespace ffi = xla::ffi;
constexpr int64_t kPanel = 64;           // columns per panel (the packed layout's last dimension)
constexpr int64_t kPrefetchRows = 64;    // how far ahead (in k) a pass prefetches its panel into L2
constexpr int64_t kBlockRows = 64;       // panel rows (in k) all the rows of a group take in turn
constexpr int kGroupRows = 12;           // rows that share one pass over a panel

// The vector registers: AVX-512 (16 floats) where the compiler targets it, else AVX2 (8 floats).  A group of R
// rows covers Vecs<R> registers of columns per row a pass: the whole 64-column panel with AVX-512 (6 rows x 4
// accumulators + 4 weights + 1 broadcast <= 32 registers).  With AVX2's 16: the whole panel for one row (a
// contiguous stream), half of it for two or three (some weights as FMA memory operands), a quarter for four to six
// (6 x 2 accumulators + 2 weights + 1 broadcast).  bf16 panels widen a 32-column chunk at a time (load_weights),
// so with AVX2 their groups stop at three rows.
#if defined(__AVX512F__)
using Reg = __m512;
#define SIMD(op) _mm512_##op
#else
using Reg = __m256;
#define SIMD(op) _mm256_##op
#endif
constexpr int kWidth = sizeof(Reg) / sizeof(float);
template <typename W>
constexpr int MaxRows() { return kWidth == 8 && !std::is_same_v<W, float> ? 3 : 6; }
template <int R>
constexpr int Vecs() { return kWidth == 16 ? 4 : R == 1 ? 8 : R <= 3 ? 4 : 2; }

// Rows of the next group with `left` rows to go.  AVX2 runs six rows at a quarter panel a pass but fewer at half a
// panel (3 + 2 for five rows: 26 against 29 ms for SmolLM2's dense dots on our 260 MiB-L3 Intel host).
template <typename W>
static inline int group_rows(int64_t left) {
  int rows = static_cast<int>(std::min<int64_t>(MaxRows<W>(), left));
  return kWidth == 8 && rows < 6 ? std::min(rows, 3) : rows;
}

// A pass's kVecs registers of panel values (kVecs * kWidth columns from p) as fp32.  bf16 panels hold each
// 32-column chunk as pairs (column i, column 16 + i), i = 0 .. 15, so one load of 2 * kWidth values gives two
// registers: the pairs' low halves shifted up 16 bits, and their high halves with the low bits cleared (both
// exact, two instructions for 2 * kWidth values).
template <typename W, int kVecs>
static inline void load_weights(const W* p, Reg (&wv)[kVecs]) {
  if constexpr (std::is_same_v<W, float>) {
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) wv[v] = SIMD(loadu_ps)(p + kWidth * v);
  } else {
    constexpr int kChunkVecs = 32 / kWidth;  // registers a 32-column chunk fills: 2 (AVX-512) or 4 (AVX2)
    static_assert(kVecs % kChunkVecs == 0, "bf16 passes widen whole 32-column chunks");
#pragma GCC unroll 8
    for (int c = 0; c < kVecs / kChunkVecs; ++c)
#pragma GCC unroll 8
      for (int j = 0; j < kChunkVecs / 2; ++j) {
        const W* q = p + 32 * c + 2 * kWidth * j;
#if defined(__AVX512F__)
        __m512i pairs = _mm512_loadu_si512(q);
        wv[c * kChunkVecs + j] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        wv[c * kChunkVecs + j + kChunkVecs / 2] =
            _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int(0xFFFF0000u))));
#else
        __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        wv[c * kChunkVecs + j] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        wv[c * kChunkVecs + j + kChunkVecs / 2] =
            _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xFFFF0000u))));
#endif
      }
  }
}

// R rows of x [R, K] against panel rows k0 .. k1 - 1 (a panel [K, 64] of W: float, or uint16_t for bf16); acc
// [R, 64] holds the rows' running sums (read unless k0 == 0, then written back).  The pass prefetches the panel
// kPrefetchRows ahead into L2, one panel row in `every` starting at k0 + `phase`: the groups sharing a block split
// its prefetches, so the memory stays busy while any of them computes.
template <typename W, int R>
static inline void block(const float* x, int64_t K, const W* w, int64_t k0, int64_t k1, float* acc, int every,
                         int phase) {
  constexpr int kVecs = Vecs<R>();
  constexpr int64_t kPassCols = kVecs * kWidth;
  constexpr int kLines = kPassCols * sizeof(W) / 64;  // cache lines of a pass's panel row
  for (int64_t pass = 0; pass < kPanel; pass += kPassCols) {
    Reg a[R][kVecs];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v)
        a[r][v] = k0 == 0 ? SIMD(setzero_ps)() : SIMD(loadu_ps)(acc + r * kPanel + pass + kWidth * v);
    const W* wp = w + k0 * kPanel + pass;
    int countdown = phase;
    for (int64_t k = k0; k < k1; ++k, wp += kPanel) {
      Reg wv[kVecs];
      load_weights(wp, wv);
      if (countdown-- == 0) {
        countdown = every - 1;
#pragma GCC unroll 4
        for (int line = 0; line < kLines; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchRows * kPanel) + 64 * line, _MM_HINT_T1);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        Reg xb = SIMD(set1_ps)(x[r * K + k]);
#pragma GCC unroll 8
        for (int v = 0; v < kVecs; ++v) a[r][v] = SIMD(fmadd_ps)(xb, wv[v], a[r][v]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) SIMD(storeu_ps)(acc + r * kPanel + pass + kWidth * v, a[r][v]);
  }
}

// block<W, g, ...> for a run-time g in 1 .. MaxRows<W>().
template <typename W, int R = MaxRows<W>()>
static inline void block_of(int g, const float* x, int64_t K, const W* w, int64_t k0, int64_t k1, float* acc,
                            int every, int phase) {
  if constexpr (R >= 1) {
    if (g != R) return block_of<W, R - 1>(g, x, K, w, k0, k1, acc, every, phase);
    block<W, R>(x, K, w, k0, k1, acc, every, phase);
  }
}

// All M rows against panels p0 .. p1 - 1.  Up to kGroupRows rows share a panel's pass: a block of kBlockRows
// panel rows (16 KB fp32, 8 KB bf16) is read from memory once, for the first group of them, and from L1 for the
// others, while the groups' prefetches keep the weights streaming from memory (prefetching beats the hardware
// prefetcher alone at every row count, one fp32 row too: 0.74-0.79x YNNPACK's one-row dots against 0.78x without
// with AVX-512, 0.81-0.82x against 0.87-0.91x with AVX2, on our 260 MiB-L3 Intel host).
template <typename W>
static void rows(const float* x, int64_t M, int64_t K, const W* w, float* out, int64_t N, int64_t p0, int64_t p1) {
  alignas(64) float acc[kGroupRows * kPanel];
  for (int64_t p = p0; p < p1; ++p) {
    const W* wp = w + p * K * kPanel;
    int64_t col = p * kPanel, cols = std::min(kPanel, N - col);
    if (cols <= 0) break;  // panels past N (only zeros)
    for (int64_t r0 = 0; r0 < M; r0 += kGroupRows) {
      int64_t m = std::min<int64_t>(kGroupRows, M - r0);
      int sizes[kGroupRows], groups = 0;
      for (int64_t r = 0; r < m; r += sizes[groups++]) sizes[groups] = group_rows<W>(m - r);
      for (int64_t k0 = 0; k0 < K; k0 += kBlockRows) {
        int64_t k1 = std::min(K, k0 + kBlockRows);
        int64_t r = 0;
        for (int j = 0; j < groups; r += sizes[j++])
          block_of(sizes[j], x + (r0 + r) * K, K, wp, k0, k1, acc + r * kPanel, groups, j);
      }
      for (int64_t r = 0; r < m; ++r) std::copy(acc + r * kPanel, acc + r * kPanel + cols, out + (r0 + r) * N + col);
    }
  }
}

template <ffi::DataType kWeights>
static ffi::Error FewRowDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kWeights> w,
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
  const auto* wp = w.typed_data();  // float, or uint16_t (bf16 bits)
  float* op = out->typed_data();
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t per_chunk = std::max<int64_t>(1, P / (4 * threads));
  int64_t chunks = (P + per_chunk - 1) / per_chunk;
  if (threads <= 1 || chunks <= 1 || M * K * P * kPanel < (int64_t{1} << 17)) {  // too small to split
    rows(xp, M, K, wp, op, N, 0, P);
    return ffi::Error::Success();
  }
  share_out(pool, chunks, [=](int64_t i) {
    rows(xp, M, K, wp, op, N, i * per_chunk, std::min(P, (i + 1) * per_chunk));
  });
  return ffi::Error::Success();
}

// One handler per panel dtype: x fp32, panels of kWeights, out fp32.
#define FEW_ROW_DOT_HANDLER(name, kWeights)                                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, FewRowDot<kWeights>, ffi::Ffi::Bind()                           \
                                                               .Ctx<ffi::ThreadPool>()                \
                                                               .Arg<ffi::Buffer<ffi::F32>>()          \
                                                               .Arg<ffi::Buffer<kWeights>>()          \
                                                               .Ret<ffi::Buffer<ffi::F32>>())
FEW_ROW_DOT_HANDLER(DtreeJaxFewRowDot, ffi::F32);
FEW_ROW_DOT_HANDLER(DtreeJaxFewRowDotBf16, ffi::BF16);
