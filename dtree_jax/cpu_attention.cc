// Tree attention for XLA:CPU, called through XLA's FFI (dtree_jax/cpu_dot.py builds it with cpu_dot.cc and
// registers it; models.layers.attend calls it in programs whose dense dots run cpu_dot's kernel).
//
//   out[B, T, H, D] = softmax(scale * q k^T over the visible rows) v,   k / v: the cache [B, S, Hkv, D]
//
// Query t of request b sees the committed rows [0, lens[b]) and the new rows lens[b] + j with mask[b, t, j]
// (the T new tokens are already written at [lens, lens + T)): pallas_kernels.tree_attention's
// reference_tree_attention without `window`: q fp32, the cache fp32 or bf16 (widened to fp32 as it is read, exact;
// with a bf16 cache the probabilities are normalised and rounded to bf16 before the weighted sum, as the
// reference's bf16 matmul takes them).  One call does a whole layer: XLA's version is about ten ops a
// layer, with the cache transposed for its dots (about 0.4 ms a layer for a 9-node verify of SmolLM2 on our
// 2-core Intel hosts, a fifth of a round).
//
// A query's result depends on its visible rows' values and their order alone: the rows are gathered in cache
// order, each score is a dot in a fixed order, and the softmax runs over the gathered list.  A tree node whose
// ancestors sit in cache order therefore gets, bit for bit, what one-token steps along its path get.  The g = H /
// Hkv query heads that share a kv head read each cache row once; the (query, kv head) pairs are split across XLA's
// intra-op thread pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "xla/ffi/api/ffi.h"
#include "cpu_threads.h"

namespace ffi = xla::ffi;
constexpr int kLanes = 8;       // a dot's partial sums (D must be a multiple)
constexpr int kMaxGroup = 16;   // query heads per kv head

constexpr int kKeys = 8;        // keys scored together (independent sums in flight)
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));  // kLanes floats, unaligned
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2)));  // kLanes bf16 values
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

// kLanes cache values from p as fp32: float, or uint16_t holding bf16 bits (shifted up 16: exact).
static inline Lanes load_lanes(const float* p) { return *reinterpret_cast<const Lanes*>(p); }
static inline Lanes load_lanes(const uint16_t* p) {
  return (Lanes)(__builtin_convertvector(*reinterpret_cast<const Halves*>(p), Ints) << 16);
}

// x rounded to the nearest bf16 (ties to even), kept as fp32; x finite.
static inline float round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// out[j] = scale * sum_d q[d] key_j[d] for the m <= kKeys rows key_j = k + rows[j] * stride, each in a fixed order
// (kLanes partial sums over d, then a fixed tree), the same for a row whichever others share the call.
template <typename KV>
static inline void scores(const float* q, const KV* k, const int32_t* rows, int m, int64_t stride, int64_t d,
                          float scale, float* out) {
  Lanes acc[kKeys];
  const KV* key[kKeys];
#pragma GCC unroll 8
  for (int j = 0; j < kKeys; ++j) {
    acc[j] = Lanes{};
    key[j] = k + rows[std::min(j, m - 1)] * stride;
  }
  for (int64_t i = 0; i < d; i += kLanes) {
    Lanes qi = *reinterpret_cast<const Lanes*>(q + i);
#pragma GCC unroll 8
    for (int j = 0; j < kKeys; ++j) acc[j] += qi * load_lanes(key[j] + i);
  }
  for (int j = 0; j < m; ++j) {
    const Lanes& a = acc[j];
    out[j] = (((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))) * scale;
  }
}

constexpr int kChunk = 64;      // output columns summed together (kChunk / kLanes sums in flight)

// out[c] = inv * sum_i w[i] v_i[c] for c < cols <= kChunk (a multiple of kLanes), v_i = v + rows[i] * stride: each
// a sum over i in order.
template <typename KV>
static inline void weighted_sum(const float* w, const KV* v, const int32_t* rows, int64_t n, int64_t stride,
                                float inv, float* out, int64_t cols) {
  constexpr int kVecs = kChunk / kLanes;
  Lanes acc[kVecs];
#pragma GCC unroll 8
  for (int c = 0; c < kVecs; ++c) acc[c] = Lanes{};
  if (cols == kChunk) {
    for (int64_t i = 0; i < n; ++i) {
      const KV* vi = v + rows[i] * stride;
#pragma GCC unroll 8
      for (int c = 0; c < kVecs; ++c) acc[c] += w[i] * load_lanes(vi + kLanes * c);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const KV* vi = v + rows[i] * stride;
      for (int c = 0; c < cols / kLanes; ++c) acc[c] += w[i] * load_lanes(vi + kLanes * c);
    }
  }
  for (int c = 0; c < cols / kLanes; ++c) *reinterpret_cast<Lanes*>(out + kLanes * c) = acc[c] * inv;
}

// x[i] = exp(x[i]) for x[i] <= 0 (scores less their maximum), within about one ulp: Cody-Waite reduction by
// ln 2 and Cephes' expf polynomial, branch-free so the compiler vectorises it.
static inline void exp_nonpositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float v = std::max(x[i], -87.0f);
    float k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // nearest integer to v / ln 2
    float r = (v - k * 0.693359375f) + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k
    float two_k;
    std::memcpy(&two_k, &bits, sizeof two_k);
    x[i] = (p * (r * r) + r + 1.0f) * two_k;
  }
}

struct Shapes {
  int64_t B, T, H, D, S, Hkv, G;
};

