// Linear layers over grouped int4 or int8 weights with int8 activations on the CPU:
// torch.ops.pyxllm_cpu.int4_linear (the CPU platform's kernel for --quantization int4 and GGUF's
// Q4_0 / Q4_1 / Q4_K weights) and torch.ops.pyxllm_cpu.int8_group_linear (GGUF's Q8_0, 5-bit and
// K-quant weights, held in 6 bits where every q fits, see Int6Format); contracts in
// pyxllm/kernels/cpu/fused.py.
//
// Weights: groups of 32 input features with a (scale, zero) pair per group and output feature.
// int4: W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n] with q in 0..15 (the format of
// pyxllm.kernels.native.quantized; GGUF Q4_0's and Q4_1's blocks exactly). int8: W[n, k] = q[n, k]
// * scale[g, n] + zero[g, n] with q in -128..127 (GGUF Q8_0's blocks exactly).
// Activations: each row's groups of 32 quantized to int8 in two parts when the layer runs:
// s = max |x| / 127, x / s ~= q1 + q2 / 254 with q1 = rint(x / s), q2 = rint((x / s - q1) * 254),
// so an activation is off by at most s / 508 (~15 bits; llama.cpp quantizes its activations to
// q1 alone, Q8_1, which cost this model's logits twice bfloat16's error). Per group the dot
// product is then an integer one (254 * sum q q1 + sum q q2), and with low what the weight q = 0
// stands for (int4: zero - 8 scale, int8: zero)
//   y[m, n] = sum_g scale[g, n] * s[m, g] / 254 * (254 sum_k q[n, k] q1[m, k] + sum_k q[n, k] q2[m, k])
//             + low[g, n] * xsum[m, g]
// with xsum the sum of the group's quantized activations, s / 254 * sum_k (254 q1 + q2), so that
// the two terms together are sum_k W x~ exactly (before float rounding) and a row's error is that
// of its activations times |W|: with the float sum of x instead, the offset in low (int4's -8,
// int6's -32 scales) multiplied the activations' rounding, and a Q3_K weight with q in -4..3 held
// in 6 bits took ~10x the error of its int8 form. The integer sums run on AVX512-VNNI (vpdpbusd, 16 output
// features per instruction), AVX-VNNI or AVX2 (vpmaddubsw + vpmaddwd), else plain vector code;
// int8 weights enter them as |q| with the activation taking q's sign.
//
// Why: decode and speculative verification run a few rows through every weight, so a step costs
// one pass over the weights; int4 weights are an eighth of float32's bytes, and with integer dot
// products the arithmetic of a few rows overlaps that pass (ATen's int4 kernel takes ~2.2x its
// one-row time over 8 rows, and needs bfloat16 activations to be fast). Up to kGemmRows rows,
// every row is computed by the same instructions in the same order whatever the other rows are,
// so a row's result does not depend on its batch: a sequence verifying drafts gets exactly the
// logits it gets one token at a time. Above that (a prefill), the arithmetic dominates and the
// weights are dequantized (transposed, [K, N]) for a BLAS GEMM (oneDNN's AMX or AVX-512 kernels),
// unless the caller asks for batch invariance (--batch-invariant, the default): then every row
// count takes the per-row integer path, so a prompt's rows get the same bits whether it is
// prefilled at once, in chunks, or beside other requests.
//
// Packed layouts (pyxllm.kernels.cpu.fused.pack_int4_weight / pack_int8_group_weight), tiles of 16
// output features, a tile's groups contiguous, so the kernel reads the weights front to back:
// int4 [N/16][K/32][4 chunks][16 lanes][4 bytes], byte j of lane l in chunk c of group g holding
// q[16 t + l][32 g + 8 c + j] in its low nibble and q[16 t + l][32 g + 8 c + 4 + j] in its high
// nibble; int8 [N/16][K/32][8 chunks][16 lanes][4 bytes], byte j of lane l in chunk c holding
// q[16 t + l][32 g + 4 c + j]. The pairs likewise, [N/16][K/32][16][2], as (scale, low): W = q *
// scale + low, low computed once when packing, so int4's W = q * d + m for a GGUF Q4_1 block is
// gguf-py's own formula; in float16 where that holds every pair exactly (GGUF Q4_0's, Q4_1's and
// Q8_0's scales are float16 numbers: an int4 group of 16 outputs then takes 320 bytes instead of
// 384 with float32 pairs), else in x's dtype; or the scales alone, [N/16][K/32][16], where every
// low is the same multiple of its scale (see ScaleLayout); or, for GGUF's K-quants, factored as
// the file stores them, uint8 [N/16][K/256][bytes] (see kSuperInputs).
// ATen's tensor and the ops called below, not <ATen/ATen.h> (all of ATen's functions: 3-6 s
// of this file's compile, in each build of the kernels)
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>


#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using c10::BFloat16;
using c10::Half;

