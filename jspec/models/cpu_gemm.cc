// Small-M matrix products for XLA:CPU, called through the XLA FFI (jspec/models/cpu_gemm.py).
//
//   out f32[..., M, F] = x f32[..., M, D] @ w[..., D, F]      ("nn": w is (in, out))
//   out f32[..., M, F] = x f32[..., M, D] @ w[..., F, D]^T    ("nt": w is (out, in), a tied
//                                                               LM head's embedding table)
//   w float32 or bfloat16 (converted in registers, float32 accumulation).
//
// Why: verifying K drafted tokens (or a token tree) multiplies 2-32 rows by every weight
// matrix. XLA:CPU (and OpenBLAS) run such products as packed GEMMs that cost about twice a
// one-row product at M = 2 and three times at M = 4 on a 2-core AVX2 machine, so a verify
// pass cost what several decode steps cost. These loops read each weight once per call, keep
// the rows' partial sums in registers or L1, and split the output columns over XLA's intra-op
// thread pool; a product of up to a few rows then costs about what reading the weights costs.
//
// Portable: GCC/Clang vector extensions (8 floats), compiled for the host (-march=native) on
// first use; AVX2+FMA on x86-64, NEON on Arm. Where the compiler targets AVX512-BF16 and both
// operands are bfloat16 (the caller says x is: attribute xbf16), the products take VDPBF16PS
// instead (pairs of bfloat16 products into float32 lanes, 32 weights an instruction).
// Leading (batch) dims: x and w have the same rank
// and each leading dim is equal or 1 in one of them (broadcast), which is what vmap's
// "expand_dims" method hands over (weights shared by every batch entry have dims of 1).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JSPEC_BF16DOT 1
#endif

namespace ffi = xla::ffi;

namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x8 load8(const uint16_t* p) {  // 8 bfloat16 -> 8 float32 (the high half of each)
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  u32x8 u = __builtin_convertvector(h, u32x8) << 16;
  f32x8 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }
inline f32x8 splat(float s) { return f32x8{s, s, s, s, s, s, s, s}; }
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  uint32_t u = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float hsum(f32x8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// ------------------------------------------------------------------------------------- nn
// Columns [c0, c1) of out[M, F] += x[M, D] @ w[D, F], four weight rows at a time: each weight
// is loaded once, the M rows' sums for a block of columns stay in out (L1/L2).
template <typename W>
void nn_columns(const float* x, const W* w, float* out, int64_t M, int64_t D, int64_t F,
                int64_t c0, int64_t c1) {
  // Columns per block: the M rows' partial sums of a block stay within 32 KiB (L1).
  const int64_t kBlock = std::max<int64_t>(16, std::min<int64_t>(8192, 8192 / M / 16 * 16));
  for (int64_t b0 = c0; b0 < c1; b0 += kBlock) {
    const int64_t b1 = std::min(c1, b0 + kBlock);
    const int64_t bv = b0 + (b1 - b0) / 16 * 16;  // end of the 16-column part
    for (int64_t m = 0; m < M; ++m) std::memset(out + m * F + b0, 0, (b1 - b0) * sizeof(float));
    int64_t k = 0;
    for (; k + 4 <= D; k += 4) {
      const W* r0 = w + k * F;
      const W* r1 = r0 + F;
      const W* r2 = r1 + F;
      const W* r3 = r2 + F;
      for (int64_t j = b0; j < bv; j += 16) {
        const f32x8 a0 = load8(r0 + j), a1 = load8(r0 + j + 8);
        const f32x8 b0v = load8(r1 + j), b1v = load8(r1 + j + 8);
        const f32x8 c0v = load8(r2 + j), c1v = load8(r2 + j + 8);
        const f32x8 d0 = load8(r3 + j), d1 = load8(r3 + j + 8);
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = x + m * D + k;
          float* om = out + m * F + j;
          f32x8 s0 = load8(om), s1 = load8(om + 8);
          const f32x8 x0 = splat(xm[0]), x1 = splat(xm[1]), x2 = splat(xm[2]), x3 = splat(xm[3]);
          s0 += x0 * a0;
          s1 += x0 * a1;
          s0 += x1 * b0v;
          s1 += x1 * b1v;
          s0 += x2 * c0v;
          s1 += x2 * c1v;
          s0 += x3 * d0;
          s1 += x3 * d1;
          store8(om, s0);
          store8(om + 8, s1);
        }
      }
      for (int64_t j = bv; j < b1; ++j)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t kk = k; kk < k + 4; ++kk) out[m * F + j] += x[m * D + kk] * load1(w + kk * F + j);
    }
    for (; k < D; ++k)
      for (int64_t j = b0; j < b1; ++j)
        for (int64_t m = 0; m < M; ++m) out[m * F + j] += x[m * D + k] * load1(w + k * F + j);
  }
}

