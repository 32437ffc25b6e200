// Fused CPU kernels for the decode hot path: one call per op instead of a chain of small ATen
// ops. Registered as torch.ops.pyxllm_cpu.* (see pyxllm/kernels/cpu/fused.py, which builds this
// file on first use and states each op's contract). Each kernel takes float32 or bfloat16 and
// computes in float32; where the native reference rounds an intermediate to the input dtype
// (pyxllm/kernels/native), the kernel rounds it at the same place, so results agree with the
// reference up to the order of float32 summation and the last bits of exp.
//
// Loops are written so that the compiler vectorizes them (-O3 -march=native): rows are
// converted to float32 buffers first, reductions keep 16 partial sums, and exp is a polynomial
// (no libm call) instead of std::exp.
// ATen's tensor and the ops called below, not <ATen/ATen.h> (all of ATen's functions: 3-6 s
// of this file's compile, in each build of the kernels)
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512BF16__) || defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

namespace {

using c10::BFloat16;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float32 -> bfloat16 bits, rounding to nearest even (c10::BFloat16's rule, NaN kept a NaN).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return f != f ? uint16_t{0x7fc0} : rounded;
}

// Row conversions between T and float32 buffers; round() rounds a buffer to T's precision in place.
template <typename T>
struct Rows;

template <>
struct Rows<float> {
  static void load(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
  static void store(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
  static void round(float*, int64_t) {}
};

template <>
struct Rows<BFloat16> {
  static void load(float* dst, const BFloat16* src, int64_t n) {
    const auto* raw = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(static_cast<uint32_t>(raw[i]) << 16);
  }
  static void store(BFloat16* dst, const float* src, int64_t n) {
    auto* raw = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) raw[i] = bf16_bits(src[i]);
  }
  static void round(float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = bits_to_float(static_cast<uint32_t>(bf16_bits(x[i])) << 16);
  }
};

constexpr int kLanes = 16;  // partial sums per reduction: one AVX-512 register of float32

// GCC/Clang vector extension: 16 float32 lanes (one AVX-512 register, or several narrower ones).
typedef float Vec16 __attribute__((vector_size(64)));

// A vector of floats from unaligned memory (memcpy: no alignment or aliasing assumption).
template <typename V>
inline V load_vector(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Vec16 load16(const float* p) { return load_vector<Vec16>(p); }

// 8 float32 lanes (one AVX2 register): the unit of the attention tiles and the small-batch linear
// (an AVX-512 machine runs them on half registers).
typedef float Vec8 __attribute__((vector_size(32)));

inline Vec8 load8(const float* p) { return load_vector<Vec8>(p); }

// The kLanes partial sums of a reduction, kept as two 8-lane halves (lanes 0-7 and 8-15): on a
// machine without AVX-512, GCC keeps a loop-carried 16-lane vector in memory (a dot product of
// Vec16 ran 8x slower than this on an AVX2 EPYC).
struct Lanes16 {
  Vec8 lo{}, hi{};
  void add(const Vec8& a, const Vec8& b) {
    lo += a;
    hi += b;
  }
  // The sum of the 16 lanes by halving (lane j plus lane j + 8, then + 4, + 2, + 1), the same
  // order as hsum(Vec16), so the same bits.
  float sum() const {
    Vec8 v = lo + hi;
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
  }
};

// Sum of the 16 lanes by halving shuffles, in registers.
inline float hsum(Vec16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// {hsum(a), hsum(b), hsum(c), hsum(d)} into out[0..4): the four reductions share their
// shuffles (13 vector ops instead of 4 x 8).
inline void hsum4(Vec16 a, Vec16 b, Vec16 c, Vec16 d, float* out) {
  const Vec16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const Vec16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // [a, b, c, d] in 4 lanes each
  Vec16 v = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  out[0] = v[0];
  out[1] = v[4];
  out[2] = v[8];
  out[3] = v[12];
}

inline float dot(const float* a, const float* b, int64_t n) {
  Lanes16 part;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) part.add(load8(a + i) * load8(b + i), load8(a + i + 8) * load8(b + i + 8));
  float total = part.sum();
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

inline float sum(const float* a, int64_t n) {
  Lanes16 part;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) part.add(load8(a + i), load8(a + i + 8));
  float total = part.sum();
  for (; i < n; ++i) total += a[i];
  return total;
}

// The largest of a[0..n) (0 for n = 0): std::max_element's value, 16 lanes at a time (a NaN
// wins only as a[0], as there).
inline float peak(const float* a, int64_t n) {
  if (n == 0) return 0.f;
  Vec8 lo = Vec8{} + a[0], hi = lo;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const Vec8 x = load8(a + i), y = load8(a + i + 8);
    lo = lo < x ? x : lo;
    hi = hi < y ? y : hi;
  }
  float m = a[0];
  for (int l = 0; l < 8; ++l) {
    m = m < lo[l] ? lo[l] : m;
    m = m < hi[l] ? hi[l] : m;
  }
  for (; i < n; ++i) m = m < a[i] ? a[i] : m;
  return m;
}

// e^x for x in float32 range, within a few ulp: x = n ln2 + r with Cody-Waite's two-part ln2
// (the Cephes constants), |r| <= ln2 / 2, e^r by its Taylor series to degree 7 (truncation
// error below 1e-8 relative), times 2^n built in the exponent bits. Inputs are clamped to
// [-87, 88], so the result is never 0 or inf.
// The reduction x - n ln2 and the series, for float or Vec8 (the same operations, so the same
// bits either way).
template <typename V>
inline V exp_reduced(V x, V n) {
  const V r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  V p = V{} + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  return p * r + 1.f;
}

inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  return exp_reduced(x, n) * bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

typedef int32_t Int8v __attribute__((vector_size(32)));

// exp_approx on 8 lanes, the same operations in the same order, so the same bits (GCC does not
// vectorize the scalar version's std::floor and bit casts in a loop). 8 lanes, not 16: without
// AVX-512 GCC splits a 16-lane compare, select or int conversion into scalar code (measured on
// an AVX2 EPYC: a 16-lane SiLU ran 4.4x slower than this one).
inline Vec8 exp_approx8(Vec8 x) {
  x = x < -87.f ? Vec8{} - 87.f : x;
  x = x > 88.f ? Vec8{} + 88.f : x;
  const Vec8 t = x * 1.44269504088896341f + 0.5f;
  Vec8 n = __builtin_convertvector(__builtin_convertvector(t, Int8v), Vec8);  // truncated
  n = n > t ? n - 1.f : n;                                                         // floored
  const Int8v bits = (__builtin_convertvector(n, Int8v) + 127) << 23;
  Vec8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return exp_reduced(x, n) * scale;
}

// x[i] = exp_approx(x[i] - shift) for i < n.
inline void exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const Vec8 v = exp_approx8(load8(x + i) - shift);
    std::memcpy(x + i, &v, sizeof v);
  }
  for (; i < n; ++i) x[i] = exp_approx(x[i] - shift);
}

#define PYXLLM_DISPATCH_FLOAT(dtype, NAME, ...)                                   \
  [&] {                                                                           \
    if ((dtype) == at::kFloat) {                                                  \
      using scalar_t = float;                                                     \
      return __VA_ARGS__();                                                       \
    }                                                                             \
    TORCH_CHECK((dtype) == at::kBFloat16, NAME, ": float32 or bfloat16 only, got ", (dtype)); \
    using scalar_t = BFloat16;                                                    \
    return __VA_ARGS__();                                                         \
  }()

// Work below this many elements in all runs on the calling thread: waking the pool costs more
// (measured on 2 cores: a few microseconds). Attention counts multiply-adds, cheaper per unit.
constexpr int64_t kSerialElements = 1 << 15;
constexpr int64_t kSerialAttention = 1 << 14;

inline int64_t grain_for(int64_t rows, int64_t row_elements, int64_t serial_below = kSerialElements) {
  return rows * row_elements < serial_below ? std::max<int64_t>(rows, 1) : 1;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: out = weight * T(x * rsqrt(mean(x^2) + eps)), statistics in float32.
template <typename T>
void rms_norm_rows(T* out, const T* x, const T* weight, int64_t rows, int64_t hidden, int64_t x_stride,
                   double eps) {
  std::vector<float> w(hidden);
  Rows<T>::load(w.data(), weight, hidden);
  at::parallel_for(0, rows, grain_for(rows, hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(hidden);
    for (int64_t r = begin; r < end; ++r) {
      float* b = buf.data();
      Rows<T>::load(b, x + r * x_stride, hidden);
      const float inv = 1.f / std::sqrt(dot(b, b, hidden) / hidden + static_cast<float>(eps));
      for (int64_t i = 0; i < hidden; ++i) b[i] *= inv;
      Rows<T>::round(b, hidden);
      for (int64_t i = 0; i < hidden; ++i) b[i] *= w[i];
      Rows<T>::store(out + r * hidden, b, hidden);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.stride(-1) == 1 && weight.is_contiguous(), "rms_norm: the last dimension must be contiguous");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and input dtypes differ");
  const int64_t hidden = x.size(-1);
  at::Tensor x2 = x.reshape({-1, hidden});
  at::Tensor out = at::empty(x2.sizes(), x.options());
  PYXLLM_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x2.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            x2.size(0), hidden, x2.stride(0), eps);
  });
  return out.view(x.sizes());
}

// residual = T(x + residual); returns (rms_norm(residual), residual), both new tensors.
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "fused_add_rms_norm: input and residual differ in shape or dtype");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "fused_add_rms_norm: weight and input dtypes differ");
  const int64_t hidden = x.size(-1);
  at::Tensor xs = x.reshape({-1, hidden}).contiguous(), rs = residual.reshape({-1, hidden}).contiguous();
  at::Tensor new_residual = at::empty(xs.sizes(), x.options());
  at::Tensor out = at::empty(xs.sizes(), x.options());
  const int64_t rows = xs.size(0);
  PYXLLM_DISPATCH_FLOAT(x.scalar_type(), "fused_add_rms_norm", [&] {
    const scalar_t* a = xs.data_ptr<scalar_t>();
    const scalar_t* b = rs.data_ptr<scalar_t>();
    scalar_t* s = new_residual.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(rows, hidden), [&](int64_t begin, int64_t end) {
      std::vector<float> fa(hidden), fb(hidden);
      for (int64_t r = begin; r < end; ++r) {
        Rows<scalar_t>::load(fa.data(), a + r * hidden, hidden);
        Rows<scalar_t>::load(fb.data(), b + r * hidden, hidden);
        for (int64_t i = 0; i < hidden; ++i) fa[i] += fb[i];
        Rows<scalar_t>::store(s + r * hidden, fa.data(), hidden);
      }
    });
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), s, weight.data_ptr<scalar_t>(), rows, hidden, hidden, eps);
  });
  return {out.view(x.sizes()), new_residual.view(x.sizes())};
}