constexpr int64_t kGroup = 32;                // input features per scale
constexpr int64_t kTile = 16;                 // output features per tile
constexpr int64_t kChunkBytes = kTile * 4;    // one 4-byte piece per output feature of a tile
// How far ahead of the group it multiplies the kernel asks for the packed weights (a software
// prefetch, 64 cache lines; see kWeightPrefetchBytes in cpu_kernels.cpp for w8a8's measurements).
constexpr int64_t kWeightPrefetchBytes = 4096;
constexpr int kRowBlock = 8;                  // rows computed together in one pass over a tile
constexpr int64_t kGemmRows = 32;             // above this many rows: dequantize, then a GEMM
constexpr int64_t kGemmTiles = 64;            // output tiles dequantized per GEMM (1024 outputs)
constexpr int64_t kSerialMacs = int64_t{1} << 18;  // below this, no thread pool

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef int32_t IntV __attribute__((vector_size(kLanes * 4)));
typedef float FloatV __attribute__((vector_size(kLanes * 4)));

// acc + in each lane: the sum over j = 0..3 of byte j of w (unsigned) times byte j of x (signed).
inline IntV dot4(IntV acc, IntV w, int32_t x) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return (IntV)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x));
#elif defined(__AVXVNNI__)
  return (IntV)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(x));
#elif defined(__AVX2__)
  // pairs of products as int16 (at most 2 * 15 * 127: no saturation), then pairs of those
  const __m256i pairs = _mm256_maddubs_epi16((__m256i)w, _mm256_set1_epi32(x));
  return acc + (IntV)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
  for (int j = 0; j < 4; ++j) acc += ((w >> (8 * j)) & 0xFF) * static_cast<int32_t>(static_cast<int8_t>(x >> (8 * j)));
  return acc;
#endif
}

// acc + in each lane: the sum over j = 0..3 of byte j of w times byte j of x, both signed: |w|
// (unsigned) times x carrying w's sign, as llama.cpp's AVX2 kernels do (at most 2 * 128 * 127 per
// int16 pair: no saturation; x is never -128).
inline IntV dot4_signed(IntV acc, IntV w, int32_t x) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m512i xb = _mm512_set1_epi32(x), wv = (__m512i)w;
  const __m512i sx = _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xb);
  return (IntV)_mm512_dpbusd_epi32((__m512i)acc, _mm512_abs_epi8(wv), sx);
#elif defined(__AVXVNNI__)
  const __m256i wv = (__m256i)w;
  return (IntV)_mm256_dpbusd_avx_epi32((__m256i)acc, _mm256_abs_epi8(wv), _mm256_sign_epi8(_mm256_set1_epi32(x), wv));
#elif defined(__AVX2__)
  const __m256i wv = (__m256i)w;
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(_mm256_set1_epi32(x), wv));
  return acc + (IntV)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
  for (int j = 0; j < 4; ++j)
    acc += ((w << (24 - 8 * j)) >> 24) * static_cast<int32_t>(static_cast<int8_t>(x >> (8 * j)));
  return acc;
#endif
}

// a * b + c, rounded once: an explicit fused multiply-add (the build turns contraction off, so
// every row-count instantiation does exactly these operations and a row's bits do not depend on
// its batch).
inline FloatV fma(FloatV a, FloatV b, FloatV c) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return (FloatV)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (FloatV)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// The scales and lows of kLanes pairs (scale, low) given as floats a (the first kLanes / 2 pairs)
// and b (the rest).
inline void split_pairs(FloatV a, FloatV b, FloatV& scale, FloatV& low) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  scale = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  low = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  scale = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
  low = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// One group's (scale, low) for kLanes consecutive output features, from kLanes pairs.
inline void load_scales(const float* pairs, FloatV& scale, FloatV& low) {
  FloatV a, b;
  std::memcpy(&a, pairs, sizeof a);
  std::memcpy(&b, pairs + kLanes, sizeof b);
  split_pairs(a, b, scale, low);
}

// float16 pairs, converted exactly (F16C's vcvtph2ps where the CPU has it).
inline void load_scales(const Half* pairs, FloatV& scale, FloatV& low) {
  FloatV a, b;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  a = (FloatV)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs)));
  b = (FloatV)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + kLanes)));
#elif defined(__F16C__)
  a = (FloatV)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pairs)));
  b = (FloatV)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pairs + kLanes)));
#else
  for (int i = 0; i < kLanes; ++i) {
    a[i] = static_cast<float>(pairs[i]);
    b[i] = static_cast<float>(pairs[kLanes + i]);
  }
#endif
  split_pairs(a, b, scale, low);
}

// bfloat16 pairs: one 32-bit lane per pair, the scale in its low half (little-endian).
inline void load_scales(const BFloat16* pairs, FloatV& scale, FloatV& low) {
  IntV p;
  std::memcpy(&p, pairs, sizeof p);
  const IntV s = p << 16, z = p & static_cast<int32_t>(0xFFFF0000u);
  std::memcpy(&scale, &s, sizeof s);
  std::memcpy(&low, &z, sizeof z);
}

// kLanes consecutive numbers as floats, converted exactly: the scales alone of kLanes output
// features (a layer whose lows are a fixed multiple of its scales keeps only the scales, see
// ScaleLayout), or kLanes activations.
inline void load_floats(const float* scales, FloatV& scale) { std::memcpy(&scale, scales, sizeof scale); }

inline void load_floats(const Half* scales, FloatV& scale) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  scale = (FloatV)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
#elif defined(__F16C__)
  scale = (FloatV)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