// ------------------------------------------------------------------------------------- nt
// R rows x C weight rows of dot products over D, the R*C sums in registers.
template <int R, int C, typename W>
inline void nt_tile(const float* x, const W* w, float* out, int64_t D, int64_t F, int64_t f) {
  f32x8 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = splat(0.f);
  int64_t k = 0;
  for (; k + 8 <= D; k += 8) {
    f32x8 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load8(w + (f + c) * D + k);
    for (int r = 0; r < R; ++r) {
      const f32x8 xv = load8(x + r * D + k);
      for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t kk = k; kk < D; ++kk) s += x[r * D + kk] * load1(w + (f + c) * D + kk);
      out[r * F + f + c] = s;
    }
}

struct NtTile {
  template <int R, int C, typename W>
  static void run(const float* x, const W* w, float* out, int64_t D, int64_t F, int64_t f) {
    nt_tile<R, C>(x, w, out, D, F, f);
  }
};

// Weight rows [c0, c1) of out[M, F] = x[M, D] @ w[F, D]^T, in tiles of 2 x 4 (Tile::run).
template <typename Tile, typename X, typename W>
void nt_rows(const X* x, const W* w, float* out, int64_t M, int64_t D, int64_t F, int64_t c0,
             int64_t c1) {
  int64_t f = c0;
  for (; f + 4 <= c1; f += 4) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) Tile::template run<2, 4>(x + m * D, w, out + m * F, D, F, f);
    if (m < M) Tile::template run<1, 4>(x + m * D, w, out + m * F, D, F, f);
  }
  for (; f < c1; ++f)
    for (int64_t m = 0; m < M; ++m) Tile::template run<1, 1>(x + m * D, w, out + m * F, D, F, f);
}

#ifdef JSPEC_BF16DOT
// ------------------------------------------------------------------- bfloat16 x bfloat16
// Both operands bfloat16 (x's rows as uint16 bits), float32 accumulation with VDPBF16PS:
// lane i of the accumulator += a[2i] * b[2i] + a[2i+1] * b[2i+1]. Tails in scalar code (load1).

// Indices that interleave two vectors of 32 bfloat16 (a = weight row k, b = row k+1) into
// (a[i], b[i]) pairs: base 0 for columns 0-15, base 16 for 16-31.
inline __m512i interleave_index(int base) {
  alignas(64) uint16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = uint16_t(base + i);
    idx[2 * i + 1] = uint16_t(32 + base + i);
  }
  return _mm512_load_si512(idx);
}

inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// out[0:R, j:j+32] (+)= x[0:R, k0:k1] @ w[k0:k1, j:j+32] for R <= 8 rows, the 2R sums in
// registers: four weight rows at a time, rows k and k+1 (k+2 and k+3) interleaved into pairs
// (one permute per 32 weights), each row of x a broadcast pair. `first`: start from zero.
template <int R>
inline void nn_group_dp(const uint16_t* x, int64_t D, const uint16_t* w, int64_t F, float* out,
                        int64_t j, int64_t k0, int64_t k1, bool first, __m512i lo, __m512i hi) {
  __m512 s0[R], s1[R];
  for (int r = 0; r < R; ++r) {
    s0[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * F + j);
    s1[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * F + j + 16);
  }
  for (int64_t k = k0; k < k1; k += 4) {
    const uint16_t* r0 = w + k * F + j;
    const __m512i a0 = _mm512_loadu_si512(r0);
    const __m512i a1 = _mm512_loadu_si512(r0 + F);
    const __m512i a2 = _mm512_loadu_si512(r0 + 2 * F);
    const __m512i a3 = _mm512_loadu_si512(r0 + 3 * F);
    const __m512i p01l = _mm512_permutex2var_epi16(a0, lo, a1);
    const __m512i p01h = _mm512_permutex2var_epi16(a0, hi, a1);
    const __m512i p23l = _mm512_permutex2var_epi16(a2, lo, a3);
    const __m512i p23h = _mm512_permutex2var_epi16(a2, hi, a3);
    for (int r = 0; r < R; ++r) {
      uint32_t x01, x23;
      std::memcpy(&x01, x + r * D + k, 4);
      std::memcpy(&x23, x + r * D + k + 2, 4);
      const __m512i v01 = _mm512_set1_epi32(int(x01)), v23 = _mm512_set1_epi32(int(x23));
      s0[r] = dp(dp(s0[r], p01l, v01), p23l, v23);
      s1[r] = dp(dp(s1[r], p01h, v01), p23h, v23);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * F + j, s0[r]);
    _mm512_storeu_ps(out + r * F + j + 16, s1[r]);
  }
}