// ---------------------------------------------------------------------------------------------
// SwiGLU gate: out[..., j] = T(T(silu(x[..., j])) * x[..., d + j]), silu(g) = g / (1 + e^-g).
at::Tensor silu_and_mul(const at::Tensor& x) {
  const int64_t d = x.size(-1) / 2;
  at::Tensor x2 = x.reshape({-1, 2 * d}).contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = d;
  at::Tensor out = at::empty({x2.size(0), d}, x.options());
  const int64_t rows = x2.size(0);
  PYXLLM_DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x2.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(rows, 2 * d), [&](int64_t begin, int64_t end) {
      std::vector<float> gate(d), up(d);
      for (int64_t r = begin; r < end; ++r) {
        float* g = gate.data();
        Rows<scalar_t>::load(g, in + r * 2 * d, d);
        Rows<scalar_t>::load(up.data(), in + r * 2 * d + d, d);
        int64_t j = 0;
        for (; j + 8 <= d; j += 8) {
          const Vec8 v = load8(g + j);
          const Vec8 s = v / (1.f + exp_approx8(-v));
          std::memcpy(g + j, &s, sizeof s);
        }
        for (; j < d; ++j) g[j] = g[j] / (1.f + exp_approx(-g[j]));
        Rows<scalar_t>::round(g, d);
        for (int64_t j = 0; j < d; ++j) g[j] *= up[j];
        Rows<scalar_t>::store(o + r * d, g, d);
      }
    });
  });
  return out.view(out_shape);
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding, GPT-NeoX (rotate-half) layout, as transformers' apply_rotary_pos_emb, with
// the step's cos/sin given in T ([tokens, head_dim], both halves equal): for j < half,
//   out[j]        = T(T(x[j] * cos[j]) + T(-x[j + half] * sin[j]))
//   out[j + half] = T(T(x[j + half] * cos[j]) + T(x[j] * sin[j]))
template <typename T>
void rotate_heads(T* out, const T* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride,
                  int64_t head_stride, const T* cos, const T* sin) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, grain_for(tokens, heads * head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(4 * head_dim);
    float *c = buf.data(), *s = c + head_dim, *v = s + head_dim, *o = v + head_dim;
    for (int64_t t = begin; t < end; ++t) {
      Rows<T>::load(c, cos + t * head_dim, half);
      Rows<T>::load(s, sin + t * head_dim, half);
      for (int64_t h = 0; h < heads; ++h) {
        Rows<T>::load(v, x + t * token_stride + h * head_stride, head_dim);
        float *lo = o, *hi = o + half, *a = v, *b = v + half;
        for (int64_t j = 0; j < half; ++j) {
          lo[j] = a[j] * c[j];
          hi[j] = -b[j] * s[j];
        }
        Rows<T>::round(o, head_dim);
        for (int64_t j = 0; j < half; ++j) lo[j] += hi[j];
        for (int64_t j = 0; j < half; ++j) {
          hi[j] = b[j] * c[j];
          b[j] = a[j] * s[j];  // v's upper half is no longer needed as input
        }
        Rows<T>::round(hi, half);
        Rows<T>::round(b, half);
        for (int64_t j = 0; j < half; ++j) hi[j] += b[j];
        Rows<T>::store(out + (t * heads + h) * head_dim, o, head_dim);
      }
    }
  });
}
std::tuple<at::Tensor, at::Tensor> apply_rotary_emb(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(-1) == 1 && k.stride(-1) == 1,
              "apply_rotary_emb: q and k must be [tokens, heads, head_dim] with a contiguous last dimension");
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  TORCH_CHECK(cos.numel() == tokens * head_dim && sin.numel() == tokens * head_dim,
              "apply_rotary_emb: cos and sin must be [tokens, 1, head_dim]");
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type() &&
                  k.scalar_type() == q.scalar_type(),
              "apply_rotary_emb: q, k, cos and sin dtypes differ");
  at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  PYXLLM_DISPATCH_FLOAT(q.scalar_type(), "apply_rotary_emb", [&] {
    rotate_heads<scalar_t>(q_out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), tokens, q.size(1), head_dim,
                           q.stride(0), q.stride(1), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>());
    rotate_heads<scalar_t>(k_out.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), tokens, k.size(1), head_dim,
                           k.stride(0), k.stride(1), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>());
  });
  return {q_out, k_out};
}

// ---------------------------------------------------------------------------------------------
// Paged KV cache. Layout [num_blocks, block_size, num_kv_heads, row]; a token's flat slot
// is block * block_size + offset, and its K (or V) row of num_kv_heads * row values is contiguous
// at that slot. row is head_dim, or for an int8 cache head_dim + 4: each head's int8 values, then
// that row's float32 scale (q = rint(x * (127 / max |x|)), scale max |x| / 127; 0 for a row of
// zeros), as pyxllm.kernels.native.paged_attention.quantize_kv writes it.
constexpr int64_t kKvScaleBytes = 4;

// One head row of a token as int8 values and their scale (the same float32 operations as the
// reference, so the same bytes).
template <typename T>
void quantize_kv_row(int8_t* dst, const T* src, int64_t head_dim) {
  float amax = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(static_cast<float>(src[d])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
  for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<int8_t>(std::rint(static_cast<float>(src[d]) * inv));
  std::memcpy(dst + head_dim, &scale, kKvScaleBytes);
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "reshape_and_cache: caches must be contiguous");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 ? v_cache.scalar_type() == at::kChar
                   : key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
              "reshape_and_cache: K/V and cache dtypes differ");
  const int64_t tokens = key.size(0), heads = key.size(1), head_dim = key.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim + (int8 ? kKvScaleBytes : 0),
              "reshape_and_cache: the cache's rows do not fit head_dim ", head_dim);
  TORCH_CHECK(k_cache.size(2) == heads && value.sizes() == key.sizes() && v_cache.sizes() == k_cache.sizes(),
              "reshape_and_cache: key, value and the caches must have the same heads and head_dim");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  at::Tensor kc = key.contiguous(), vc = value.contiguous();
  at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == tokens, "reshape_and_cache: slot_mapping must have one slot a token");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(s[t] < num_slots, "reshape_and_cache: slot ", s[t], " is outside the cache");
  if (int8) {
    const int64_t row = heads * (head_dim + kKvScaleBytes);
    PYXLLM_DISPATCH_FLOAT(key.scalar_type(), "reshape_and_cache", [&] {
      for (int64_t t = 0; t < tokens; ++t) {
        if (s[t] < 0) continue;  // padding
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t src = (t * heads + h) * head_dim, dst = s[t] * row + h * (head_dim + kKvScaleBytes);
          quantize_kv_row(k_cache.data_ptr<int8_t>() + dst, kc.data_ptr<scalar_t>() + src, head_dim);
          quantize_kv_row(v_cache.data_ptr<int8_t>() + dst, vc.data_ptr<scalar_t>() + src, head_dim);
        }
      }
    });
    return;
  }
  const int64_t bytes = heads * head_dim * key.element_size();
  auto* kd = static_cast<char*>(k_cache.data_ptr());
  auto* vd = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(kc.data_ptr());
  const auto* vs = static_cast<const char*>(vc.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    if (s[t] < 0) continue;  // padding
    std::memcpy(kd + s[t] * bytes, ks + t * bytes, bytes);
    std::memcpy(vd + s[t] * bytes, vs + t * bytes, bytes);
  }
}

// A cached head row as float32: float/bfloat16 rows converted, int8 rows times their scale.
template <typename C>
inline void load_kv_row(float* dst, const C* src, int64_t head_dim) {
  Rows<C>::load(dst, src, head_dim);
}
template <>
inline void load_kv_row<int8_t>(float* dst, const int8_t* src, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, src + head_dim, kKvScaleBytes);
  for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
}

// The first position a row of seq_len tokens attends: seq_len - sliding_window with a window
// (sliding_window > 0), else 0 (pyxllm.kernels.native.decode_attention_mask's rule; a key limit
// past seq_len does not move it).
inline int64_t window_start(int64_t seq_len, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
}

// rows[l] = the offset in a [num_blocks, block_size, kv_row] cache of head_offset within the K/V
// row of position start + l, for l < len (a sequence with block table `table`; one division
// per block, not per token).
inline void cache_rows(int64_t* rows, const int64_t* table, int64_t start, int64_t len, int64_t block_size,
                       int64_t kv_row, int64_t head_offset) {
  for (int64_t l = start - start % block_size; l < start + len; l += block_size)
    for (int64_t t = 0, base = table[l / block_size] * block_size; t < block_size && l + t < start + len; ++t)
      if (l + t >= start) rows[l + t - start] = (base + t) * kv_row + head_offset;
}

