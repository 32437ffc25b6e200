// bfloat16 linear layers with each output computed alone: torch.ops.pyxllm_cpu.bf16_rowwise_linear,
// y[M, N] = x[M, K] @ w[N, K]^T (+ bias), bfloat16 in and out, float32 sums (contract in
// pyxllm/kernels/cpu/fused.py). --batch-invariant (the default) on bfloat16 weights: oneDNN's
// bf16 GEMM adds a row's products in another order in batches of other sizes.
//
// The order of y[m, n], the same whatever M and the other rows are: 16 float32 lanes, lane l
// taking the pairs (2l, 2l + 1) of each 32 inputs, k = 32 c + 2 l + p; for c = 0, 1, ... each lane
// adds the odd product, then the even one (acc += x[k+1] w[k+1]; acc += x[k] w[k], each rounded
// to nearest: vdpbf16ps's definition, Intel SDM), inputs past K taken as zeros; then the lanes
// summed by halving (lane l + lane l + 8, then + 4, + 2, + 1), the bias added, and the sum rounded
// to bfloat16 (nearest even). A product of two bfloat16 values is exact in float32, so the
// branch without AVX512-BF16 (bf16 -> float32, then fused multiply-adds in that order, or a
// multiply and an add) gives the same bits as vdpbf16ps, subnormals aside (vdpbf16ps flushes them
// to zero). Register blocks (several rows x several weight rows) only decide which outputs
// share loads, so a row gets the same bits in a batch of any size, on any branch.
//
// Parallel over output columns (weight rows) only, never over K: a task owns kColsPerTask weight
// rows for all rows, in blocks of kCols weight rows (L1-resident) each passing over a panel of
// kPanelRows rows (L2-resident), kRows at a time. On one Zen 4 core (AVX512-BF16, no AMX) this
// runs SmolLM2-135M's projections at ~0.85-1.0x oneDNN's bf16 GFLOP/s over 64-1000 rows, and
// ~3x at one row (docs/defaults.md).
// ATen's tensor and the ops called below, not <ATen/ATen.h> (all of ATen's functions: 3-6 s
// of this file's compile, in each build of the kernels)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PYXLLM_BF16_DPBF16 1
#elif defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 32;                     // inputs per step: 16 lanes of 2
constexpr int64_t kColsPerTask = 64;               // weight rows a task owns (whole blocks)
constexpr int64_t kPanelRows = 64;                 // rows a block of weight rows passes over
constexpr int64_t kSerialMacs = int64_t{1} << 18;  // below this, the calling thread alone