#else
  for (int i = 0; i < kLanes; ++i) scale[i] = static_cast<float>(scales[i]);
#endif
}

inline void load_floats(const BFloat16* scales, FloatV& scale) {
  typedef uint16_t HalfV __attribute__((vector_size(kLanes * 2)));
  HalfV h;
  std::memcpy(&h, scales, sizeof h);
  const IntV bits = __builtin_convertvector(h, IntV) << 16;
  std::memcpy(&scale, &bits, sizeof bits);
}

// How a layer holds its (scale, low) numbers, per scale group and output feature: as pairs, or
// the scale alone where every low is the same multiple of its scale (GGUF's Q4_0 blocks, W = (q -
// 8) d, so low = -8 scale for int4; Q8_0's and Q6_K's, W = q d, so low = 0 for int8), which
// halves the bytes read beside the weights (an int4 group of 16 outputs takes 288 bytes instead
// of 320 with float16 pairs). low_per_scale is then F::kLowPerScale, and scale * -8 is exact, so
// both layouts give the same bits.
struct ScaleLayout {
  bool scales_only;
  int per_lane() const { return scales_only ? 1 : 2; }  // numbers per output feature and group
  template <typename F, typename S>
  void load(const S* p, FloatV& scale, FloatV& low) const {
    if (scales_only) {
      load_floats(p, scale);
      low = scale * F::kLowPerScale;
    } else {
      load_scales(p, scale, low);
    }
  }
};

// kLanes int8 numbers as floats (exact; one vpmovsxbd: GCC's __builtin_convertvector from int8
// lanes took ~60 scalar instructions).
inline FloatV int8_lanes(const int8_t* p) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return __builtin_convertvector((IntV)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                 FloatV);
#elif defined(__AVX2__)
  return __builtin_convertvector((IntV)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
                                 FloatV);
#else
  FloatV v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// Super-block scales, a third way to hold them (uint8 scales_and_zeros): GGUF's K-quants factor
// a group's scale as d * sc, d a float16 per 256 inputs (a super-block) and sc a 6-bit integer
// per group, and Q4_K, Q5_K and Q2_K their low as dlow * m likewise (dlow = -dmin; the pack
// shifts a Q5_K's 6-bit q so that W = q * scale + low holds with that low). Held so, with sc and m
// as int8, the kernel's products d * sc and dlow * m are exact in float32 (an 11-bit by an 8-bit
// integer), where (scale, low) pairs need float32 to be exact (0.25 byte a weight; bfloat16
// pairs round them) and this takes ~0.08, about the file's own bytes. Per tile and super-block
// of kSuperGroups<F> scale groups: [per_lane][16] float16 (the tile's d, then its dlow), then per
// group [per_lane][16] int8 (sc, then m); with the scales alone (GGUF's Q6_K, Q3_K, IQ4_XS) low
// is F::kLowPerScale * scale as in ScaleLayout, and per_lane is 1.
constexpr int64_t kSuperInputs = 256;
template <typename F>
constexpr int64_t kSuperGroups = kSuperInputs / F::kScaleInputs;

template <typename F>
int64_t super_block_bytes(ScaleLayout layout) {
  return layout.per_lane() * kTile * (2 + kSuperGroups<F>);
}

// How many numbers of type P hold one tile's scales over k input features.
template <typename F, typename P>
int64_t tile_scale_numbers(ScaleLayout layout, int64_t k) {
  if constexpr (std::is_same_v<P, uint8_t>) {
    return k / kSuperInputs * super_block_bytes<F>(layout);
  } else {
    return k / F::kScaleInputs * kTile * layout.per_lane();
  }
}

// Reads super-block scales group after group: start() at scale group g loads its super-block's
// d (and dlow) for the kLanes output features from lane0 of the tile whose scales start at
// `tile` (tile_scale_numbers of them per tile); next() gives that group's (scale, low), then the
// following group's, up to the super-block's end.
template <typename F>
struct SuperBlockCursor {
  FloatV d{}, dlow{};
  const int8_t* sub = nullptr;  // the next scale group's sc (then its m), from lane0

  void start(const uint8_t* tile, ScaleLayout layout, int64_t g, int64_t lane0) {
    const uint8_t* block = tile + g / kSuperGroups<F> * super_block_bytes<F>(layout);
    load_floats(reinterpret_cast<const Half*>(block) + lane0, d);
    if (!layout.scales_only) load_floats(reinterpret_cast<const Half*>(block) + kTile + lane0, dlow);
    sub = reinterpret_cast<const int8_t*>(block + layout.per_lane() * kTile * 2) +
          g % kSuperGroups<F> * layout.per_lane() * kTile + lane0;
  }

  void next(ScaleLayout layout, FloatV& scale, FloatV& low) {
    scale = d * int8_lanes(sub);
    low = layout.scales_only ? scale * F::kLowPerScale : dlow * int8_lanes(sub + kTile);
    sub += layout.per_lane() * kTile;
  }
};