// {sum of a[j]'s lanes : j < 8} in lane order 0, 4, 2, 6, 1, 5, 3, 7 (3-bit reversal), by three
// levels of pairwise shuffle-and-add: 7 adds and 14 shuffles for 8 dot products.
inline Vec8 hsum8_bit_reversed(const Vec8* a) {
  Vec8 half[4], quarter[2];
  for (int j = 0; j < 4; ++j)  // [a_2j: 4 partials | a_2j+1: 4 partials]
    half[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
              __builtin_shufflevector(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int j = 0; j < 2; ++j)  // [a_4j, a_4j+2, a_4j+1, a_4j+3: 2 partials each]
    quarter[j] = __builtin_shufflevector(half[2 * j], half[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(half[2 * j], half[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(quarter[0], quarter[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(quarter[0], quarter[1], 1, 9, 3, 11, 5, 13, 7, 15);
}

constexpr int kBitReversed8[8] = {0, 4, 2, 6, 1, 5, 3, 7};

// The `group` query heads q ([group, 8 * C], scaled) of one KV head over `len` cached tokens;
// token l's key and value rows (8 * C float32) are at k + rows[l] and v + rows[l] (the cache
// itself for float32, a converted copy for bfloat16), and rows[len .. len + 8) repeat the last
// row (tile padding); writes out [group, 8 * C]. scores is [group, len rounded up to 8] scratch.
//   QK: 8 tokens at a time, their rows reused (from L1) by every query head: per chunk of 8
//   dimensions one query load serves 8 key loads, and hsum8_bit_reversed turns the 8 partial-sum
//   vectors into the tile's 8 scores (token j is computed in accumulator kBitReversed8[j], so the
//   lanes come out in token order).
//   PV: 64 output dimensions (8 accumulators) at a time, a pass over the value rows each.
template <int C>
void attend_one_kv_head(float* out, const float* q, const float* k, const float* v, const int64_t* rows, int64_t len,
                        int64_t group, float* scores) {
  constexpr int64_t D = 8 * C;
  const int64_t stride = (len + 7) / 8 * 8;
  for (int64_t l = 0; l < len; l += 8) {
    const float* key[8];
    for (int j = 0; j < 8; ++j) key[j] = k + rows[l + kBitReversed8[j]];
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * D;
      Vec8 acc[8] = {};
      for (int c = 0; c < C; ++c) {
        const Vec8 qc = load8(qg + 8 * c);
        for (int j = 0; j < 8; ++j) acc[j] += qc * load8(key[j] + 8 * c);
      }
      const Vec8 tile = hsum8_bit_reversed(acc);
      std::memcpy(scores + g * stride + l, &tile, sizeof tile);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * stride;
    exp_shifted(sc, len, peak(sc, len));
    const float inv = len ? 1.f / sum(sc, len) : 0.f;
    for (int c0 = 0; c0 < C; c0 += 8) {
      constexpr int kAcc = C < 8 ? C : 8;
      Vec8 acc[kAcc] = {};
      for (int64_t l = 0; l < len; ++l) {
        const float* vl = v + rows[l] + 8 * c0;
        for (int c = 0; c < kAcc; ++c) acc[c] += sc[l] * load8(vl + 8 * c);
      }
      for (int c = 0; c < kAcc; ++c) {
        acc[c] *= inv;
        std::memcpy(out + g * D + 8 * (c0 + c), &acc[c], sizeof(Vec8));
      }
    }
  }
}

// attend_one_kv_head over an int8 cache (rows of 8 * C int8 values and their float32 scale):
// each tile's 8 key rows converted to float32 (times their scales) into an L1 buffer once, for
// all query heads; each value row converted as the weighted sum takes it. Reading the int8 rows
// in place keeps the context's bytes at about half bfloat16's (a float32 copy of a 4096-token
// context is 1 MB per head, which went through L2 twice).
// 8 int8 values as float32 (vpmovsxbd + vcvtdq2ps; GCC's vector extensions make 8 scalar
// conversions of an 8-byte vector).
inline Vec8 load8_int8(const int8_t* p) {
#if defined(__AVX2__)
  return (Vec8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  Vec8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline float row_scale(const int8_t* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof scale);
  return scale;
}

template <int C>
void attend_one_kv_head_int8(float* out, const float* q, const int8_t* k, const int8_t* v, const int64_t* rows,
                             int64_t len, int64_t group, float* scores) {
  constexpr int64_t D = 8 * C;
  const int64_t stride = (len + 7) / 8 * 8;
  alignas(64) float tile_keys[8 * D];
  for (int64_t l = 0; l < len; l += 8) {
    for (int j = 0; j < 8; ++j) {
      const int8_t* row = k + rows[l + kBitReversed8[j]];
      const float scale = row_scale(row, D);
      for (int c = 0; c < C; ++c) {
        const Vec8 kv = load8_int8(row + 8 * c) * scale;
        std::memcpy(tile_keys + j * D + 8 * c, &kv, sizeof kv);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * D;
      Vec8 acc[8] = {};
      for (int c = 0; c < C; ++c) {
        const Vec8 qc = load8(qg + 8 * c);
        for (int j = 0; j < 8; ++j) acc[j] += qc * load8(tile_keys + j * D + 8 * c);
      }
      const Vec8 tile = hsum8_bit_reversed(acc);
      std::memcpy(scores + g * stride + l, &tile, sizeof tile);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * stride;
    exp_shifted(sc, len, peak(sc, len));
    const float inv = len ? 1.f / sum(sc, len) : 0.f;
    for (int c0 = 0; c0 < C; c0 += 8) {
      constexpr int kAcc = C < 8 ? C : 8;
      Vec8 acc[kAcc] = {};
      for (int64_t l = 0; l < len; ++l) {
        const int8_t* row = v + rows[l];
        const float weight = sc[l] * row_scale(row, D);
        for (int c = 0; c < kAcc; ++c) acc[c] += weight * load8_int8(row + 8 * (c0 + c));
      }
      for (int c = 0; c < kAcc; ++c) {
        acc[c] *= inv;
        std::memcpy(out + g * D + 8 * (c0 + c), &acc[c], sizeof(Vec8));
      }
    }
  }
}

// Any head_dim: the same computation with plain loops.
void attend_one_kv_head_any(float* out, const float* q, const float* kf, const float* vf, int64_t len, int64_t group,
                            int64_t head_dim, float* scores) {
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t l = 0; l < len; ++l) scores[l] = dot(q + g * head_dim, kf + l * head_dim, head_dim);
    exp_shifted(scores, len, peak(scores, len));
    const float inv = len ? 1.f / sum(scores, len) : 0.f;
    float* o = out + g * head_dim;
    std::fill(o, o + head_dim, 0.f);
    for (int64_t l = 0; l < len; ++l)
      for (int64_t d = 0; d < head_dim; ++d) o[d] += scores[l] * vf[l * head_dim + d];
    for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
  }
}

#if defined(__AVX512BF16__)
// probabilities[i] = the bfloat16 bits of p[i] (bf16_bits' rule, 16 at a time), i < n; a zero
// after them where n is odd, so that they read as n / 2 + 1 pairs.
inline void bf16_probabilities(uint16_t* probabilities, const float* p, int64_t n) {
  typedef uint32_t U32x16 __attribute__((vector_size(64)));
  typedef uint16_t U16x16 __attribute__((vector_size(32)));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const Vec16 v = load16(p + i);
    U32x16 u;
    std::memcpy(&u, &v, sizeof u);
    U32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    rounded = v != v ? U32x16{} + 0x7fc0u : rounded;
    const U16x16 h = __builtin_convertvector(rounded, U16x16);
    std::memcpy(probabilities + i, &h, sizeof h);
  }
  for (; i < n; ++i) probabilities[i] = bf16_bits(p[i]);
  if (n % 2) probabilities[n] = 0;
}

// The PV product of H query heads of one KV head (acc[h] += p_h[l] v[l] over the tokens, two
// at a time as in attend_one_kv_head_bf16), each head's sums in the same order whatever H,
// scaled by inv[h] and stored as bfloat16 at out + h D, or, with partial set, as float32 at
// partial + h (D + 2) + 2: the value rows are read once for the H heads.
template <int D, int H>
void attend_values_bf16(BFloat16* out, float* partial, const BFloat16* v_cache, const int64_t* rows, int64_t len,
                        const uint32_t* probs, int64_t pairs, const float* inv) {
  constexpr int P = D / 32;
  __m512 acc[H][2 * P];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const BFloat16* v0 = v_cache + rows[2 * j];
    const BFloat16* v1 = 2 * j + 1 < len ? v_cache + rows[2 * j + 1] : nullptr;
    __m512bh p[H];
    for (int h = 0; h < H; ++h) p[h] = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(probs[h * pairs + j]));
    for (int i = 0; i < P; ++i) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * i);
      const __m512i b = v1 ? _mm512_loadu_si512(v1 + 32 * i) : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int h = 0; h < H; ++h) {
        acc[h][2 * i] = _mm512_dpbf16_ps(acc[h][2 * i], lo, p[h]);
        acc[h][2 * i + 1] = _mm512_dpbf16_ps(acc[h][2 * i + 1], hi, p[h]);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    float o[D];
    for (int i = 0; i < P; ++i) {
      alignas(64) float lo[16], hi[16];
      _mm512_store_ps(lo, acc[h][2 * i]);
      _mm512_store_ps(hi, acc[h][2 * i + 1]);
      for (int j = 0; j < 4; ++j)
        for (int t = 0; t < 4; ++t) {
          o[32 * i + 8 * j + t] = lo[4 * j + t] * inv[h];
          o[32 * i + 8 * j + 4 + t] = hi[4 * j + t] * inv[h];
        }
    }
    if (partial)
      std::memcpy(partial + h * (D + 2) + 2, o, sizeof o);
    else
      Rows<BFloat16>::store(out + h * D, o, D);
  }
}

// attend_values_bf16 for n (1 .. H) heads: the accumulators of n heads stay in registers.
template <int D, int H>
void attend_values_bf16_n(int n, BFloat16* out, float* partial, const BFloat16* v_cache, const int64_t* rows,
                          int64_t len, const uint32_t* probs, int64_t pairs, const float* inv) {
  if constexpr (H > 1) {
    if (n < H) return attend_values_bf16_n<D, H - 1>(n, out, partial, v_cache, rows, len, probs, pairs, inv);
  }
  attend_values_bf16<D, H>(out, partial, v_cache, rows, len, probs, pairs, inv);
}

// bfloat16 decode attention of one KV head with AVX512-BF16 dot products (vdpbf16ps: 32 bf16
// products a cycle summed in pairs into 16 float32 lanes), reading the cache rows as they are,
// without converting them. q is [group, D] bf16 (scaled and rounded, as the reference); rows[l]
// is the offset of token l's K/V row in the caches; scores is [group, len] float32 scratch,
// probs [group, len / 2 + 1] pairs of bf16 and inv [group] float32 scratch.
//   QK: 4 cached tokens at a time, their D/32 key vectors reused by every query head.
//   softmax in float32; the probabilities rounded to bf16 (where the reference rounds them).
//   PV: 2 tokens at a time: their value rows interleaved (unpacklo/hi_epi16) so that one
//   vdpbf16ps adds p[l] v[l] + p[l+1] v[l+1]; the interleave permutes the output dimensions
//   within each 32-wide chunk (lane 4j + t of the low half is dimension 8j + t, of the high
//   half 8j + 4 + t), which the store undoes. Up to 24 / (D / 16) query heads (6 at D = 64,
//   3 at D = 128) a pass over the value rows, their accumulators in registers.
// With partial set (one chunk of a long context, see decode_attention_bf16), nothing is written
// to out: partial[g * (D + 2) ...] gets head g's largest score, its sum of exp(score - largest)
// and its D unnormalized outputs (sum of bf16(p) v), in float32.
template <int D>
void attend_one_kv_head_bf16(BFloat16* out, float* partial, const BFloat16* q, const BFloat16* k_cache,
                             const BFloat16* v_cache, const int64_t* rows, int64_t len, int64_t group, float* scores,
                             uint32_t* probs, float* inv) {
  constexpr int P = D / 32;  // 512-bit vectors of bf16 per row
  auto row = [&](const BFloat16* cache, int64_t l) { return cache + rows[l]; };
  auto load_bh = [](const BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  auto key_dot = [&](const __m512bh* k, int64_t g) {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), load_bh(q + g * D), k[0]);
    for (int i = 1; i < P; ++i) acc = _mm512_dpbf16_ps(acc, load_bh(q + g * D + 32 * i), k[i]);
    return (Vec16)acc;
  };
  int64_t l = 0;
  for (; l + 4 <= len; l += 4) {
    __m512bh k[4][P];
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < P; ++i) k[j][i] = load_bh(row(k_cache, l + j) + 32 * i);
    for (int64_t g = 0; g < group; ++g)
      hsum4(key_dot(k[0], g), key_dot(k[1], g), key_dot(k[2], g), key_dot(k[3], g), scores + g * len + l);
  }
  for (; l < len; ++l) {
    __m512bh k[P];
    for (int i = 0; i < P; ++i) k[i] = load_bh(row(k_cache, l) + 32 * i);
    for (int64_t g = 0; g < group; ++g) scores[g * len + l] = hsum(key_dot(k, g));
  }
  const int64_t pairs = (len + 1) / 2;
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * len;
    const float largest = peak(sc, len);
    exp_shifted(sc, len, largest);
    if (partial) {
      partial[g * (D + 2)] = largest;
      partial[g * (D + 2) + 1] = sum(sc, len);
      inv[g] = 1.f;  // (x * 1 is x: the outputs stay unnormalized)
    } else {
      inv[g] = 1.f / sum(sc, len);
    }
    bf16_probabilities(reinterpret_cast<uint16_t*>(probs + g * pairs), sc, len);
  }
  constexpr int H = 24 / (2 * P);  // heads a pass: 2P accumulators each
  for (int64_t g0 = 0; g0 < group; g0 += H) {
    const int heads = static_cast<int>(std::min<int64_t>(H, group - g0));
    attend_values_bf16_n<D, H>(heads, partial ? nullptr : out + g0 * D, partial ? partial + g0 * (D + 2) : nullptr,
                               v_cache, rows, len, probs + g0 * pairs, pairs, inv + g0);
  }
}
#endif

// The group of query heads sharing KV head kvh of row b, into q ([group, head_dim] float32):
// scaled, then rounded to T (where the reference scales the query in T).
template <typename T>
void scaled_query(float* q, const T* query, int64_t b, int64_t kvh, int64_t group, int64_t head_dim,
                  int64_t q_stride_b, int64_t q_stride_h, float scale) {
  for (int64_t g = 0; g < group; ++g) {
    float* qg = q + g * head_dim;
    Rows<T>::load(qg, query + b * q_stride_b + (kvh * group + g) * q_stride_h, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) qg[d] *= scale;
    Rows<T>::round(qg, head_dim);
  }
}

#if defined(__AVX512BF16__)
// Keys a chunk of decode_attention_bf16 attends at most.
constexpr int64_t kKeyChunk = 256;

// Head kvh's outputs for its `group` query heads from a row's chunks: part points at chunk 0's
// partials of that KV head (attend_one_kv_head_bf16's), chunk c's chunk_stride floats further.
// With M = max m_c and w_c = exp(m_c - M): out = T(sum w_c o_c * (1 / sum w_c s_c)), in chunk
// order.
template <int D>
void combine_chunks(BFloat16* out, const float* part, int64_t chunk_stride, int64_t chunks, int64_t group) {
  for (int64_t g = 0; g < group; ++g) {
    float largest = part[g * (D + 2)];
    for (int64_t c = 1; c < chunks; ++c) {
      const float m = part[c * chunk_stride + g * (D + 2)];
      largest = largest < m ? m : largest;
    }
    float total = 0.f, o[D] = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const float* pc = part + c * chunk_stride + g * (D + 2);
      const float w = exp_approx(pc[0] - largest);
      total += w * pc[1];
      for (int d = 0; d < D; ++d) o[d] += w * pc[2 + d];
    }
    const float inverse = 1.f / total;
    for (int d = 0; d < D; ++d) o[d] *= inverse;
    Rows<BFloat16>::store(out + g * D, o, D);
  }
}