template <int R>
void nn_rows_dp(const uint16_t* x, const uint16_t* w, float* out, int64_t D, int64_t F,
                int64_t c0, int64_t bv, int64_t d4) {
  // Blocks of kRows weight rows: the block's rows are read as kRows sequential streams,
  // column group by column group, the sums staying in registers within a block.
  constexpr int64_t kRows = 16;
  const __m512i lo = interleave_index(0), hi = interleave_index(16);
  for (int64_t k0 = 0; k0 < d4; k0 += kRows) {
    const int64_t k1 = std::min(d4, k0 + kRows);
    for (int64_t j = c0; j < bv; j += 32)
      nn_group_dp<R>(x, D, w, F, out, j, k0, k1, k0 == 0, lo, hi);
  }
}

// Columns [c0, c1) of out[M, F] = x[M, D] @ w[D, F], rows of x eight at a time.
void nn_columns_dp(const uint16_t* x, const uint16_t* w, float* out, int64_t M, int64_t D,
                   int64_t F, int64_t c0, int64_t c1) {
  const int64_t bv = c0 + (c1 - c0) / 32 * 32;  // end of the 32-column part
  const int64_t d4 = D / 4 * 4;
  if (d4 == 0)
    for (int64_t m = 0; m < M; ++m) std::memset(out + m * F + c0, 0, (bv - c0) * sizeof(float));
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const uint16_t* xm = x + m0 * D;
    float* om = out + m0 * F;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: nn_rows_dp<1>(xm, w, om, D, F, c0, bv, d4); break;
      case 2: nn_rows_dp<2>(xm, w, om, D, F, c0, bv, d4); break;
      case 3: nn_rows_dp<3>(xm, w, om, D, F, c0, bv, d4); break;
      case 4: nn_rows_dp<4>(xm, w, om, D, F, c0, bv, d4); break;
      case 5: nn_rows_dp<5>(xm, w, om, D, F, c0, bv, d4); break;
      case 6: nn_rows_dp<6>(xm, w, om, D, F, c0, bv, d4); break;
      case 7: nn_rows_dp<7>(xm, w, om, D, F, c0, bv, d4); break;
      default: nn_rows_dp<8>(xm, w, om, D, F, c0, bv, d4); break;
    }
  }
  // The rest: weight rows past the last multiple of 4 (32-column part), then the columns
  // past the last multiple of 32 (every row), in scalar code.
  for (int64_t k = d4; k < D; ++k)
    for (int64_t j = c0; j < bv; ++j)
      for (int64_t m = 0; m < M; ++m)
        out[m * F + j] += load1(x + m * D + k) * load1(w + k * F + j);
  for (int64_t j = bv; j < c1; ++j)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < D; ++k) s += load1(x + m * D + k) * load1(w + k * F + j);
      out[m * F + j] = s;
    }
}

// R rows x C weight rows of dot products over D (contiguous in both), sums in registers.
template <int R, int C>
inline void nt_tile_dp(const uint16_t* x, const uint16_t* w, float* out, int64_t D, int64_t F,
                       int64_t f) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= D; k += 32) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + (f + c) * D + k);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(x + r * D + k);
      for (int c = 0; c < C; ++c) acc[r][c] = dp(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = _mm512_reduce_add_ps(acc[r][c]);
      for (int64_t kk = k; kk < D; ++kk)
        s += load1(x + r * D + kk) * load1(w + (f + c) * D + kk);
      out[r * F + f + c] = s;
    }
}

struct NtTileDp {
  template <int R, int C>
  static void run(const uint16_t* x, const uint16_t* w, float* out, int64_t D, int64_t F,
                  int64_t f) {
    nt_tile_dp<R, C>(x, w, out, D, F, f);
  }
};
#endif  // JSPEC_BF16DOT