// Scale group g's (scale, low) for the kLanes output features from lane0 of the tile whose
// scales start at `tile` (tile_scale_numbers of them per tile), in any layout.
template <typename F, typename P>
inline void load_group_scales(const P* tile, ScaleLayout layout, int64_t g, int64_t lane0, FloatV& scale,
                              FloatV& low) {
  if constexpr (std::is_same_v<P, uint8_t>) {
    SuperBlockCursor<F> cursor;
    cursor.start(tile, layout, g, lane0);
    cursor.next(layout, scale, low);
  } else {
    layout.load<F>(tile + (g * kTile + lane0) * layout.per_lane(), scale, low);
  }
}

// Each lane rounded to the nearest integer, ties to even (std::rint's rounding in the default
// mode, so the vector branches give the scalar branch's bits).
inline FloatV rint_lanes(FloatV v) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return (FloatV)_mm512_roundscale_ps((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX__)
  return (FloatV)_mm256_round_ps((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  for (int i = 0; i < kLanes; ++i) v[i] = std::rint(v[i]);
  return v;
#endif
}

// The activations of `rows` rows quantized per group, in two int8 parts: x / xs ~= q1 + q2 / 254
// with q1 = rint(x / xs) and q2 = rint((x / xs - q1) * 254), both in -127..127; row r's q1 at
// xq[2 k r + i], its q2 at xq[2 k r + k + i]. xs [rows, k/32] holds max |x| / (127 * 254), xsum
// [rows, k/S] the sum of the quantized activations xs * (254 q1 + q2) over each S = sum_group
// (32 or 16) inputs (an integer sum below 2^24, exact in float, times xs: one rounding), and
// xtotal (when not null) that integer sum itself. Vectors of
// kLanes activations, each lane doing the scalar formula's operations (a maximum and integer
// sums are exact in any order), so every ISA branch gives the same bytes.
template <typename T>
void quantize_groups(int8_t* xq, float* xs, float* xsum, int32_t* xtotal, const T* x, int64_t rows, int64_t k,
                     int64_t sum_group) {
  constexpr int kVecs = kGroup / kLanes;
  typedef int8_t ByteV __attribute__((vector_size(kLanes)));
  const int64_t groups = k / kGroup, sums = kGroup / sum_group;
  at::parallel_for(0, rows, rows * k < kSerialMacs ? rows : 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const T* src = x + r * k + g * kGroup;
        FloatV b[kVecs], amax_v{};
        for (int v = 0; v < kVecs; ++v) {
          load_floats(src + v * kLanes, b[v]);
          const IntV bits = (IntV)b[v] & 0x7FFFFFFF;  // |x|
          const FloatV mag = (FloatV)bits;
          amax_v = mag > amax_v ? mag : amax_v;
        }
        float amax = 0.f;
        for (int i = 0; i < kLanes; ++i) amax = std::max(amax, amax_v[i]);
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* q1 = xq + 2 * k * r + g * kGroup;
        int8_t* q2 = q1 + k;
        IntV total_v[2] = {};
        for (int v = 0; v < kVecs; ++v) {
          const FloatV scaled = b[v] * inv, whole = rint_lanes(scaled);
          const IntV i1 = __builtin_convertvector(whole, IntV);
          const IntV i2 = __builtin_convertvector(rint_lanes((scaled - whole) * 254.f), IntV);
          const ByteV b1 = __builtin_convertvector(i1, ByteV), b2 = __builtin_convertvector(i2, ByteV);
          std::memcpy(q1 + v * kLanes, &b1, sizeof b1);
          std::memcpy(q2 + v * kLanes, &b2, sizeof b2);
          total_v[v * kLanes >= sum_group] += 254 * i1 + i2;  // sum_group 32: one sum; 16: two halves
        }
        const float step = amax / (127.f * 254.f);
        xs[r * groups + g] = step;
        for (int64_t j = 0; j < sums; ++j) {
          int32_t total = 0;
          for (int i = 0; i < kLanes; ++i) total += total_v[j][i];
          xsum[(r * groups + g) * sums + j] = static_cast<float>(total) * step;
          if (xtotal) xtotal[(r * groups + g) * sums + j] = total;
        }
      }
  });
}

// The weight formats, each a scale group of kScaleInputs input features (one (scale, low) pair
// per output feature) of kTile output features in kChunks chunks of kChunkBytes (kTile lanes of
// 4 bytes); a chunk holds kPieces 4-byte pieces per lane, piece p of chunk c covering input
// features c * kChunkInputs + 4 p ... + 3 of the scale group.
//
// Int4: W = q * scale + low, q in 0..15, scale groups of 32; two per byte (low nibbles: the
// chunk's first 4 features, high nibbles: the next 4). The integer dot products are u8 x s8.
// Without VNNI (AVX2 alone) each takes two multiplies, vpmaddubsw into int16 pairs and vpmaddwd
// to widen them; a group's pairs are summed in int16 instead (16 products of at most 15 * 127
// each: 30480, no overflow) and widened once, the same integers for half the multiplies (+5-10 %
// GMAC/s on the AVX2 EPYC, 1 to 64 rows, 1024 x 1024, one thread).
struct Int4Format {
  static constexpr int64_t kScaleInputs = 32, kScaleBytes = kTile * kScaleInputs / 2;
  static constexpr float kLowPerScale = -8.f;  // W = (q - 8) * scale with no zero
  static constexpr int kChunks = 4, kPieces = 2, kChunkInputs = 8;
  static constexpr bool kSigned = false;
  static constexpr int32_t kDotOffset = 0;  // see Int8Format
  // the pieces of chunk c of the scale group at wg (this lane block's bytes)
  static void load_chunk(const uint8_t* wg, int c, IntV* piece) {
    IntV packed;
    std::memcpy(&packed, wg + c * kChunkBytes, sizeof packed);
    piece[0] = packed & 0x0F0F0F0F;
    piece[1] = (packed >> 4) & 0x0F0F0F0F;
  }
#if defined(__AVX2__) && !defined(__AVXVNNI__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
  static IntV dot(IntV acc, IntV w, int32_t x) {
    return (IntV)_mm256_add_epi16((__m256i)acc, _mm256_maddubs_epi16((__m256i)w, _mm256_set1_epi32(x)));
  }
  static IntV widen(IntV acc) { return (IntV)_mm256_madd_epi16((__m256i)acc, _mm256_set1_epi16(1)); }
#else
  static IntV dot(IntV acc, IntV w, int32_t x) { return dot4(acc, w, x); }
  static IntV widen(IntV acc) { return acc; }
#endif
};