// decode_attention for a bfloat16 query and cache, head_dim D (64 or 128), on AVX512-BF16
// (attend_one_kv_head_bf16). A row attending more than kKeyChunk keys is cut into chunks of
// kKeyChunk keys from its first one (the last chunk shorter); each chunk is attended into float32
// partials (each head's largest score, sum of exps and unnormalized outputs) and the chunks are
// combined in order (combine_chunks: flash-decoding's combination, Dao et al., "Flash-Decoding
// for long-context inference", 2023). The chunks depend only on the row's own length, so its
// bits do not depend on the other rows or on the thread count; rows of up to kKeyChunk keys are
// attended in one piece. With fewer rows than threads (a decode of one or two sequences) the
// tasks are a long row's chunks, each over every KV head (a token's cached heads read together),
// or a short row's KV heads, so one long row keeps every thread busy (SmolLM2's 3 KV heads gave
// 2 threads 2 and 1); otherwise a task is a row, its chunks' partials in the task's own scratch.
template <int D>
void decode_attention_bf16(BFloat16* out, const BFloat16* query, const BFloat16* k_cache, const BFloat16* v_cache,
                           const int64_t* block_tables, const int64_t* seq_lens, const int64_t* key_lens,
                           int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                           int64_t max_blocks, int64_t q_stride_b, int64_t q_stride_h, float scale,
                           int64_t sliding_window) {
  const int64_t group = num_heads / num_kv_heads, kv_row = num_kv_heads * D, partial_size = group * (D + 2);
  const int64_t chunk_stride = num_kv_heads * partial_size;  // a chunk's partials: [kv head][group][D + 2]
  const bool spread = batch < at::get_num_threads();
  // row b: keys from position start[b], len[b] of them, in chunks[b] chunks; its tasks are
  // first_task[b] .. first_task[b + 1]; spread, its partials (chunked rows) from first_partial[b]
  std::vector<int64_t> start(batch), len(batch), chunks(batch), first_task(batch + 1, 0), first_partial(batch + 1, 0);
  int64_t longest = 0, most_chunks = 1;
  for (int64_t b = 0; b < batch; ++b) {
    start[b] = window_start(seq_lens[b], sliding_window);
    len[b] = key_lens[b] - start[b];
    chunks[b] = len[b] > kKeyChunk ? (len[b] + kKeyChunk - 1) / kKeyChunk : 1;
    first_task[b + 1] = first_task[b] + (!spread ? 1 : chunks[b] > 1 ? chunks[b] : num_kv_heads);
    first_partial[b + 1] = first_partial[b] + (spread && chunks[b] > 1 ? chunks[b] : 0);
    longest = std::max(longest, std::min(len[b], kKeyChunk));
    most_chunks = std::max(most_chunks, chunks[b]);
  }
  const int64_t tasks = first_task[batch];
  std::unique_ptr<float[]> partials(new float[first_partial[batch] * chunk_stride]);
  const int64_t work = 2 * group * longest * D * (spread ? 1 : num_kv_heads * most_chunks);
  at::parallel_for(0, tasks, grain_for(tasks, work, kSerialAttention), [&](int64_t begin, int64_t end) {
    // scratch left uninitialized (a std::vector would zero it, every call)
    std::unique_ptr<float[]> scores(new float[group * (longest + 8)]), q(new float[group * D]), inv(new float[group]);
    std::unique_ptr<uint32_t[]> probs(new uint32_t[group * (longest / 2 + 1)]);
    std::unique_ptr<BFloat16[]> qh(new BFloat16[group * D]);
    std::unique_ptr<int64_t[]> rows(new int64_t[longest + 8]);
    std::unique_ptr<float[]> own(new float[spread || most_chunks == 1 ? 0 : most_chunks * chunk_stride]);
    // head kvh of row b over chunk c (the whole row where it has one chunk): into out, or into
    // the chunk's partials at `partial`
    auto attend = [&](int64_t b, int64_t kvh, int64_t c, float* partial) {
      BFloat16* head_out = out + (b * num_heads + kvh * group) * D;
      const int64_t from = c * kKeyChunk, n = std::min(len[b] - from, kKeyChunk);  // (one chunk: len[b])
      if (n == 0) {  // an empty row (graph padding): zeros
        std::memset(static_cast<void*>(head_out), 0, group * D * sizeof(BFloat16));
        return;
      }
      scaled_query(q.get(), query, b, kvh, group, D, q_stride_b, q_stride_h, scale);
      Rows<BFloat16>::store(qh.get(), q.get(), group * D);
      cache_rows(rows.get(), block_tables + b * max_blocks, start[b] + from, n, block_size, kv_row, kvh * D);
      attend_one_kv_head_bf16<D>(head_out, partial, qh.get(), k_cache, v_cache, rows.get(), n, group, scores.get(),
                                 probs.get(), inv.get());
    };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const int64_t local = task - first_task[b];
      if (chunks[b] == 1) {
        for (int64_t kvh = spread ? local : 0; kvh < (spread ? local + 1 : num_kv_heads); ++kvh) attend(b, kvh, 0, nullptr);
      } else if (spread) {  // chunk `local`, every KV head; combined below
        float* part = partials.get() + (first_partial[b] + local) * chunk_stride;
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) attend(b, kvh, local, part + kvh * partial_size);
      } else {
        for (int64_t c = 0; c < chunks[b]; ++c)
          for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) attend(b, kvh, c, own.get() + c * chunk_stride + kvh * partial_size);
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh)
          combine_chunks<D>(out + (b * num_heads + kvh * group) * D, own.get() + kvh * partial_size, chunk_stride,
                            chunks[b], group);
      }
    }
  });
  for (int64_t b = 0; b < batch; ++b)  // spread: at most a row a thread
    if (first_partial[b + 1] > first_partial[b])
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh)
        combine_chunks<D>(out + (b * num_heads + kvh * group) * D,
                          partials.get() + first_partial[b] * chunk_stride + kvh * partial_size, chunk_stride,
                          chunks[b], group);
}
#endif

// Decode attention: one query token per sequence over its seq_lens[b] cached tokens (the last
// sliding_window of them when sliding_window > 0: positions len - window .. len - 1), or, where
// key_lens[b] is past seq_lens[b] (a token of an image attended bidirectionally, Gemma 3's),
// over positions start .. key_lens[b] - 1, the window's start still counted from seq_lens[b]
// (pyxllm.kernels.native.decode_attention_mask). A row's sums run over its own keys in the same
// order whatever the other rows, so its bits do not depend on them. A task is
// one sequence (or, when there are fewer sequences than threads, one KV head of one). Bfloat16
// with head_dim 64 or 128 on a CPU with AVX512-BF16 takes decode_attention_bf16 (1.5x faster at
// batch 64, and long rows cut into chunks); otherwise, for each KV head, the context's keys and values are
// gathered (in block order, so the prefetcher streams them) into float32 buffers, and the group
// of query heads sharing that KV head runs over them. Scores and softmax stay float32. Matches
// pyxllm.kernels.native.paged_attention_decode, which also scales the query in T first (but
// rounds scores and probabilities to T as well).
template <typename T, typename C>
void decode_attention(T* out, const T* query, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                      const int64_t* seq_lens, const int64_t* key_lens, int64_t batch, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                      int64_t q_stride_b, int64_t q_stride_h, float scale, int64_t sliding_window) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<C, BFloat16>) {
    if (head_dim == 64 || head_dim == 128) {
      (head_dim == 64 ? decode_attention_bf16<64> : decode_attention_bf16<128>)(
          out, query, k_cache, v_cache, block_tables, seq_lens, key_lens, batch, num_heads, num_kv_heads, block_size,
          max_blocks, q_stride_b, q_stride_h, scale, sliding_window);
      return;
    }
  }
#endif
  const int64_t group = num_heads / num_kv_heads;
  const int64_t head_row = head_dim + (std::is_same_v<C, int8_t> ? kKvScaleBytes : 0);
  const int64_t kv_row = num_kv_heads * head_row;  // values per cached token
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max(max_len, key_lens[b]);
  const int64_t splits = batch < at::get_num_threads() ? num_kv_heads : 1;  // KV-head ranges per sequence
  const int64_t kv_per_task = num_kv_heads / splits;
  const int64_t tasks = batch * splits;
  // float32 attends to the cache rows in place; bfloat16 (without AVX512-BF16) and int8 caches to
  // converted copies
  constexpr bool in_place = std::is_same_v<T, float> && std::is_same_v<C, float>;
  const bool vectorized = head_dim == 64 || head_dim == 128;
  at::parallel_for(0, tasks, grain_for(tasks, 2 * kv_per_task * group * max_len * head_dim, kSerialAttention), [&](int64_t begin, int64_t end) {
    // scratch left uninitialized (a std::vector would zero it, every call)
    const bool copies = !(in_place && vectorized) && !(std::is_same_v<C, int8_t> && vectorized);
    std::unique_ptr<float[]> kf(new float[copies ? max_len * head_dim : 0]), vf(new float[copies ? max_len * head_dim : 0]),
        scores(new float[group * (max_len + 8)]), q(new float[group * head_dim]), o(new float[group * head_dim]);
    std::unique_ptr<int64_t[]> rows(new int64_t[max_len + 8]);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits;
      const int64_t start = window_start(seq_lens[b], sliding_window);
      const int64_t len = key_lens[b] - start;  // tokens attended, from position start
      const int64_t* table = block_tables + b * max_blocks;
      for (int64_t kvh = (task % splits) * kv_per_task; kvh < (task % splits + 1) * kv_per_task; ++kvh) {
        scaled_query(q.get(), query, b, kvh, group, head_dim, q_stride_b, q_stride_h, scale);
        T* head_out = out + (b * num_heads + kvh * group) * head_dim;
        cache_rows(rows.get(), table, start, len, block_size, kv_row, kvh * head_row);
        if constexpr (std::is_same_v<C, int8_t>) {
          if (len > 0 && vectorized) {
            for (int64_t l = len; l < len + 8; ++l) rows[l] = rows[len - 1];  // tile padding
            (head_dim == 64 ? attend_one_kv_head_int8<8> : attend_one_kv_head_int8<16>)(
                o.get(), q.get(), k_cache, v_cache, rows.get(), len, group, scores.get());
            Rows<T>::store(head_out, o.get(), group * head_dim);
            continue;
          }
        }
        const float* k = reinterpret_cast<const float*>(k_cache);
        const float* v = reinterpret_cast<const float*>(v_cache);
        if (copies) {
          for (int64_t l = 0; l < len; ++l) {
            load_kv_row(kf.get() + l * head_dim, k_cache + rows[l], head_dim);
            load_kv_row(vf.get() + l * head_dim, v_cache + rows[l], head_dim);
            rows[l] = l * head_dim;
          }
          k = kf.get();
          v = vf.get();
        }
        for (int64_t l = len; l < len + 8 && len > 0; ++l) rows[l] = rows[len - 1];  // tile padding
        if (head_dim == 64)
          attend_one_kv_head<8>(o.get(), q.get(), k, v, rows.get(), len, group, scores.get());
        else if (head_dim == 128)
          attend_one_kv_head<16>(o.get(), q.get(), k, v, rows.get(), len, group, scores.get());
        else
          attend_one_kv_head_any(o.get(), q.get(), k, v, len, group, head_dim, scores.get());
        Rows<T>::store(head_out, o.get(), group * head_dim);
      }
    }
  });
}