// ------------------------------------------------------------------------------------- jobs
// One call's work, split into column chunks that the calling thread and the pool's threads
// claim from a counter. The caller claims chunks too and never waits for a helper to *start*
// (a helper that starts after the last chunk was claimed finds nothing and returns), so a
// pool busy with other work cannot deadlock a call; shared_ptr keeps the job alive for
// helpers that run late.
struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t chunks = 0, per_chunk = 0, per_batch = 0;
  int64_t M = 0, D = 0, F = 0;
  bool nt = false, bf16 = false, dot = false;  // dot: both bfloat16, VDPBF16PS
  const float* x = nullptr;
  std::vector<uint16_t> xb;  // x's rows as bfloat16 bits (dot only)
  const void* w = nullptr;
  float* out = nullptr;
  // Leading (batch) dims of the output and each operand's element strides along them (0
  // where the operand's dim is 1: broadcast).
  int64_t nbatch = 0;
  int64_t dims[8] = {}, x_strides[8] = {}, w_strides[8] = {};

  template <typename W>
  void run_typed(int64_t b, int64_t c0, int64_t c1) {
    int64_t xo = 0, wo = 0;
    for (int64_t i = nbatch - 1, r = b; i >= 0; --i) {
      xo += (r % dims[i]) * x_strides[i];
      wo += (r % dims[i]) * w_strides[i];
      r /= dims[i];
    }
    const float* xb = x + xo;
    const W* wb = static_cast<const W*>(w) + wo;
    float* ob = out + b * M * F;
#ifdef JSPEC_BF16DOT
    if constexpr (sizeof(W) == 2) {
      if (dot) {
        const uint16_t* xh = this->xb.data() + xo;
        if (nt)
          nt_rows<NtTileDp>(xh, wb, ob, M, D, F, c0, c1);
        else
          nn_columns_dp(xh, wb, ob, M, D, F, c0, c1);
        return;
      }
    }
#endif
    if (nt)
      nt_rows<NtTile>(xb, wb, ob, M, D, F, c0, c1);
    else
      nn_columns(xb, wb, ob, M, D, F, c0, c1);
  }
  void run(int64_t chunk) {
    const int64_t b = chunk / per_batch;
    const int64_t c0 = (chunk % per_batch) * per_chunk;
    const int64_t c1 = std::min(F, c0 + per_chunk);
    if (bf16)
      run_typed<uint16_t>(b, c0, c1);
    else
      run_typed<float>(b, c0, c1);
  }
  void work() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      run(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error SmallGemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                         ffi::ResultBuffer<ffi::F32> out, bool nt, bool xbf16) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() < 2 || wd.size() < 2)
    return ffi::Error::InvalidArgument("small_gemm: x and w need rank >= 2");
  if (w.element_type() != ffi::F32 && w.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("small_gemm: w must be float32 or bfloat16");
  auto job = std::make_shared<Job>();
  job->nt = nt;
  job->bf16 = w.element_type() == ffi::BF16;
  const size_t xr = xd.size(), wr = wd.size();
  job->M = xd[xr - 2];
  job->D = xd[xr - 1];
  const int64_t wk = nt ? wd[wr - 1] : wd[wr - 2];
  job->F = nt ? wd[wr - 2] : wd[wr - 1];
  if (wk != job->D) return ffi::Error::InvalidArgument("small_gemm: contracting dims differ");
  if (xr != wr) return ffi::Error::InvalidArgument("small_gemm: x and w differ in rank");
  if (xr - 2 > 8) return ffi::Error::InvalidArgument("small_gemm: more than 8 batch dims");
  job->nbatch = static_cast<int64_t>(xr - 2);
  int64_t batch = 1, xs = job->M * job->D, ws = job->D * job->F;
  for (int64_t i = job->nbatch - 1; i >= 0; --i) {
    const int64_t a = xd[i], c = wd[i];
    if (a != c && a != 1 && c != 1)
      return ffi::Error::InvalidArgument("small_gemm: batch dims must be equal or 1");
    job->dims[i] = std::max(a, c);
    job->x_strides[i] = a == 1 ? 0 : xs;
    job->w_strides[i] = c == 1 ? 0 : ws;
    xs *= a;
    ws *= c;
    batch *= job->dims[i];
  }
  job->x = x.typed_data();
  job->w = w.untyped_data();
  job->out = out->typed_data();
  if (batch == 0 || job->M == 0 || job->F == 0) return ffi::Error::Success();
  if (job->D == 0) {
    std::memset(job->out, 0, batch * job->M * job->F * sizeof(float));
    return ffi::Error::Success();
  }

#ifdef JSPEC_BF16DOT
  // x is bfloat16 values held as float32 (the caller's promise): its upper halves, exactly.
  if (job->bf16 && xbf16) {
    job->dot = true;
    const int64_t n = static_cast<int64_t>(x.element_count());
    job->xb.resize(n);
    const uint32_t* xu = reinterpret_cast<const uint32_t*>(job->x);
    for (int64_t i = 0; i < n; ++i) job->xb[i] = uint16_t(xu[i] >> 16);
  }
#endif
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // nn: one chunk per thread (each streams its own column slice of every weight row);
  // nt: a few chunks per thread of 4-row groups (rows are independent, so balance is cheap).
  const int64_t unit = nt ? 4 : (job->dot ? 32 : 16);
  const int64_t units = (job->F + unit - 1) / unit;
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(units, nt ? 4 * threads : threads));
  job->per_chunk = (units + want - 1) / want * unit;
  job->per_batch = (job->F + job->per_chunk - 1) / job->per_chunk;
  job->chunks = batch * job->per_batch;
  const int64_t helpers = std::min(threads, job->chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecSmallGemm, SmallGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("nt")
                                  .Attr<bool>("xbf16"));

// 1 where this build multiplies bfloat16 by bfloat16 with VDPBF16PS (attribute xbf16).
extern "C" int JspecSmallGemmBf16Dot() {
#ifdef JSPEC_BF16DOT
  return 1;
#else
  return 0;
#endif
}