// Int6: W = q * scale + low with q in 0..63, scale groups of G = 32 or 16. GGUF's Q6_K, Q5_x,
// Q3_K and Q2_K blocks, whose int8 q lies in -32..31 (pack_int8_group_weight then packs q + 32
// this way: 0.75 byte a weight instead of 1, the file's own 6 bits for Q6_K). A scale group is
// G / 8 chunks of nibbles, as Int4's (byte j of a lane: input 8 c + j in its low nibble, 8 c + 4
// + j in its high one), then G / 16 chunks of the top two bits, byte j of lane l in chunk h
// holding those of inputs 16 h + 4 f + j at bits 2 f, 2 f + 1 (f = 0..3), so that one shift and
// one mask put a piece's four top bit pairs under its nibbles. The dot products are u8 x s8
// (pairs of at most 2 * 63 * 127 per int16: no saturation).
template <int G>
struct Int6Format {
  static constexpr int64_t kScaleInputs = G, kScaleBytes = kTile * kScaleInputs * 3 / 4;
  static constexpr float kLowPerScale = -32.f;  // W = (q - 32) * scale with no zero
  static constexpr int kChunks = G / 8, kPieces = 2, kChunkInputs = 8;
  static constexpr bool kSigned = false;
  static constexpr int32_t kDotOffset = 0;  // see Int8Format
  static void load_chunk(const uint8_t* wg, int c, IntV* piece) {
    IntV nibbles, top;
    std::memcpy(&nibbles, wg + c * kChunkBytes, sizeof nibbles);
    std::memcpy(&top, wg + (kChunks + c / 2) * kChunkBytes, sizeof top);
    // a byte's bit pairs f = 2 (c % 2) and f + 1 moved to bits 4-5 and 6-7 (one shift for
    // both; the masks keep each byte's own bits), so each piece is a mask and a merge
    const IntV bits = c % 2 == 0 ? top << 4 : top;
    piece[0] = (nibbles & 0x0F0F0F0F) | (bits & 0x30303030);
    piece[1] = ((nibbles >> 4) & 0x0F0F0F0F) | ((bits >> 2) & 0x30303030);
  }
  static IntV dot(IntV acc, IntV w, int32_t x) { return dot4(acc, w, x); }
  static IntV widen(IntV acc) { return acc; }
};

// Int8: W = q * scale + low, q in -128..127, one per byte, scale groups of G = 32 (GGUF's Q8_0,
// Q5_0/Q5_1 and Q5_K with q shifted to be signed) or 16 (Q6_K). The integer dot products are
// s8 x s8. With VNNI (vpdpbusd adds its four u8 x s8 products in int32, no int16 step to
// saturate) a weight enters as the unsigned byte q + 128 (its sign bit flipped, one XOR per 64
// weights) and tile_rows takes 128 times the group's activation total back off the integer sum:
// the same integers as the signed products, for two instructions fewer per product than |w| x
// (x with w's sign): SmolLM2's 49152 x 576 Q8_0 LM head on one Zen 4 core, 8 rows 4.40 -> 2.96
// ms, 32 rows 17.2 -> 11.6 ms (one row is bound by memory: within 5 %). Without VNNI
// vpmaddubsw's int16 pairs would saturate on u8 up to 255 (2 * 255 * 127): |w| x (x with w's
// sign) there, as llama.cpp's AVX2 kernels do.
template <int G>
struct Int8Format {
  static constexpr int64_t kScaleInputs = G, kScaleBytes = kTile * kScaleInputs;
  static constexpr float kLowPerScale = 0.f;  // W = q * scale with no zero
  static constexpr int kChunks = G / 4, kPieces = 1, kChunkInputs = 4;
  static constexpr bool kSigned = true;
  static void load_chunk(const uint8_t* wg, int c, IntV* piece) {
    std::memcpy(piece, wg + c * kChunkBytes, sizeof *piece);
  }
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVXVNNI__)
  static constexpr int32_t kDotOffset = 128;
  static IntV dot(IntV acc, IntV w, int32_t x) { return dot4(acc, w ^ static_cast<int32_t>(0x80808080u), x); }