at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window, const std::optional<at::Tensor>& key_lens) {
  TORCH_CHECK(query.dim() == 3 && query.stride(-1) == 1, "paged_attention_decode: query must be [batch, heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention_decode: caches must be contiguous");
  const bool int8 = k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || (k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type()),
              "paged_attention_decode: query and cache dtypes differ");
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim + (int8 ? kKvScaleBytes : 0),
              "paged_attention_decode: the cache's rows do not fit head_dim ", head_dim);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_attention_decode: heads must be a multiple of KV heads");
  at::Tensor tables = block_tables.to(at::kLong).contiguous(), lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) >= batch, "paged_attention_decode: block_tables must be [batch, blocks]");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == batch, "paged_attention_decode: seq_lens must be [batch]");
  // the positions each row attends below: its own length, or its key limit (checked: a length
  // or a limit past its block table, or a limit before the row's end, would read outside its
  // context; B comparisons a call)
  const int64_t capacity = tables.size(1) * k_cache.size(1);
  const int64_t* l = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(0 <= l[b] && l[b] <= capacity, "paged_attention_decode: seq_lens[", b, "] = ", l[b],
                " lies outside the block table's ", capacity, " tokens");
  at::Tensor ends = lens;
  if (key_lens.has_value()) {
    ends = key_lens->to(at::kLong).contiguous();
    TORCH_CHECK(ends.dim() == 1 && ends.size(0) == batch, "paged_attention_decode: key_lens must be [batch]");
    const int64_t* e = ends.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b)
      TORCH_CHECK(l[b] <= e[b] && e[b] <= capacity, "paged_attention_decode: key_lens[", b, "] = ", e[b],
                  " must lie between seq_lens[", b, "] = ", l[b], " and the block table's ", capacity, " tokens");
  }
  at::Tensor out = at::empty({batch, num_heads, head_dim}, query.options());
  PYXLLM_DISPATCH_FLOAT(query.scalar_type(), "paged_attention_decode", [&] {
    auto run = [&](auto* cache_tag) {
      using C = std::remove_const_t<std::remove_pointer_t<decltype(cache_tag)>>;
      decode_attention<scalar_t, C>(out.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(), k_cache.data_ptr<C>(),
                                    v_cache.data_ptr<C>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                    ends.data_ptr<int64_t>(), batch,
                                    num_heads, num_kv_heads, head_dim, k_cache.size(1), tables.size(1),
                                    query.stride(0), query.stride(1), static_cast<float>(scale), sliding_window);
    };
    if (int8) {
      run(static_cast<int8_t*>(nullptr));
    } else {
      run(static_cast<scalar_t*>(nullptr));
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// W8A8 linear: int8 weights per output channel (qweight [N, K], weight_scales [N] float32) times
// int8 activations per token, accumulated in int32 by at::_int_mm (oneDNN, VNNI where present):
//   amax[m] = max_k |x[m, k]|,  q[m, k] = clamp(rint(x[m, k] * (127 / amax[m])), -127, 127)
//   y[m, n] = T((acc[m, n] * (amax[m] / 127)) * weight_scales[n])  (then T(y + bias) with a bias)
// A row of zeros quantizes to zeros with scale 0. With hadamard_block > 0, each row is first
// multiplied by the block-diagonal Sylvester Hadamard matrix of that block size (a fast
// Walsh-Hadamard transform, stage by stage). Same formula as pyxllm.kernels.native.w8a8_linear.
// Largest |value| of n floats.
inline float abs_max(const float* x, int64_t n) {
  Vec8 m = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const Vec8 v = load8(x + i);
    const Vec8 a = v < 0 ? -v : v;
    m = m > a ? m : a;
  }
  float best = 0.f;
  for (int j = 0; j < 8; ++j) best = std::max(best, m[j]);
  for (; i < n; ++i) best = std::max(best, std::fabs(x[i]));
  return best;
}

// The first four Hadamard stages (h = 1, 2, 4, 8) of 16 values, in registers: lane j takes
// x[j] + x[j ^ h] where bit h of j is clear, x[j ^ h] - x[j] where it is set.
inline Vec16 hadamard16(Vec16 v) {
  typedef int32_t Mask16 __attribute__((vector_size(64)));
  const Mask16 m1 = {0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1};
  const Mask16 m2 = {0, 0, -1, -1, 0, 0, -1, -1, 0, 0, -1, -1, 0, 0, -1, -1};
  const Mask16 m4 = {0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0, -1, -1, -1, -1};
  const Mask16 m8 = {0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1};
  Vec16 a = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  v = m1 ? a - v : v + a;
  a = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = m2 ? a - v : v + a;
  a = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = m4 ? a - v : v + a;
  a = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  return m8 ? a - v : v + a;
}

// x <- x H for each block of `block` values (a power of two), H the Sylvester Hadamard matrix
// (H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]): log2(block) stages of sums and differences,
// the first four in registers (blocks of 16 or more), the others on whole vectors.
inline void hadamard_blocks(float* x, int64_t n, int64_t block) {
  int64_t h = 1;
  if (block >= kLanes) {
    for (int64_t i = 0; i < n; i += kLanes) {
      const Vec16 v = hadamard16(load16(x + i));
      std::memcpy(x + i, &v, sizeof v);
    }
    h = kLanes;
  }
  for (; h < block; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// The row length is copied into a local: an int8 store may alias anything, a captured variable
// included, and GCC does not vectorize a loop whose bound a store might change.
template <typename T>
void quantize_rows_int8(int8_t* q, float* scales, const T* x, int64_t rows, int64_t k, int64_t x_stride,
                        int64_t hadamard_block) {
  at::parallel_for(0, rows, grain_for(rows, k), [&](int64_t begin, int64_t end) {
    const int64_t n = k;
    std::vector<float> buf(n);
    float* b = buf.data();
    for (int64_t r = begin; r < end; ++r) {
      Rows<T>::load(b, x + r * x_stride, n);
      if (hadamard_block > 0) hadamard_blocks(b, n, hadamard_block);
      const float amax = abs_max(b, n);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* qr = q + r * n;
      for (int64_t j = 0; j < n; ++j)
        qr[j] = static_cast<int8_t>(std::min(std::max(std::rint(b[j] * inv), -127.f), 127.f));
      scales[r] = amax / 127.f;
    }
  });
}

template <typename T>
void dequantize_rows(T* y, const int32_t* acc, const float* x_scales, const float* w_scales, const T* bias,
                     int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain_for(rows, n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n), b(bias ? n : 0);
    float* o = buf.data();
    if (bias) Rows<T>::load(b.data(), bias, n);
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a = acc + r * n;
      const float sx = x_scales[r];
      for (int64_t j = 0; j < n; ++j) o[j] = (static_cast<float>(a[j]) * sx) * w_scales[j];
      if (bias) {
        Rows<T>::round(o, n);
        for (int64_t j = 0; j < n; ++j) o[j] += b[j];
      }
      Rows<T>::store(y + r * n, o, n);
    }
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// acc[r, n] = sum_k q[r, k] * qweight[n, k] for a few rows (int32, exact: the sums _int_mm gives),
// one pass over the weights for all rows. vpdpbusd multiplies unsigned by signed bytes, so the
// weights go in as qweight + 128 (unsigned; one xor per 64 weight bytes, shared by every row)
// and 128 * sum_k q[r, k] is taken off each row's sums again. oneDNN's _int_mm spends ~2.9 ms on
// the 49152 x 576 LM head at one row here, ~2x the time reading its 28 MB takes.

constexpr int64_t kW8A8SmallRows = 8;
// How far ahead of the piece it multiplies the kernel asks for weights (a software prefetch):
// 64 cache lines. The hardware prefetchers alone left the 8-sequence w8a8 decode step of the
// default model at 24.2 ms and the one-sequence step at 10.4 ms; with 1, 2, 4, 8 KB ahead they
// took 22.0, 18.6, 18.9, 18.7 and 9.5, 7.0, 7.2, 6.6 ms (2 threads, 2026-12-02).
constexpr int64_t kWeightPrefetchBytes = 4096;

// The 16 int32 totals of 16 vectors of 16 partial sums: lane e of the result is the sum of v[e]'s
// lanes (an add-and-transpose tree: ~45 instructions where 16 horizontal reductions take ~150).
inline __m512i reduce_add16(const __m512i (&v)[16]) {
  __m512i pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // each 128-bit lane: [v2i(0)+v2i(2), v2i+1(0)+(2), v2i(1)+(3), ...]
    pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: that lane's sums of v[4i .. 4i+3]
    quads[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * i], pairs[2 * i + 1]),
                                _mm512_unpackhi_epi64(pairs[2 * i], pairs[2 * i + 1]));
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512i low = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[0], quads[1], kEven),
                                       _mm512_shuffle_i32x4(quads[0], quads[1], kOdd));
  const __m512i high = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2], quads[3], kEven),
                                        _mm512_shuffle_i32x4(quads[2], quads[3], kOdd));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(low, high, kEven), _mm512_shuffle_i32x4(low, high, kOdd));
}

// Output columns [j, j + C) of M rows (M * C <= 16 accumulators): C weight rows stream through
// together, each 64-byte piece multiplied with every row's activations (in L1).
template <int M, int C>
void int8_rows_block(int32_t* acc, const int8_t* q, const int32_t* q_sums, const int8_t* w, int64_t k,
                     int64_t n, int64_t j) {
  static_assert(M * C <= 16);
  const int64_t full = k / 64 * 64;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i sums[16];
  for (auto& s : sums) s = _mm512_setzero_si512();
  for (int64_t i = 0; i < full; i += 64)
    for (int c = 0; c < C; ++c) {
      const int8_t* piece = w + (j + c) * k + i;
      _mm_prefetch(reinterpret_cast<const char*>(piece) + kWeightPrefetchBytes, _MM_HINT_T0);
      const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(piece), flip);
      for (int m = 0; m < M; ++m)
        sums[c * M + m] = _mm512_dpbusd_epi32(sums[c * M + m], wv, _mm512_loadu_si512(q + m * k + i));
    }
  alignas(64) int32_t totals[16];
  _mm512_store_si512(totals, reduce_add16(sums));
  for (int c = 0; c < C; ++c) {
    const int8_t* row = w + (j + c) * k;
    for (int m = 0; m < M; ++m) {
      int32_t total = totals[c * M + m] - 128 * q_sums[m];
      for (int64_t i = full; i < k; ++i) total += static_cast<int32_t>(q[m * k + i]) * row[i];
      acc[m * n + j + c] = total;
    }
  }
}