// Query t of request b, the G query heads of kv head kv: out = softmax(scale q k^T over its visible rows) v.
template <typename KV>
static void attend_one(const Shapes& z, const float* q, const KV* k, const KV* v, const int32_t* lens,
                       const bool* mask, float scale, float* out, int64_t b, int64_t t, int64_t kv) {
  thread_local std::vector<int32_t> rows;  // the visible cache rows, in cache order
  thread_local std::vector<float> p;       // [G, rows] scores, then unnormalised probabilities
  const int64_t S = z.S, G = z.G, D = z.D, T = z.T;
  rows.resize(S);
  p.resize(G * S);
  int64_t len = std::clamp<int64_t>(lens[b], 0, S), n = 0;
  for (int64_t s = 0; s < len; ++s) rows[n++] = static_cast<int32_t>(s);
  for (int64_t j = 0; j < T && len + j < S; ++j)
    if (mask[(b * T + t) * T + j]) rows[n++] = static_cast<int32_t>(len + j);
  const float* qg = q + ((b * T + t) * z.H + kv * G) * D;
  const KV* kb = k + (b * S * z.Hkv + kv) * D;  // row r of kv head kv: kb + r * Hkv * D
  for (int64_t i = 0; i < n; i += kKeys)
    for (int64_t g = 0; g < G; ++g)
      scores(qg + g * D, kb, rows.data() + i, static_cast<int>(std::min<int64_t>(kKeys, n - i)), z.Hkv * D, D, scale,
             p.data() + g * S + i);
  float inv[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p.data() + g * S;
    float top = -INFINITY;
    for (int64_t i = 0; i < n; ++i) top = std::max(top, pg[i]);
    for (int64_t i = 0; i < n; ++i) pg[i] -= top;
    exp_nonpositive(pg, n);
    float lanes[kLanes] = {};  // kLanes partial sums, then a fixed tree
    int64_t whole = n - n % kLanes;
    for (int64_t i = 0; i < whole; i += kLanes)
#pragma GCC unroll 8
      for (int l = 0; l < kLanes; ++l) lanes[l] += pg[i + l];
    for (int64_t i = whole; i < n; ++i) lanes[i - whole] += pg[i];
    float total = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    inv[g] = n > 0 ? 1.0f / total : 0.0f;  // a query with nothing visible gets zeros
    if constexpr (std::is_same_v<KV, uint16_t>) {  // bf16 probabilities, as the reference's bf16 matmul takes them
      for (int64_t i = 0; i < n; ++i) pg[i] = round_bf16(pg[i] * inv[g]);
      inv[g] = n > 0 ? 1.0f : 0.0f;
    }
  }
  const KV* vb = v + (b * S * z.Hkv + kv) * D;  // row r of kv head kv: vb + r * Hkv * D
  float* o = out + ((b * T + t) * z.H + kv * G) * D;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < D; c += kChunk) weighted_sum(p.data() + g * S, vb + c, rows.data(), n, z.Hkv * D,
                                                          inv[g], o + g * D + c, std::min<int64_t>(kChunk, D - c));
}

template <ffi::DataType kCache>
static ffi::Error TreeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<kCache> k,
                                ffi::Buffer<kCache> v, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::PRED> mask,
                                float scale, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 3)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cpu_attention: q [B, T, H, D], k / v [B, S, Hkv, D]");
  Shapes z{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], 0};
  bool same_kv = vd[0] == kd[0] && vd[1] == z.S && vd[2] == z.Hkv && vd[3] == kd[3];
  if (kd[0] != z.B || kd[3] != z.D || !same_kv || z.Hkv == 0 || z.H % z.Hkv != 0 || z.H / z.Hkv > kMaxGroup ||
      z.D % kLanes != 0 || lens.element_count() != z.B || md[0] != z.B || md[1] != z.T || md[2] != z.T)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "cpu_attention: q [B, T, H, D], k / v [B, S, Hkv, D] (H / Hkv <= 16, D % 8 == 0), lens [B], "
                      "mask [B, T, T]");
  z.G = z.H / z.Hkv;
  const float* qp = q.typed_data();
  const auto *kp = k.typed_data(), *vp = v.typed_data();  // float, or uint16_t (bf16 bits)
  const int32_t* lp = lens.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  int64_t units = z.B * z.T * z.Hkv;  // (b, t, kv), kv fastest
  auto run = [=](int64_t u) {
    attend_one(z, qp, kp, vp, lp, mp, scale, op, u / (z.T * z.Hkv), u / z.Hkv % z.T, u % z.Hkv);
  };
  if (pool.num_threads() <= 1 || units <= 1 || units * z.S * z.H * z.D < (int64_t{1} << 16)) {  // too small to split
    for (int64_t u = 0; u < units; ++u) run(u);
  } else {
    share_out(pool, units, run);
  }
  return ffi::Error::Success();
}

// One handler per cache dtype: q fp32, k / v fp32 or bf16, out fp32.
#define TREE_ATTENTION_HANDLER(name, kCache)                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, TreeAttention<kCache>, ffi::Ffi::Bind()                       \
                                                                 .Ctx<ffi::ThreadPool>()            \
                                                                 .Arg<ffi::Buffer<ffi::F32>>()      \
                                                                 .Arg<ffi::Buffer<kCache>>()        \
                                                                 .Arg<ffi::Buffer<kCache>>()        \
                                                                 .Arg<ffi::Buffer<ffi::S32>>()      \
                                                                 .Arg<ffi::Buffer<ffi::PRED>>()     \
                                                                 .Attr<float>("scale")              \
                                                                 .Ret<ffi::Buffer<ffi::F32>>())
// q [B, T, H, D], k / v [B, S, Hkv, D], lens [B], mask [B, T, T] -> out [B, T, H, D]
TREE_ATTENTION_HANDLER(DtreeJaxTreeAttention, ffi::F32);
TREE_ATTENTION_HANDLER(DtreeJaxTreeAttentionBf16, ffi::BF16);