#else
  static constexpr int32_t kDotOffset = 0;
  static IntV dot(IntV acc, IntV w, int32_t x) { return dot4_signed(acc, w, x); }
#endif
  static IntV widen(IntV acc) { return acc; }  // pairs of s8 x s8 products fill an int16 alone
};

// Byte j (0..3) of every lane of a piece: input 4 p + j of its chunk, as F's q (int8 sign-extended).
template <typename F>
inline IntV piece_value(IntV piece, int j) {
  return F::kSigned ? (piece << (24 - 8 * j)) >> 24 : (piece >> (8 * j)) & 0xFF;
}

// acc[m] (m < M) += row m's products with kLanes output features over all scale groups. `w` is
// the tile's first scale group, offset to this lane block (lane0); `scales` the tile's scales,
// held as `layout` says (load_group_scales); xs per 32 inputs, xsum and xtotal per scale group
// (xtotal read only where F::kDotOffset is set).
template <typename F, int M, typename S>
inline void tile_rows(FloatV* acc, const uint8_t* w, const S* scales, ScaleLayout layout, int64_t lane0,
                      const int8_t* xq, const float* xs, const float* xsum, const int32_t* xtotal, int64_t k) {
  const int64_t scale_groups = k / F::kScaleInputs, groups = k / kGroup;
  SuperBlockCursor<F> cursor;  // super-block scales only
  FloatV running[M];  // acc, kept in registers (acc may alias xs: stored at every group)
  for (int m = 0; m < M; ++m) running[m] = acc[m];
  for (int64_t g = 0; g < scale_groups; ++g) {
    IntV sum1[M] = {}, sum2[M] = {};
    const uint8_t* wg = w + g * F::kScaleBytes;
    const int8_t* xg = xq + g * F::kScaleInputs;
    for (int64_t b = 0; b < F::kScaleBytes; b += kChunkBytes) __builtin_prefetch(wg + b + kWeightPrefetchBytes);
    for (int c = 0; c < F::kChunks; ++c) {
      IntV piece[F::kPieces];
      F::load_chunk(wg, c, piece);
      for (int m = 0; m < M; ++m) {
        const int8_t* q1 = xg + 2 * k * m + F::kChunkInputs * c;
        for (int p = 0; p < F::kPieces; ++p) {
          int32_t x1, x2;
          std::memcpy(&x1, q1 + 4 * p, 4);
          std::memcpy(&x2, q1 + k + 4 * p, 4);
          sum1[m] = F::dot(sum1[m], piece[p], x1);
          sum2[m] = F::dot(sum2[m], piece[p], x2);
        }
      }
    }
    FloatV scale, low;
    if constexpr (std::is_same_v<S, uint8_t>) {  // d and dlow loaded once per super-block
      if (g % kSuperGroups<F> == 0) cursor.start(scales, layout, g, lane0);
      cursor.next(layout, scale, low);
    } else {
      load_group_scales<F>(scales, layout, g, lane0, scale, low);
    }
    const int64_t a = g * F::kScaleInputs / kGroup;  // the activations' group of 32
    for (int m = 0; m < M; ++m) {
      IntV sum = F::widen(sum1[m]) * 254 + F::widen(sum2[m]);
      if constexpr (F::kDotOffset != 0) sum -= F::kDotOffset * xtotal[m * scale_groups + g];
      running[m] = fma(__builtin_convertvector(sum, FloatV), scale * xs[m * groups + a], running[m]);
      running[m] = fma(low, FloatV{} + xsum[m * scale_groups + g], running[m]);
    }
  }
  for (int m = 0; m < M; ++m) acc[m] = running[m];
}

template <typename F, typename S>
void tile_rows_any(int rows, FloatV* acc, const uint8_t* w, const S* scales, ScaleLayout layout, int64_t lane0,
                   const int8_t* xq, const float* xs, const float* xsum, const int32_t* xtotal, int64_t k) {
  switch (rows) {
#define PYXLLM_TILE_ROWS(M) \
  case M: return tile_rows<F, M, S>(acc, w, scales, layout, lane0, xq, xs, xsum, xtotal, k);
    PYXLLM_TILE_ROWS(1)
    PYXLLM_TILE_ROWS(2)
    PYXLLM_TILE_ROWS(3)
    PYXLLM_TILE_ROWS(4)
    PYXLLM_TILE_ROWS(5)
    PYXLLM_TILE_ROWS(6)
    PYXLLM_TILE_ROWS(7)
    PYXLLM_TILE_ROWS(8)
#undef PYXLLM_TILE_ROWS
  }
}