template <int M>
void int8_rows_columns(int32_t* acc, const int8_t* q, const int32_t* q_sums, const int8_t* w, int64_t k,
                       int64_t n, int64_t n0, int64_t n1) {
  constexpr int C = 16 / M;
  int64_t j = n0;
  for (; j + C <= n1; j += C) int8_rows_block<M, C>(acc, q, q_sums, w, k, n, j);
  for (; j < n1; ++j) int8_rows_block<M, 1>(acc, q, q_sums, w, k, n, j);
}

void int8_rows(int32_t* acc, const int8_t* q, const int8_t* w, int64_t rows, int64_t k, int64_t n) {
  int32_t q_sums[kW8A8SmallRows];  // sum_k q[r, k] over the first 64-multiple of k
  const int64_t full = k / 64 * 64;
  for (int64_t r = 0; r < rows; ++r) {
    int32_t total = 0;
    for (int64_t i = 0; i < full; ++i) total += q[r * k + i];
    q_sums[r] = total;
  }
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    switch (rows) {
      case 1: return int8_rows_columns<1>(acc, q, q_sums, w, k, n, begin, end);
      case 2: return int8_rows_columns<2>(acc, q, q_sums, w, k, n, begin, end);
      case 3: return int8_rows_columns<3>(acc, q, q_sums, w, k, n, begin, end);
      case 4: return int8_rows_columns<4>(acc, q, q_sums, w, k, n, begin, end);
      case 5: return int8_rows_columns<5>(acc, q, q_sums, w, k, n, begin, end);
      case 6: return int8_rows_columns<6>(acc, q, q_sums, w, k, n, begin, end);
      case 7: return int8_rows_columns<7>(acc, q, q_sums, w, k, n, begin, end);
      default: return int8_rows_columns<8>(acc, q, q_sums, w, k, n, begin, end);
    }
  });
}
#endif

constexpr int64_t kW8A8RowChunk = 256;

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scales,
                       const std::optional<at::Tensor>& bias, int64_t hadamard_block) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "w8a8_linear: qweight must be a contiguous int8 [N, K] tensor");
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.is_contiguous() &&
                  weight_scales.numel() == qweight.size(0),
              "w8a8_linear: weight_scales must be float32 [N]");
  const int64_t k = x.size(-1), n = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == k, "w8a8_linear: x has ", k, " input features, qweight ", qweight.size(1));
  TORCH_CHECK(hadamard_block == 0 || (hadamard_block > 0 && (hadamard_block & (hadamard_block - 1)) == 0 &&
                                      k % hadamard_block == 0),
              "w8a8_linear: hadamard_block must be 0 or a power of two dividing ", k, ", got ", hadamard_block);
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(-1) != 1) x2 = x2.contiguous();
  const int64_t rows = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out.view(out_shape);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor x_scales = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n && b.scalar_type() == x.scalar_type(), "w8a8_linear: bias must be [N] in x's dtype");
  }
  PYXLLM_DISPATCH_FLOAT(x.scalar_type(), "w8a8_linear", [&] {
    quantize_rows_int8<scalar_t>(q.data_ptr<int8_t>(), x_scales.data_ptr<float>(), x2.data_ptr<scalar_t>(), rows, k,
                                 x2.stride(0), hadamard_block);
    // Row chunks, so that each chunk's int32 sums are rescaled while still in cache (a prefill's
    // [rows, N] int32 would go through memory twice); int8 GEMMs of 256 rows run at full speed.
    at::Tensor acc = at::empty({std::min(rows, kW8A8RowChunk), n}, x.options().dtype(at::kInt));
    for (int64_t m0 = 0; m0 < rows; m0 += kW8A8RowChunk) {
      const int64_t mc = std::min(kW8A8RowChunk, rows - m0);
      at::Tensor chunk = acc.narrow(0, 0, mc);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (mc <= kW8A8SmallRows) {
        int8_rows(chunk.data_ptr<int32_t>(), q.data_ptr<int8_t>() + m0 * k, qweight.data_ptr<int8_t>(), mc, k, n);
      } else {
        at::_int_mm_out(chunk, q.narrow(0, m0, mc), qweight.t());
      }
#else
      at::_int_mm_out(chunk, q.narrow(0, m0, mc), qweight.t());
#endif
      dequantize_rows<scalar_t>(out.data_ptr<scalar_t>() + m0 * n, chunk.data_ptr<int32_t>(),
                                x_scales.data_ptr<float>() + m0, weight_scales.data_ptr<float>(),
                                b.defined() ? b.data_ptr<scalar_t>() : nullptr, mc, n);
    }
  });
  return out.view(out_shape);
}

// ---------------------------------------------------------------------------------------------
// Float32 linear layers, each output computed alone: y[M, N] = x[M, K] @ w[N, K]^T (+ bias).
// y[m, n] is the same sequence of operations at any row count M, whatever the other rows are:
// 8-lane fused multiply-adds over k in order (k % 8 == j into lane j), the lanes summed by
// hsum8, the k % 8 tail and the bias added in order. So a row gets the same bits in a batch of
// any size (--batch-invariant, the default: MKL's sgemm sums a row in another order for almost
// every M, measured from M = 2 on); the blocking below only decides which outputs share
// registers and loads.
//
// Blocks of kRowBlock rows x kColBlock weight rows: each loaded weight vector serves kRowBlock
// rows and each x vector kColBlock weight rows (12 accumulators, 2 weight and 1 x vector: 15 of
// AVX2's 16 registers). A task owns kColsPerTask weight rows (L2-resident while every row block
// passes over them) for all rows; with one row (decode) the weights stream from memory once.
// Decode: each weight row is read once for all of a small batch's rows, so 2-8 rows cost about
// one (MKL's GEMM over 2-8 rows cost ~2.3x its one-row GEMV on the AVX2 development machine,
// docs/speculative.md).
constexpr int kRowBlock = 6;
constexpr int kColBlock = 2;
constexpr int64_t kColsPerTask = 32;
constexpr int64_t kSerialLinearMacs = int64_t{1} << 18;  // as group_linear.cpp's kSerialMacs

inline float hsum8(Vec8 v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

// a * b + c in each lane, rounded once (explicit: the build turns contraction off)
inline Vec8 fma8(Vec8 a, Vec8 b, Vec8 c) {
#if defined(__FMA__)
  return (Vec8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// Rows [m0, m0 + R) x weight rows [j0, j0 + C).
template <int R, int C>
void rowwise_block(float* y, const float* x, const float* w, const float* bias, int64_t k, int64_t n, int64_t m0,
                   int64_t j0) {
  Vec8 acc[R][C] = {};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    Vec8 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load8(w + (j0 + c) * k + i);
    for (int r = 0; r < R; ++r) {
      const Vec8 xv = load8(x + (m0 + r) * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = fma8(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float* row = w + (j0 + c) * k;
      const float* xr = x + (m0 + r) * k;
      float total = hsum8(acc[r][c]);
      for (int64_t t = i; t < k; ++t) total += row[t] * xr[t];
      y[(m0 + r) * n + j0 + c] = bias ? total + bias[j0 + c] : total;
    }
}

template <int R>
void rowwise_rows(float* y, const float* x, const float* w, const float* bias, int64_t k, int64_t n, int64_t m0,
                  int64_t j0, int64_t j1) {
  int64_t j = j0;
  for (; j + kColBlock <= j1; j += kColBlock) rowwise_block<R, kColBlock>(y, x, w, bias, k, n, m0, j);
  for (; j < j1; ++j) rowwise_block<R, 1>(y, x, w, bias, k, n, m0, j);
}

void rowwise_columns(float* y, const float* x, const float* w, const float* bias, int64_t rows, int64_t k, int64_t n,
                     int64_t j0, int64_t j1) {
  int64_t m = 0;
  for (; m + kRowBlock <= rows; m += kRowBlock) rowwise_rows<kRowBlock>(y, x, w, bias, k, n, m, j0, j1);
  switch (rows - m) {
    case 1: rowwise_rows<1>(y, x, w, bias, k, n, m, j0, j1); break;
    case 2: rowwise_rows<2>(y, x, w, bias, k, n, m, j0, j1); break;
    case 3: rowwise_rows<3>(y, x, w, bias, k, n, m, j0, j1); break;
    case 4: rowwise_rows<4>(y, x, w, bias, k, n, m, j0, j1); break;
    case 5: rowwise_rows<5>(y, x, w, bias, k, n, m, j0, j1); break;
    default: break;
  }
}

at::Tensor rowwise_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "rowwise_linear: weight must be a contiguous float32 [N, K] tensor");
  const int64_t k = weight.size(1), n = weight.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == k, "rowwise_linear: x must be float32 [..., ", k, "]");
  at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t rows = x2.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n && b.scalar_type() == at::kFloat, "rowwise_linear: bias must be float32 [N]");
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out.view(out_shape);
  float* y = out.data_ptr<float>();
  const float* xp = x2.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  // a task's microseconds must outweigh its scheduling: at least kColsPerTask weight rows, and
  // below kSerialLinearMacs in all (a LoRA adapter's small matmuls) the calling thread alone
  const int64_t grain = rows * n * k < kSerialLinearMacs ? n : kColsPerTask;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j0 = begin; j0 < end; j0 += kColsPerTask)
      rowwise_columns(y, xp, wp, bp, rows, k, n, j0, std::min(end, j0 + kColsPerTask));
  });
  return out.view(out_shape);
}

// ---------------------------------------------------------------------------------------------
// LoRA deltas of a step whose rows use different adapters, added to the base output in place,
// one call per layer (vLLM's punica "shrink" then "expand"). Adapter g's layer is a_g [in, R_g]
// (its A matrices transposed and side by side, R_g a multiple of 8), b_g (each module's
// B * scaling transposed, [rank, out features], one after the other) and segments_g [M, 5]:
// per module (out_start, out_len, rank_start, rank_len, b_offset). Row m with adapter
// g = row_adapter[m] >= 0 gets
//   xa[j] = sum_i x[m, i] a_g[i, j]
//   y[m, out_start + c] += sum_j xa[rank_start + j] b_g[b_offset + j * out_len + c]
// each sum in float32, one fused multiply-add per term in the order of j (and of i, the even
// and the odd terms apart, then added), an output's terms in one vector lane of its own (no
// reduction across lanes), then y's value plus the sum rounded once to y's dtype (as torch's y.add_(delta) with a float32 delta). So a row's bits
// depend on its own x and adapter alone, whatever else shares the call: rows on one adapter
// are computed together (up to kLoraRows at a time, the weights read once for them), which
// changes no sum's order. Rows with g = -1, or whose adapter has no weights for the layer (an
// empty a_g), are left as they are. Weights may be float32 or bfloat16 (widened exactly).
// Where the build has AVX-512 BF16, bfloat16 rows on bfloat16 weights take the shrink in pairs
// of terms instead (vdpbf16ps: see lora_shrink_pairs_tile), in the same order for any rows.
// the scalar form of fma8 for a column tail, rounding as the vector lanes do
inline float fma1(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

// Lane traits of the LoRA kernels: a vector of float32 lanes, its loads (float32, or bfloat16
// widened exactly), broadcast, fused multiply-add, and the add into y rounded once to y's dtype.
// Each lane computes its output's sum alone, so a lane's bits are the same in either width: the
// width sets how many outputs one instruction carries, nothing else.
struct LoraLanes8 {
  using V = Vec8;
  static constexpr int64_t kWidth = 8;
  static V zero() { return V{}; }
  static V load(const float* p) { return load8(p); }
  static V load(const BFloat16* p) {
#if defined(__AVX2__)
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return (V)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
    U16x8 h;
    std::memcpy(&h, p, sizeof h);
    const U32x8 w = __builtin_convertvector(h, U32x8) << 16;
    V v;
    std::memcpy(&v, &w, sizeof v);
    return v;
#endif
  }
  static V broadcast(float s) { return V{s, s, s, s, s, s, s, s}; }
  static V fma(V a, V b, V c) { return fma8(a, b, c); }
  static V add(V a, V b) { return a + b; }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
  static void add_rounded(float* y, V d) { store(y, load8(y) + d); }
  // bf16_bits' rule, vectorized
  static void add_rounded(BFloat16* y, V d) {
    const V v = load(y) + d;
    U32x8 u;
    std::memcpy(&u, &v, sizeof u);
    U32x8 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    rounded = v != v ? U32x8{} + 0x7fc0u : rounded;  // NaN kept a NaN
    const U16x8 h = __builtin_convertvector(rounded, U16x8);
    std::memcpy(y, &h, sizeof h);
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PYXLLM_LORA_LANES16 1
struct LoraLanes16 {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V broadcast(float s) { return _mm512_set1_ps(s); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void add_rounded(float* y, V d) { _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), d)); }
  static void add_rounded(BFloat16* y, V d) {
    const V v = _mm512_add_ps(load(y), d);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(rounded));
  }
};
// the widest lanes the build has: 16 with AVX-512 (twice the outputs per instruction, and 32
// registers for the tiles), else 8
using LoraWide = LoraLanes16;
constexpr int kLoraRegisters = 32;
#else
using LoraWide = LoraLanes8;
constexpr int kLoraRegisters = 16;
#endif