typedef float Vec8 __attribute__((vector_size(32)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

// Sum of 16 lanes held as lanes 0-7 (lo) and 8-15 (hi), by halving: the order of the contract.
inline float halving_sum(Vec8 lo, Vec8 hi) {
  Vec8 v = lo + hi;
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return v[0] + v[1];
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#define PYXLLM_INLINE inline __attribute__((always_inline))

struct Problem {
  const uint16_t* x;
  const uint16_t* w;
  const uint16_t* bias;  // nullptr: none
  uint16_t* y;
  int64_t rows, k, n;
};

#if defined(PYXLLM_BF16_DPBF16)
// ---- AVX512-BF16: one vdpbf16ps per 32 inputs and output; kRows x kCols outputs per block, their
// 16 accumulators reduced together and their bfloat16 results rounded and stored as one vector.
constexpr int kRows = 4;
constexpr int kCols = 4;  // 16 accumulators, 4 x vectors and a weight vector
constexpr int kColsOneRow = 16;
const char* const kPath = "avx512_bf16";

// The halving sums of 16 accumulators at once, the same additions as halving_sum on each: lane
// 4 b + e of the result is the sum of v[b + 4 e]. Each step adds the two halves of what is left
// of two vectors' lanes, brought side by side by one shuffle each (3 instructions a pair instead
// of ~8 a vector alone).
PYXLLM_INLINE __m512 reduce16(const __m512 (&v)[16]) {
  __m512 s[8], u[4], t[2];
  // lane j + lane j + 8: [v2i 0-3, v2i 4-7, v2i+1 0-3, v2i+1 4-7]
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  // + 4: a block of 4 lanes per vector, v4i .. v4i+3
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  // + 2: block b holds v[8i + b] in lanes 0-1 and v[8i + 4 + b] in lanes 2-3
  for (int i = 0; i < 2; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // + 1: block b holds v[b], v[4 + b], v[8 + b], v[12 + b]
  return _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x88), _mm512_shuffle_ps(t[0], t[1], 0xDD));
}

// float32 -> bfloat16 bits in each 32-bit lane, nearest even, NaN -> 0x7fc0 (c10::BFloat16's rule)
PYXLLM_INLINE __m512i round_to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

// acc[r][c] += the next 32 inputs of row r and weight row c (the first `count`, the rest zeros)
template <int R, int C, bool kTail>
PYXLLM_INLINE void step(__m512 (&acc)[R][C], const uint16_t* x, const uint16_t* w, int64_t k, __mmask32 mask) {
  __m512i xv[R];
  for (int r = 0; r < R; ++r)
    xv[r] = kTail ? _mm512_maskz_loadu_epi16(mask, x + r * k) : _mm512_loadu_si512(x + r * k);
  for (int c = 0; c < C; ++c) {
    const __m512bh wv = (__m512bh)(kTail ? _mm512_maskz_loadu_epi16(mask, w + c * k) : _mm512_loadu_si512(w + c * k));
    for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv[r], wv);
  }
}

// Rows [m0, m0 + R) x weight rows [j0, j0 + C).
template <int R, int C>
void block(const Problem& p, int64_t m0, int64_t j0) {
  const int64_t k = p.k;
  const uint16_t* x = p.x + m0 * k;
  const uint16_t* w = p.w + j0 * k;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kChunk <= k; i += kChunk) step<R, C, false>(acc, x + i, w + i, k, 0);
  if (i < k) step<R, C, true>(acc, x + i, w + i, k, static_cast<__mmask32>((uint64_t{1} << (k - i)) - 1));
  // output o = r * C + c in lane o % 16 of group o / 16: v[b + 4 e] goes to lane 4 b + e
  constexpr int kGroups = (R * C + 15) / 16;
  alignas(32) uint16_t out[16 * kGroups];
  for (int g = 0; g < kGroups; ++g) {
    __m512 v[16];
    for (int l = 0; l < 16; ++l) {
      const int o = 16 * g + l;
      v[(l / 4) + 4 * (l % 4)] = o < R * C ? acc[o / C][o % C] : _mm512_setzero_ps();
    }
    __m512 sums = reduce16(v);
    if (p.bias) {
      alignas(64) float b[16] = {};
      for (int l = 0; l < 16 && 16 * g + l < R * C; ++l) b[l] = bf16_to_float(p.bias[j0 + (16 * g + l) % C]);
      sums = _mm512_add_ps(sums, _mm512_load_ps(b));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 16 * g), _mm512_cvtepi32_epi16(round_to_bf16(sums)));
  }
  for (int r = 0; r < R; ++r) std::memcpy(p.y + (m0 + r) * p.n + j0, out + r * C, C * sizeof(uint16_t));
}

#else
// ---- Without AVX512-BF16: each 32-bit word holds a pair, the even input in its low half, so
// the even input as float32 is the word shifted left 16 bits and the odd one the word with its
// low half cleared. Lanes 0-7 and 8-15 are two 8-lane accumulators.
#if defined(__FMA__)
constexpr int kRows = 2;
constexpr int kCols = 2;  // 8 accumulators, 4 x and 2 weight vectors of AVX2's 16 registers
const char* const kPath = "avx2_fma";
inline Vec8 fma8(Vec8 a, Vec8 b, Vec8 c) { return (Vec8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
constexpr int kRows = 2;
constexpr int kCols = 1;
const char* const kPath = "generic";
// the product is exact (8-bit significands), so a multiply and an add round as one fma does
inline Vec8 fma8(Vec8 a, Vec8 b, Vec8 c) { return a * b + c; }
#endif
constexpr int kColsOneRow = kCols;

inline void split_pairs(const uint16_t* p, Vec8& even, Vec8& odd) {
  U32x8 u;
  std::memcpy(&u, p, sizeof u);
  even = (Vec8)(u << 16);
  odd = (Vec8)(u & 0xffff0000u);
}

template <int R, int C>
struct Block {
  Vec8 lo[R][C] = {}, hi[R][C] = {};
  template <int H>
  inline void half(Vec8 (&acc)[R][C], const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw) {
    Vec8 xe[R], xo[R];
    for (int r = 0; r < R; ++r) split_pairs(x + r * ldx + 16 * H, xe[r], xo[r]);
    for (int c = 0; c < C; ++c) {
      Vec8 we, wo;
      split_pairs(w + c * ldw + 16 * H, we, wo);
      for (int r = 0; r < R; ++r) acc[r][c] = fma8(xe[r], we, fma8(xo[r], wo, acc[r][c]));
    }
  }
  inline void step(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw) {
    half<0>(lo, x, ldx, w, ldw);
    half<1>(hi, x, ldx, w, ldw);
  }
  inline void tail(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t count) {
    uint16_t xp[R][kChunk] = {}, wp[C][kChunk] = {};
    for (int r = 0; r < R; ++r) std::memcpy(xp[r], x + r * ldx, count * sizeof(uint16_t));
    for (int c = 0; c < C; ++c) std::memcpy(wp[c], w + c * ldw, count * sizeof(uint16_t));
    step(&xp[0][0], kChunk, &wp[0][0], kChunk);
  }
  inline void sums(float* out) const {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[r * C + c] = halving_sum(lo[r][c], hi[r][c]);
  }
};

// Rows [m0, m0 + R) x weight rows [j0, j0 + C).
template <int R, int C>
void block(const Problem& p, int64_t m0, int64_t j0) {
  Block<R, C> b;
  const uint16_t* x = p.x + m0 * p.k;
  const uint16_t* w = p.w + j0 * p.k;
  int64_t i = 0;
  for (; i + kChunk <= p.k; i += kChunk) b.step(x + i, p.k, w + i, p.k);
  if (i < p.k) b.tail(x + i, p.k, w + i, p.k, p.k - i);
  float sums[R * C];
  b.sums(sums);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float total = sums[r * C + c];
      if (p.bias) total += bf16_to_float(p.bias[j0 + c]);
      p.y[(m0 + r) * p.n + j0 + c] = c10::BFloat16(total).x;  // nearest even
    }
}
#endif

// Rows [m0, m1) x weight rows [j, j + C).
template <int C>
void rows_of(const Problem& p, int64_t m0, int64_t m1, int64_t j) {
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows) block<kRows, C>(p, m, j);
  switch (m1 - m) {
    case 1: block<1, C>(p, m, j); break;
    case 2: if constexpr (kRows > 2) block<2, C>(p, m, j); break;
    case 3: if constexpr (kRows > 3) block<3, C>(p, m, j); break;
    default: break;
  }
  static_assert(kRows <= 4, "rows_of: the remainder switch covers up to 3 rows");
}

