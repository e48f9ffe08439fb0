// y[M, N] = x[M, K] . w[N, K]^T in float32 for XLA's CPU backend: the products of decoding, a few rows of
// activations against weights held [out, in] (meshtrain/kernels/cpu_matmul.py, OutInProducts) and streamed from
// memory.
//
// Why a kernel of our own: XLA's CPU dot runs [8, 768] x [50304, 768]^T (the 125m model's output projection at
// batch 8) at ~23 GFLOP/s, ~3x the time it takes to read the weight once. Here each tile of 3 weight rows is read
// from memory once, prefetched one tile ahead, and used against every activation row from L1 (register tiles of
// activation rows x 3 weight rows: with AVX-512's 32 vector registers 8 x 3 accumulators of 16 floats, so decoding's
// batch of 8 is one pass; with AVX2's 16, 4 x 3 of 8 floats). Rows of the output are split over XLA's own intra-op
// thread pool. Built by meshtrain/kernels/cpu_matmul.py on first use, for the machine it runs on (-march=native).
#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16, kRows = 8;  // 24 accumulators + 3 weight vectors + 1 activation vector of 32 registers
#else
constexpr int kLanes = 8, kRows = 4;   // 12 + 3 + 1 of AVX2's 16 (on ARM, pairs of NEON registers)
#endif
// kLanes floats; GCC/Clang vector extension. aligned(4): rows of any length.
typedef float vec __attribute__((vector_size(4 * kLanes), aligned(4)));

inline float HorizontalSum(vec v) {
  float s = 0;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Output rows m..m+R, columns n..n+C.
template <int R, int C>
inline void Tile(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t m, int64_t n) {
  vec acc[R][C] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vec w_C[C];
    for (int c = 0; c < C; ++c) {
      // The same place in the next tile of weight rows: one tile ahead, so memory stays busy while this one computes.
      __builtin_prefetch(w + (n + c + C) * K + k, 0, 0);
      w_C[c] = *reinterpret_cast<const vec*>(w + (n + c) * K + k);
    }
    for (int r = 0; r < R; ++r) {
      vec x_r = *reinterpret_cast<const vec*>(x + (m + r) * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] += x_r * w_C[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = HorizontalSum(acc[r][c]);
      for (int64_t kk = k; kk < K; ++kk) s += x[(m + r) * K + kk] * w[(n + c) * K + kk];
      y[(m + r) * N + n + c] = s;
    }
  }
}

// The last `rows` (fewer than kRows) rows of x: Tile<rows, C>.
template <int R, int C>
inline void LastRows(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t m, int64_t n, int64_t rows) {
  if (rows == R) {
    Tile<R, C>(x, w, y, N, K, m, n);
  } else if constexpr (R > 1) {
    LastRows<R - 1, C>(x, w, y, N, K, m, n, rows);
  }
}

template <int C>
inline void Columns(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) Tile<kRows, C>(x, w, y, N, K, m, n);
  if (m < M) LastRows<kRows - 1, C>(x, w, y, N, K, m, n, M - m);
}

void Range(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 3 <= n1; n += 3) Columns<3>(x, w, y, M, N, K, n);
  for (; n < n1; ++n) Columns<1>(x, w, y, M, N, K, n);
}

ffi::Future MatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  const float* x_MK = x.typed_data();
  const float* w_NK = w.typed_data();
  float* y_MN = y->typed_data();
  // At least ~64 KB of weights per task: below that, handing work to another thread costs more than it saves.
  const int64_t min_rows = std::max<int64_t>(1, (64 << 10) / (4 * std::max<int64_t>(K, 1)));
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1),
                                                               N / min_rows));
  ffi::CountDownPromise done(tasks);
  ffi::Future future(done);
  auto run = [=](int64_t t) mutable {
    Range(x_MK, w_NK, y_MN, M, N, K, N * t / tasks, N * (t + 1) / tasks);
    done.CountDown();
  };
  for (int64_t t = 1; t < tasks; ++t) pool.Schedule([run, t]() mutable { run(t); });
  run(0);
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshtrainMatmulNT, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