inline float load1w(const float* p) { return *p; }
inline float load1w(const BFloat16* p) {
  uint16_t raw;
  std::memcpy(&raw, p, sizeof raw);
  return bits_to_float(static_cast<uint32_t>(raw) << 16);
}

// one lane's worth of add_rounded, for a column tail
inline void add_rounded(float* y, float d) { *y = *y + d; }
inline void add_rounded(BFloat16* y, float d) {
  uint16_t raw;
  std::memcpy(&raw, y, sizeof raw);
  raw = bf16_bits(bits_to_float(static_cast<uint32_t>(raw) << 16) + d);
  std::memcpy(y, &raw, sizeof raw);
}

constexpr int kLoraRows = 4;

// xa[r, j0 .. j0 + NV lanes) for the NR rows xf [NR, k] (float32) over a [k, R]: each lane sums
// the even i and the odd i apart (two chains of fused multiply-adds in the order of i), then
// adds the two, whatever NR, NV and the lane width
template <class L, int NR, int NV, typename W>
void lora_shrink_tile(float* xa, const float* xf, const W* a, int64_t k, int64_t R, int64_t j0) {
  using V = typename L::V;
  constexpr int64_t w = L::kWidth;
  V even[NR][NV], odd[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) even[r][v] = odd[r][v] = L::zero();
  int64_t i = 0;
  for (; i + 2 <= k; i += 2) {
    V w0[NV], w1[NV];
    for (int v = 0; v < NV; ++v) {
      w0[v] = L::load(a + i * R + j0 + w * v);
      w1[v] = L::load(a + (i + 1) * R + j0 + w * v);
    }
    for (int r = 0; r < NR; ++r) {
      const V x0 = L::broadcast(xf[r * k + i]), x1 = L::broadcast(xf[r * k + i + 1]);
      for (int v = 0; v < NV; ++v) {
        even[r][v] = L::fma(x0, w0[v], even[r][v]);
        odd[r][v] = L::fma(x1, w1[v], odd[r][v]);
      }
    }
  }
  if (i < k)
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < NV; ++v)
        even[r][v] = L::fma(L::broadcast(xf[r * k + i]), L::load(a + i * R + j0 + w * v), even[r][v]);
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) L::store(xa + r * R + j0 + w * v, L::add(even[r][v], odd[r][v]));
}

#if defined(PYXLLM_LORA_LANES16) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define PYXLLM_LORA_DPBF16 1
// The shrink of bfloat16 rows over bfloat16 weights where the CPU has AVX-512 BF16: one
// vdpbf16ps adds a lane's two terms x[i] a[i, j] + x[i + 1] a[i + 1, j] (products exact in
// float32, denormals flushed), so an instruction does twice an FMA's work and x comes as one
// broadcast per pair. Each lane sums its pairs in two chains (pairs 0, 2, 4, .. and 1, 3, 5,
// .., in that order; an odd k's last pair padded with zeros), then adds the two, whatever the
// rows, the tile or its width (16 or 8 lanes): so its bits, like the FMA path's, are a row's
// own, but they are not that path's bits.

// word pairs (a[i, j], a[i + 1, j]) for lanes j = j0 .. j0 + 15 (a[i + 1, j] as zeros without second)
inline __m512i lora_pairs16(const BFloat16* a, int64_t R, int64_t i, int64_t j0, bool second) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i * R + j0));
  const __m256i hi =
      second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + (i + 1) * R + j0)) : _mm256_setzero_si256();
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(lo), _mm512_load_si512(kInterleave),
                                   _mm512_castsi256_si512(hi));
}

// the same for 8 lanes
inline __m256i lora_pairs8(const BFloat16* a, int64_t R, int64_t i, int64_t j0, bool second) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i * R + j0));
  const __m128i hi =
      second ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + (i + 1) * R + j0)) : _mm_setzero_si128();
  return _mm256_set_m128i(_mm_unpackhi_epi16(lo, hi), _mm_unpacklo_epi16(lo, hi));
}

// (x[i], x[i + 1]) as one 32-bit word (x[i + 1] as zero without second)
inline int32_t lora_x_pair(const BFloat16* x, int64_t i, bool second) {
  uint16_t raw[2] = {0, 0};
  std::memcpy(raw, x + i, (second ? 2 : 1) * sizeof(uint16_t));
  int32_t word;
  std::memcpy(&word, raw, sizeof word);
  return word;
}

struct LoraPairs16 {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static __m512i pairs(const BFloat16* a, int64_t R, int64_t i, int64_t j0, bool second) {
    return lora_pairs16(a, R, i, j0, second);
  }
  static V dot(V acc, int32_t x, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(x), (__m512bh)w);
  }
  static void store(float* p, V a, V b) { _mm512_storeu_ps(p, _mm512_add_ps(a, b)); }
};

struct LoraPairs8 {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static __m256i pairs(const BFloat16* a, int64_t R, int64_t i, int64_t j0, bool second) {
    return lora_pairs8(a, R, i, j0, second);
  }
  static V dot(V acc, int32_t x, __m256i w) {
    return _mm256_dpbf16_ps(acc, (__m256bh)_mm256_set1_epi32(x), (__m256bh)w);
  }
  static void store(float* p, V a, V b) { _mm256_storeu_ps(p, _mm256_add_ps(a, b)); }
};

// xa[r, j0 .. j0 + NV lanes) for the NR bfloat16 rows xs[r] [k] over a [k, R] (bfloat16)
template <class L, int NR, int NV>
void lora_shrink_pairs_tile(float* xa, const BFloat16* const* xs, const BFloat16* a, int64_t k, int64_t R,
                            int64_t j0) {
  using V = typename L::V;
  constexpr int64_t w = L::kWidth;
  V acc[2][NR][NV];
  for (int c = 0; c < 2; ++c)
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < NV; ++v) acc[c][r][v] = L::zero();
  // one pair of inputs, i and i + 1 (second: whether i + 1 < k) into chain c
  auto step = [&](int c, int64_t i, bool second) {
    decltype(L::pairs(a, R, i, j0, second)) wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = L::pairs(a, R, i, j0 + w * v, second);
    for (int r = 0; r < NR; ++r) {
      const int32_t xp = lora_x_pair(xs[r], i, second);
      for (int v = 0; v < NV; ++v) acc[c][r][v] = L::dot(acc[c][r][v], xp, wv[v]);
    }
  };
  int64_t i = 0;
  for (; i + 4 <= k; i += 4) {
    step(0, i, true);
    step(1, i + 2, true);
  }
  if (i < k) step(0, i, i + 1 < k);
  if (i + 2 < k) step(1, i + 2, i + 3 < k);
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) L::store(xa + r * R + j0 + w * v, acc[0][r][v], acc[1][r][v]);
}

// the whole shrink of NR bfloat16 rows: tiles of as many 16-lane vectors as fit, then 8 lanes
template <int NR, int NS>
void lora_shrink_pairs(float* xa, const BFloat16* const* xs, const BFloat16* a, int64_t k, int64_t R) {
  int64_t j0 = 0;
  while (j0 + 16 <= R) {
    const int64_t vectors = std::min<int64_t>(NS, (R - j0) / 16);
    if constexpr (NS == 4) {
      if (vectors == 4) lora_shrink_pairs_tile<LoraPairs16, NR, 4>(xa, xs, a, k, R, j0);
      if (vectors == 3) lora_shrink_pairs_tile<LoraPairs16, NR, 3>(xa, xs, a, k, R, j0);
    }
    if (vectors == 2) lora_shrink_pairs_tile<LoraPairs16, NR, 2>(xa, xs, a, k, R, j0);
    if (vectors == 1) lora_shrink_pairs_tile<LoraPairs16, NR, 1>(xa, xs, a, k, R, j0);
    j0 += vectors * 16;
  }
  for (; j0 < R; j0 += 8) lora_shrink_pairs_tile<LoraPairs8, NR, 1>(xa, xs, a, k, R, j0);  // R: a multiple of 8
}
#endif