template <typename F, typename T, typename P>
void group_linear_rows(T* y, const T* x, const uint8_t* w, const P* pairs, ScaleLayout layout, const T* bias,
                       int64_t rows, int64_t k, int64_t n) {
  const int64_t groups = k / kGroup, scale_groups = k / F::kScaleInputs;
  std::vector<int8_t> xq(2 * rows * k);
  std::vector<float> xs(rows * groups), xsum(rows * scale_groups);
  std::vector<int32_t> xtotal(F::kDotOffset != 0 ? rows * scale_groups : 0);
  int32_t* totals = xtotal.empty() ? nullptr : xtotal.data();  // only where F::kDotOffset is set
  quantize_groups(xq.data(), xs.data(), xsum.data(), totals, x, rows, k, F::kScaleInputs);
  const int64_t tiles = n / kTile;
  at::parallel_for(0, tiles, rows * n * k < kSerialMacs ? tiles : 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t lane0 = 0; lane0 < kTile; lane0 += kLanes) {
        const int64_t n0 = t * kTile + lane0;
        const uint8_t* wt = w + t * scale_groups * F::kScaleBytes + lane0 * 4;
        for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
          const int mc = static_cast<int>(std::min<int64_t>(kRowBlock, rows - m0));
          FloatV acc[kRowBlock] = {};
          tile_rows_any<F>(mc, acc, wt, pairs + t * tile_scale_numbers<F, P>(layout, k), layout, lane0,
                           xq.data() + 2 * m0 * k, xs.data() + m0 * groups, xsum.data() + m0 * scale_groups,
                           totals ? totals + m0 * scale_groups : nullptr, k);
          for (int m = 0; m < mc; ++m)
            for (int l = 0; l < kLanes; ++l) {
              const float b = bias ? static_cast<float>(bias[n0 + l]) : 0.f;
              y[(m0 + m) * n + n0 + l] = static_cast<T>(acc[m][l] + b);
            }
        }
      }
  });
}

// Stores kLanes floats as T (bfloat16: rounded to nearest even, as c10::BFloat16 rounds a finite
// value).
inline void store_lanes(float* dst, FloatV v) { std::memcpy(dst, &v, sizeof v); }
inline void store_lanes(BFloat16* dst, FloatV v) {
  typedef uint16_t HalfV __attribute__((vector_size(kLanes * 2)));
  IntV u;
  std::memcpy(&u, &v, sizeof u);
  const IntV rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
  const HalfV h = __builtin_convertvector(rounded & 0xFFFF, HalfV);
  std::memcpy(dst, &h, sizeof h);
}

// Tiles [t0, t1) of the weights as T, transposed: wt[k][j] = W[16 t0 + j][k] ([K, 16 (t1 - t0)],
// so that each lane block's kLanes outputs of one input feature are one vector store).
template <typename F, typename T, typename P>
void dequantize_transposed(T* wt, const uint8_t* w, const P* pairs, ScaleLayout layout, int64_t k, int64_t t0,
                           int64_t t1) {
  const int64_t scale_groups = k / F::kScaleInputs, ld = (t1 - t0) * kTile;
  at::parallel_for(t0, t1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t lane0 = 0; lane0 < kTile; lane0 += kLanes)
        for (int64_t g = 0; g < scale_groups; ++g) {
          FloatV scale, low;
          load_group_scales<F>(pairs + t * tile_scale_numbers<F, P>(layout, k), layout, g, lane0, scale, low);
          const uint8_t* wg = w + (t * scale_groups + g) * F::kScaleBytes + lane0 * 4;
          T* out = wt + g * F::kScaleInputs * ld + (t - t0) * kTile + lane0;
          for (int c = 0; c < F::kChunks; ++c) {
            IntV piece[F::kPieces];
            F::load_chunk(wg, c, piece);
            for (int p = 0; p < F::kPieces; ++p)
              for (int j = 0; j < 4; ++j)
                store_lanes(out + (F::kChunkInputs * c + 4 * p + j) * ld,
                            __builtin_convertvector(piece_value<F>(piece[p], j), FloatV) * scale + low);
          }
        }
  });
}

