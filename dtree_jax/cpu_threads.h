// Work shared out over XLA's intra-op thread pool, for the CPU kernels (cpu_dot.cc, cpu_attention.cc).
#pragma once

#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include "xla/ffi/api/ffi.h"

// run(u) for u = 0 .. units - 1 over the pool's threads: the calling thread takes units too, then waits only for
// units still running elsewhere.  A task that starts after the call has returned finds no unit left (the progress
// is shared with it).
template <typename Run>
static void share_out(xla::ffi::ThreadPool& pool, int64_t units, Run run) {
  struct Progress {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto work = [=](Progress& s) {
    for (int64_t u; (u = s.next.fetch_add(1)) < units;) {
      run(u);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t t = 1; t < std::min(threads, units); ++t) pool.Schedule([progress, work] { work(*progress); });
  work(*progress);
  while (progress->done.load(std::memory_order_acquire) < units) _mm_pause();  // units running elsewhere
}