// y rows ys[r] += columns [c0, c0 + NV lanes) of one module: xa[r, rs .. rs + rl) over b [rl, ol]
template <class L, int NR, int NV, typename T, typename W>
void lora_expand_tile(T* const* ys, const float* xa, int64_t R, const W* b, int64_t ol, int64_t rs, int64_t rl,
                      int64_t c0) {
  using V = typename L::V;
  constexpr int64_t w = L::kWidth;
  V acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = L::zero();
  for (int64_t j = 0; j < rl; ++j) {
    V wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = L::load(b + j * ol + c0 + w * v);
    for (int r = 0; r < NR; ++r) {
      const V xb = L::broadcast(xa[r * R + rs + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = L::fma(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) L::add_rounded(ys[r] + c0 + w * v, acc[r][v]);
}

#if defined(PYXLLM_LORA_LANES16)
// lora_expand_tile over bfloat16 b for columns [c0, c0 + 32 NP), 16 lanes: one 64-byte load of
// b holds 32 columns, widened in one instruction each for its even and its odd columns (a
// shift, a mask: no shuffle, half the instructions of lora_expand_tile's widening), so a lane
// holds every other column until the sums are put back in order for the add into y. Each
// column's sum runs as in lora_expand_tile: the same bits.
template <int NR, int NP, typename T>
void lora_expand_tile_bf16(T* const* ys, const float* xa, int64_t R, const BFloat16* b, int64_t ol, int64_t rs,
                           int64_t rl, int64_t c0) {
  __m512 even[NR][NP], odd[NR][NP];
  for (int r = 0; r < NR; ++r)
    for (int p = 0; p < NP; ++p) even[r][p] = odd[r][p] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t j = 0; j < rl; ++j) {
    __m512 we[NP], wo[NP];
    for (int p = 0; p < NP; ++p) {
      const __m512i raw = _mm512_loadu_si512(b + j * ol + c0 + 32 * p);
      we[p] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      wo[p] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 xb = _mm512_set1_ps(xa[r * R + rs + j]);
      for (int p = 0; p < NP; ++p) {
        even[r][p] = _mm512_fmadd_ps(xb, we[p], even[r][p]);
        odd[r][p] = _mm512_fmadd_ps(xb, wo[p], odd[r][p]);
      }
    }
  }
  alignas(64) static const int32_t kFirst[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static const int32_t kSecond[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
  for (int r = 0; r < NR; ++r)
    for (int p = 0; p < NP; ++p) {
      LoraLanes16::add_rounded(ys[r] + c0 + 32 * p, _mm512_permutex2var_ps(even[r][p], first, odd[r][p]));
      LoraLanes16::add_rounded(ys[r] + c0 + 32 * p + 16, _mm512_permutex2var_ps(even[r][p], second, odd[r][p]));
    }
}
#endif

// One block of NR rows on one adapter: x rows widened, the shrink, then each module's expand.
// The tiles take the widest lanes (LoraWide), then 8 lanes for the rest of a multiple of 8, then
// one column at a time. Accumulators: 2 * NR * NS in the shrink (its even and odd chains), at
// most 16; NR * NE in the expand, at most 8 in AVX2's 16 registers and 16 in AVX-512's 32.
template <int NR, typename T, typename W>
void lora_rows(T* y, const T* x, const int64_t* rows, int64_t k, int64_t n, const W* a, int64_t R, const W* b,
               const int64_t* seg, int64_t num_seg, float* xf, float* xa) {
  constexpr int NS = NR <= 2 ? 4 : 2;
  constexpr int NE = kLoraRegisters == 32 ? 4 : NS;
  constexpr int64_t wide = LoraWide::kWidth;
#if defined(PYXLLM_LORA_DPBF16)
  if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<W, BFloat16>) {
    const BFloat16* xs[NR];
    for (int r = 0; r < NR; ++r) xs[r] = x + rows[r] * k;
    lora_shrink_pairs<NR, NS>(xa, xs, a, k, R);
  } else
#endif
  {
    for (int r = 0; r < NR; ++r) Rows<T>::load(xf + r * k, x + rows[r] * k, k);
    // as many vectors a tile as fit (a pass over x for them all: few rows have few chains each)
    int64_t j0 = 0;
    while (j0 + wide <= R) {
      const int64_t vectors = std::min<int64_t>(NS, (R - j0) / wide);  // NS is 2 or 4
      if constexpr (NS == 4) {
        if (vectors == 4) lora_shrink_tile<LoraWide, NR, 4>(xa, xf, a, k, R, j0);
        if (vectors == 3) lora_shrink_tile<LoraWide, NR, 3>(xa, xf, a, k, R, j0);
      }
      if (vectors == 2) lora_shrink_tile<LoraWide, NR, 2>(xa, xf, a, k, R, j0);
      if (vectors == 1) lora_shrink_tile<LoraWide, NR, 1>(xa, xf, a, k, R, j0);
      j0 += vectors * wide;
    }
    for (; j0 < R; j0 += 8) lora_shrink_tile<LoraLanes8, NR, 1>(xa, xf, a, k, R, j0);  // R: a multiple of 8
  }
  T* ys[NR];
  for (int64_t s = 0; s < num_seg; ++s) {
    const int64_t os = seg[5 * s], ol = seg[5 * s + 1], rs = seg[5 * s + 2], rl = seg[5 * s + 3];
    const W* bs = b + seg[5 * s + 4];
    for (int r = 0; r < NR; ++r) ys[r] = y + rows[r] * n + os;
    int64_t c = 0;
#if defined(PYXLLM_LORA_LANES16)
    if constexpr (std::is_same_v<W, BFloat16>)
      for (; c + 64 <= ol; c += 64) lora_expand_tile_bf16<NR, 2>(ys, xa, R, bs, ol, rs, rl, c);
#endif
    for (; c + NE * wide <= ol; c += NE * wide) lora_expand_tile<LoraWide, NR, NE>(ys, xa, R, bs, ol, rs, rl, c);
    for (; c + wide <= ol; c += wide) lora_expand_tile<LoraWide, NR, 1>(ys, xa, R, bs, ol, rs, rl, c);
    for (; c + 8 <= ol; c += 8) lora_expand_tile<LoraLanes8, NR, 1>(ys, xa, R, bs, ol, rs, rl, c);
    for (; c < ol; ++c)
      for (int r = 0; r < NR; ++r) {
        float total = 0.f;
        for (int64_t j = 0; j < rl; ++j) total = fma1(xa[r * R + rs + j], load1w(bs + j * ol + c), total);
        add_rounded(ys[r] + c, total);
      }
  }
}

template <typename T, typename W>
void lora_job(T* y, const T* x, const int64_t* rows, int64_t count, int64_t k, int64_t n, const at::Tensor& a,
              const at::Tensor& b, const at::Tensor& seg, std::vector<float>& buffer) {
  const int64_t R = a.size(1);
  buffer.resize(kLoraRows * (k + R));
  float *xf = buffer.data(), *xa = xf + kLoraRows * k;
  const W *ap = a.data_ptr<W>(), *bp = b.data_ptr<W>();
  const int64_t *sp = seg.data_ptr<int64_t>(), ns = seg.size(0);
  switch (count) {
    case 1: lora_rows<1>(y, x, rows, k, n, ap, R, bp, sp, ns, xf, xa); break;
    case 2: lora_rows<2>(y, x, rows, k, n, ap, R, bp, sp, ns, xf, xa); break;
    case 3: lora_rows<3>(y, x, rows, k, n, ap, R, bp, sp, ns, xf, xa); break;
    default: lora_rows<4>(y, x, rows, k, n, ap, R, bp, sp, ns, xf, xa); break;
  }
}

template <typename T>
void lora_delta_typed(const at::Tensor& y, const at::Tensor& x, at::TensorList a, at::TensorList b,
                      at::TensorList segments, const std::vector<std::vector<int64_t>>& rows_of) {
  struct Job {
    int64_t g, start, count;  // adapter, first of its rows, row count (kLoraRows at most)
  };
  std::vector<Job> jobs;
  const int64_t k = x.size(1), n = y.size(1);
  int64_t macs = 0;
  for (size_t g = 0; g < rows_of.size(); ++g) {
    const int64_t count = static_cast<int64_t>(rows_of[g].size());
    for (int64_t start = 0; start < count; start += kLoraRows)
      jobs.push_back({static_cast<int64_t>(g), start, std::min<int64_t>(kLoraRows, count - start)});
    if (count) macs += count * (a[g].numel() + b[g].numel());
  }
  T* yp = y.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const int64_t num_jobs = static_cast<int64_t>(jobs.size());
  // below kSerialLinearMacs in all the calling thread alone (waking the pool costs more)
  const int64_t grain = macs < kSerialLinearMacs ? std::max<int64_t>(num_jobs, 1) : 1;
  at::parallel_for(0, num_jobs, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t t = begin; t < end; ++t) {
      const Job& job = jobs[t];
      const int64_t* rows = rows_of[job.g].data() + job.start;
      const at::Tensor &ag = a[job.g], &bg = b[job.g], &sg = segments[job.g];
      if (ag.scalar_type() == at::kFloat)
        lora_job<T, float>(yp, xp, rows, job.count, k, n, ag, bg, sg, buffer);
      else
        lora_job<T, BFloat16>(yp, xp, rows, job.count, k, n, ag, bg, sg, buffer);
    }
  });
}

void lora_delta(const at::Tensor& y, const at::Tensor& x, at::TensorList a, at::TensorList b, at::TensorList segments,
                const at::Tensor& row_adapter) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "lora_delta: y must be a contiguous float32 or bfloat16 [T, out] tensor");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == y.scalar_type() && x.size(0) == y.size(0),
              "lora_delta: x must be a contiguous [T, in] tensor of y's dtype and rows");
  TORCH_CHECK(row_adapter.dim() == 1 && row_adapter.scalar_type() == at::kLong && row_adapter.is_contiguous() &&
                  row_adapter.numel() == y.size(0),
              "lora_delta: row_adapter must be a contiguous int64 [T] tensor");
  const int64_t num = static_cast<int64_t>(a.size()), k = x.size(1), n = y.size(1);
  TORCH_CHECK(b.size() == a.size() && segments.size() == a.size(), "lora_delta: one a, b and segments per adapter");
  for (int64_t g = 0; g < num; ++g) {
    if (a[g].numel() == 0) continue;  // the adapter does not adapt this layer
    TORCH_CHECK(a[g].dim() == 2 && a[g].is_contiguous() && a[g].size(0) == k && a[g].size(1) % 8 == 0 &&
                    (a[g].scalar_type() == at::kFloat || a[g].scalar_type() == at::kBFloat16),
                "lora_delta: adapter ", g, "'s a must be a contiguous float32 or bfloat16 [", k,
                ", R] tensor, R a multiple of 8");
    TORCH_CHECK(b[g].dim() == 1 && b[g].is_contiguous() && b[g].scalar_type() == a[g].scalar_type(),
                "lora_delta: adapter ", g, "'s b must be a contiguous 1-D tensor of a's dtype");
    const at::Tensor& seg = segments[g];
    TORCH_CHECK(seg.dim() == 2 && seg.size(1) == 5 && seg.scalar_type() == at::kLong && seg.is_contiguous(),
                "lora_delta: adapter ", g, "'s segments must be a contiguous int64 [M, 5] tensor");
    const int64_t* sp = seg.data_ptr<int64_t>();
    for (int64_t s = 0; s < seg.size(0); ++s) {
      const int64_t os = sp[5 * s], ol = sp[5 * s + 1], rs = sp[5 * s + 2], rl = sp[5 * s + 3], bo = sp[5 * s + 4];
      TORCH_CHECK(os >= 0 && ol >= 0 && os + ol <= n && rs >= 0 && rl >= 0 && rs + rl <= a[g].size(1) && bo >= 0 &&
                      bo + rl * ol <= b[g].numel(),
                  "lora_delta: adapter ", g, "'s segment ", s, " falls outside y, a or b");
    }
  }
  std::vector<std::vector<int64_t>> rows_of(num);
  const int64_t* rap = row_adapter.data_ptr<int64_t>();
  for (int64_t m = 0; m < y.size(0); ++m) {
    TORCH_CHECK(rap[m] >= -1 && rap[m] < num, "lora_delta: row ", m, " names adapter ", rap[m], " of ", num);
    if (rap[m] >= 0 && a[rap[m]].numel() > 0) rows_of[rap[m]].push_back(m);
  }
  if (y.scalar_type() == at::kFloat)
    lora_delta_typed<float>(y, x, a, b, segments, rows_of);
  else
    lora_delta_typed<BFloat16>(y, x, a, b, segments, rows_of);
}

}  // namespace

TORCH_LIBRARY(pyxllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("apply_rotary_emb(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_attention_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, int sliding_window=0, Tensor? key_lens=None) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor qweight, Tensor weight_scales, Tensor? bias, int hadamard_block=0) -> Tensor");
  m.def("rowwise_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("lora_delta(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, Tensor[] segments, Tensor row_adapter) -> ()");
}

TORCH_LIBRARY_IMPL(pyxllm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("apply_rotary_emb", &apply_rotary_emb);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("rowwise_linear", &rowwise_linear);
  m.impl("lora_delta", &lora_delta);
}