// y = x @ W.T + bias for any format; `op` names the operator in messages.
template <typename F>
at::Tensor group_linear(const char* op, const at::Tensor& x, const at::Tensor& packed,
                        const at::Tensor& scales_and_zeros, const std::optional<at::Tensor>& bias,
                        bool batch_invariant) {
  const int64_t k = x.size(-1), g = F::kScaleInputs;
  TORCH_CHECK(k % kGroup == 0, op, ": input features must be a multiple of ", kGroup, ", got ", k);
  const int64_t row_bytes = k / g * F::kScaleBytes;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == row_bytes,
              op, ": packed must be contiguous uint8 [N/16, ", row_bytes, "] (its pack function's layout)");
  const int64_t n = packed.size(0) * kTile;
  const bool half_pairs = scales_and_zeros.scalar_type() == at::kHalf;
  const bool super_blocks = scales_and_zeros.scalar_type() == at::kByte;
  ScaleLayout layout{scales_and_zeros.numel() == n * k / g};
  if (super_blocks) {
    const int64_t scales_bytes = super_block_bytes<F>(ScaleLayout{true});
    layout.scales_only = scales_and_zeros.dim() == 3 && scales_and_zeros.size(2) == scales_bytes;
    TORCH_CHECK(k % kSuperInputs == 0 && scales_and_zeros.is_contiguous() && scales_and_zeros.dim() == 3 &&
                    scales_and_zeros.size(0) == n / kTile && scales_and_zeros.size(1) == k / kSuperInputs &&
                    scales_and_zeros.size(2) == super_block_bytes<F>(layout),
                op, ": super-block scales must be the pack function's contiguous uint8 [", n / kTile, ", ",
                k / kSuperInputs, ", ", scales_bytes, " or ", 2 * scales_bytes, "] (input features a multiple of ",
                kSuperInputs, ")");
  } else {
    TORCH_CHECK((half_pairs || scales_and_zeros.scalar_type() == x.scalar_type()) &&
                    scales_and_zeros.is_contiguous() && scales_and_zeros.numel() == n * k / g * layout.per_lane(),
                op, ": scales_and_zeros must be the pack function's contiguous [", n / kTile, ", ", k / g, ", ",
                kTile, ", 2] pairs or [", n / kTile, ", ", k / g, ", ", kTile,
                "] scales, in float16 or x's dtype, or its uint8 super-block scales");
  }
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n && b.scalar_type() == x.scalar_type(), op, ": bias must be [", n, "] in x's dtype");
  }
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t rows = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out.view(out_shape);
  auto run = [&](auto* type_tag, auto* pair_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    using P = std::remove_pointer_t<decltype(pair_tag)>;
    // a prefill: the arithmetic dominates, and BLAS does it fastest (unless every row must get
    // the bits it gets in any other batch: then the row-invariant integer path at any count)
    if (rows > kGemmRows && !batch_invariant) {
      // kGemmTiles tiles of outputs at a time, so the dequantized weights take a buffer of a few
      // MB: a whole layer's [K, N] in float32 for each call (113 MB for SmolLM2's LM head) left
      // glibc's heap holding ~500 MB after the graph captures of 48 and 64 rows, and its fresh
      // pages cost more than the GEMM (3072 x 576 at 64 rows: 6.6 -> 3.6 ms, AVX2 EPYC)
      const int64_t tiles = n / kTile;
      at::Tensor wt = at::empty({k * std::min(tiles, kGemmTiles) * kTile}, x.options());
      for (int64_t t0 = 0; t0 < tiles; t0 += kGemmTiles) {
        const int64_t t1 = std::min(tiles, t0 + kGemmTiles), n0 = t0 * kTile, nb = (t1 - t0) * kTile;
        const at::Tensor wb = wt.narrow(0, 0, k * nb).view({k, nb});
        dequantize_transposed<F, T, P>(wb.data_ptr<T>(), packed.data_ptr<uint8_t>(), scales_and_zeros.data_ptr<P>(),
                                       layout, k, t0, t1);
        at::Tensor block = out.narrow(1, n0, nb);
        if (b.defined()) {
          at::addmm_out(block, b.narrow(0, n0, nb), x2, wb);
        } else {
          at::mm_out(block, x2, wb);
        }
      }
      return;
    }
    group_linear_rows<F, T, P>(out.data_ptr<T>(), x2.data_ptr<T>(), packed.data_ptr<uint8_t>(),
                               scales_and_zeros.data_ptr<P>(), layout, b.defined() ? b.data_ptr<T>() : nullptr, rows,
                               k, n);
  };
  if (x.scalar_type() == at::kFloat) {
    if (super_blocks) {
      run(static_cast<float*>(nullptr), static_cast<uint8_t*>(nullptr));
    } else if (half_pairs) {
      run(static_cast<float*>(nullptr), static_cast<Half*>(nullptr));
    } else {
      run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
    }
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 only, got ", x.scalar_type());
    if (super_blocks) {
      run(static_cast<BFloat16*>(nullptr), static_cast<uint8_t*>(nullptr));
    } else if (half_pairs) {
      run(static_cast<BFloat16*>(nullptr), static_cast<Half*>(nullptr));
    } else {
      run(static_cast<BFloat16*>(nullptr), static_cast<BFloat16*>(nullptr));
    }
  }
  return out.view(out_shape);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                       int64_t group_size, const std::optional<at::Tensor>& bias, bool batch_invariant) {
  TORCH_CHECK(group_size == kGroup, "int4_linear: groups of ", kGroup, " input features only, got ", group_size);
  return group_linear<Int4Format>("int4_linear", x, packed, scales_and_zeros, bias, batch_invariant);
}

at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                             int64_t group_size, const std::optional<at::Tensor>& bias, bool batch_invariant) {
  TORCH_CHECK(group_size == 32 || group_size == 16, "int8_group_linear: groups of 32 or 16 input features only, got ",
              group_size);
  // packed as 6-bit q (pack_int8_group_weight's choice where every q lies in -32..31): 12 bytes
  // a tile per input feature instead of 16
  const bool six_bits = packed.dim() == 2 && packed.size(1) == x.size(-1) * kTile * 3 / 4;
  const char* op = "int8_group_linear";
  if (group_size == 16)
    return six_bits ? group_linear<Int6Format<16>>(op, x, packed, scales_and_zeros, bias, batch_invariant)
                    : group_linear<Int8Format<16>>(op, x, packed, scales_and_zeros, bias, batch_invariant);
  return six_bits ? group_linear<Int6Format<32>>(op, x, packed, scales_and_zeros, bias, batch_invariant)
                  : group_linear<Int8Format<32>>(op, x, packed, scales_and_zeros, bias, batch_invariant);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pyxllm_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, int group_size, Tensor? bias, "
        "bool batch_invariant=False) -> Tensor");
  m.def("int8_group_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, int group_size, Tensor? bias, "
        "bool batch_invariant=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pyxllm_cpu, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_group_linear", &int8_group_linear);
}
