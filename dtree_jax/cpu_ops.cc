// Two small ops that XLA:CPU runs poorly, called through XLA's FFI (dtree_jax/cpu_dot.py builds them with
// cpu_dot.cc and cpu_attention.cc and registers them; the programs whose dense dots run cpu_dot's kernel use them).
//
//   Copy:        out = x, any dtype and shape.  XLA cannot fuse a value through a custom call, so what is computed
//                before one is computed once: RoPE's cos / sin tables, which XLA:CPU would otherwise recompute in
//                every layer's fusion for every head (models.layers.rope_tables).
//   FirstArgmax: out[r] = the first index of the largest value of row r of x [R, V] fp32, or of its first NaN
//                where it has one: jnp.argmax.  XLA:CPU's reductions over a SmolLM2 verify's [9, 49152] logits
//                took about 0.5 ms (verify.first_argmax).

#include <cmath>
#include <cstdint>
#include <cstring>
#include "xla/ffi/api/ffi.h"
#include "cpu_threads.h"

namespace ffi = xla::ffi;

static ffi::Error Copy(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  if (out->size_bytes() != x.size_bytes())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cpu_ops copy: the result's size differs from x's");
  std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

constexpr int kWidth = 16;  // floats compared together
typedef float Floats __attribute__((vector_size(kWidth * sizeof(float)), aligned(4)));  // unaligned loads
typedef int32_t Mask __attribute__((vector_size(kWidth * sizeof(int32_t))));

// The first index of row p[0, n)'s largest value, or of its first NaN; n > 0.
static int32_t first_argmax(const float* p, int64_t n) {
  const int64_t whole = n - n % kWidth;
  Floats top;
  for (int l = 0; l < kWidth; ++l) top[l] = -INFINITY;
  Mask nan = Mask{};
  for (int64_t i = 0; i < whole; i += kWidth) {  // the maximum of the numbers, and whether any NaN was seen
    Floats v = *reinterpret_cast<const Floats*>(p + i);
    nan |= v != v;
    top = v > top ? v : top;
  }
  bool any_nan = false;
  float best = -INFINITY;
  for (int l = 0; l < kWidth; ++l) {
    any_nan |= nan[l] != 0;
    best = top[l] > best ? top[l] : best;
  }
  for (int64_t i = whole; i < n; ++i) {
    any_nan |= std::isnan(p[i]);
    best = p[i] > best ? p[i] : best;
  }
  for (int64_t i = 0; i < n; ++i)  // the first NaN, else the first index that holds the maximum
    if (any_nan ? std::isnan(p[i]) : p[i] == best) return static_cast<int32_t>(i);
  return 0;  // not reached
}

static ffi::Error FirstArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  auto d = x.dimensions();
  if (d.size() == 0 || d.back() == 0 || d.back() > INT32_MAX ||
      out->element_count() * d.back() != x.element_count())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cpu_ops first_argmax: x [..., V] with 0 < V, out [...]");
  const int64_t n = d.back(), rows = out->element_count();
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  auto run = [=](int64_t r) { op[r] = first_argmax(xp + r * n, n); };
  if (pool.num_threads() <= 1 || rows <= 1 || rows * n < (int64_t{1} << 17)) {  // too small to split
    for (int64_t r = 0; r < rows; ++r) run(r);
  } else {
    share_out(pool, rows, run);
  }
  return ffi::Error::Success();
}

// x (any) -> a copy of x
XLA_FFI_DEFINE_HANDLER_SYMBOL(DtreeJaxCopy, Copy, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
// x [..., V] fp32 -> out [...] int32
XLA_FFI_DEFINE_HANDLER_SYMBOL(DtreeJaxFirstArgmax, FirstArgmax,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