// Rows [m0, m1) x weight rows [j0, j1): blocks of C weight rows, the rest in blocks of C / 2,
// C / 4, ..., 1 (a few block shapes: each is compiled for every row count up to kRows).
template <int C>
void rows_by_columns(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1) {
  int64_t j = j0;
  for (; j + C <= j1; j += C) rows_of<C>(p, m0, m1, j);
  if constexpr (C > 1) {
    if (j < j1) rows_by_columns<C / 2>(p, m0, m1, j, j1);
  }
}

// One row (decode) x weight rows [j0, j1), in blocks of C, C / 2, ..., 1 weight rows.
template <int C>
void one_row(const Problem& p, int64_t j0, int64_t j1) {
  int64_t j = j0;
  for (; j + C <= j1; j += C) block<1, C>(p, 0, j);
  if constexpr (C > 1) {
    if (j < j1) one_row<C / 2>(p, j, j1);
  }
}

// Weight rows [j0, j1) for every row: row panels of kPanelRows (L2-resident), in each the
// blocks of kCols weight rows (L1-resident) in turn, each over the panel's rows. One row
// (decode) takes wider blocks, each weight row read once.
void columns(const Problem& p, int64_t j0, int64_t j1) {
  if (p.rows == 1) return one_row<kColsOneRow>(p, j0, j1);
  for (int64_t m = 0; m < p.rows; m += kPanelRows)
    rows_by_columns<kCols>(p, m, std::min(p.rows, m + kPanelRows), j0, j1);
}

at::Tensor bf16_rowwise_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_rowwise_linear: weight must be a contiguous bfloat16 [N, K] tensor");
  const int64_t k = weight.size(1), n = weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16 && x.size(-1) == k,
              "bf16_rowwise_linear: x must be bfloat16 [..., ", k, "]");
  at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t rows = x2.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n && b.scalar_type() == at::kBFloat16, "bf16_rowwise_linear: bias must be bfloat16 [N]");
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out.view(out_shape);
  Problem p{reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
            b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()) : nullptr,
            reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
            rows,
            k,
            n};
  // a task's microseconds must outweigh its scheduling: at least kColsPerTask weight rows, and
  // below kSerialMacs in all the calling thread alone
  const int64_t grain = rows * n * k < kSerialMacs ? n : kColsPerTask;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j0 = begin; j0 < end; j0 += kColsPerTask) columns(p, j0, std::min(end, j0 + kColsPerTask));
  });
  return out.view(out_shape);
}

// Which branch this build compiled: avx512_bf16, avx2_fma or generic.
std::string bf16_linear_path() { return kPath; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pyxllm_cpu, m) {
  m.def("bf16_rowwise_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("bf16_linear_path() -> str", &bf16_linear_path);  // no tensor to dispatch on: one kernel
}

TORCH_LIBRARY_IMPL(pyxllm_cpu, CPU, m) { m.impl("bf16_rowwise_linear", &bf16_rowwise_linear); }
