// fp8kit native FP8 cast: one read of a float32 / bfloat16 / float16 buffer writes its FP8 copy
// (E4M3fn or E5M2) and returns max|x| (NaN ignored), optionally with the transposed copy; and the
// way back (dequantize): FP8 -> float32(code) * scale as float32 or bfloat16 (see the section
// "FP8 -> float32 / bfloat16" below).
//
// Numerics (SPEC section 2), identical bit for bit to fp8kit's pure-torch reference
// `cast_to_fp8_reference`:
//   p    = float32(x) * scale                   one IEEE float32 multiply (no FMA, no fast-math)
//   q    = saturate(round_nearest_even(p))      |p| >= fmax -> +-fmax (+-inf too), NaN -> NaN
//   amax = max |x| over the unscaled input, NaN ignored (inf counts), 0 when empty or all NaN.
//
// The float32 -> FP8 conversion is integer arithmetic on the float32 bits:
//   a = |p| bits, clamped (integer min, valid for non-NaN) to the bits of fmax;
//   normal results (a >= smallest FP8 normal): add (half ulp - 1) + the lowest kept mantissa bit
//     (round half to even), subtract the exponent re-bias, shift the dropped mantissa bits out;
//   subnormal results: float32 add of a magic power of two whose ulp is the FP8 subnormal
//     quantum, so the FPU rounds to nearest even; the low bits of the sum are the FP8 code;
//   NaN -> 0x7F (all exponent and mantissa bits set); the sign bit is copied last (as torch).
// The same routine runs scalar (any CPU), 8-wide AVX2 or 16-wide AVX-512F, chosen at run time
// (x86-64 only, through target attributes and __builtin_cpu_supports), so the build needs no
// -mavx2 flag and the cached library works on any x86-64 machine.
// Work is split over torch's intra-op threads with at::parallel_reduce (per-thread amax
// partials); this needs -fopenmp at compile time, the OpenMP runtime is the one torch loaded.
//
// The interface is a small C ABI on raw pointers (called through ctypes by _native.py), so the
// build includes no torch operator headers and compiles in seconds. Built and cached by
// fp8kit/torch/kernels/_native.py with torch.utils.cpp_extension.load.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FP8KIT_HAVE_X86 1
#include <immintrin.h>
#else
#define FP8KIT_HAVE_X86 0
#endif

// The scalar loops that the vector loops also run for their tails (and what those call) are
// inlined into them, so they are compiled with the vector loop's instruction set: a call into
// SSE-encoded code while the upper halves of the vector registers are in use cost ~0.2 us per
// call on an Intel Xeon (docs/decisions/0257-vector-tails-stay-vex.md).
#define FP8KIT_TAIL inline __attribute__((always_inline))

// 16-bit input element types (raw bits; torch's bfloat16 and float16 storage).
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

namespace fp8kit_native {
namespace {

// ---------------------------------------------------------------------------------------------
// Format constants
// ---------------------------------------------------------------------------------------------

struct Fmt {
  uint32_t fmax_bits;        // float32 bits of fmax (448 / 57344)
  uint32_t min_normal_bits;  // float32 bits of the smallest FP8 normal (2^-6 / 2^-14)
  uint32_t rebias;           // (127 - fp8 bias) << 23
  int shift;                 // 23 - mantissa bits: float32 mantissa bits dropped
  uint32_t half_minus_one;   // (1 << (shift - 1)) - 1
  float magic;               // 2^(23 + log2(subnormal quantum)): its ulp is the FP8 quantum
  uint32_t magic_bits;
};

FP8KIT_TAIL uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

FP8KIT_TAIL float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// fmt_id: 0 = float8_e4m3fn, 1 = float8_e5m2.
Fmt make_fmt(int64_t fmt_id) {
  const int mant = fmt_id == 0 ? 3 : 2;
  const int bias = fmt_id == 0 ? 7 : 15;
  const float fmax = fmt_id == 0 ? 448.0f : 57344.0f;
  Fmt f{};
  f.fmax_bits = bits_of(fmax);
  f.min_normal_bits = static_cast<uint32_t>(127 + 1 - bias) << 23;
  f.rebias = static_cast<uint32_t>(127 - bias) << 23;
  f.shift = 23 - mant;
  f.half_minus_one = (1u << (f.shift - 1)) - 1u;
  // subnormal quantum 2^(1 - bias - mant); magic = quantum * 2^23
  f.magic_bits = static_cast<uint32_t>(127 + 23 + 1 - bias - mant) << 23;
  f.magic = float_of(f.magic_bits);
  return f;
}

// ---------------------------------------------------------------------------------------------
// Scalar path (every CPU; also the tail of the vector loops)
// ---------------------------------------------------------------------------------------------

FP8KIT_TAIL float load_f32(const float* p) { return *p; }
FP8KIT_TAIL float load_f32(const bf16_t* p) {
  return float_of(static_cast<uint32_t>(p->bits) << 16);
}

// Exact IEEE half -> float (subnormals, infinities and NaN signs kept).
FP8KIT_TAIL float load_f32(const f16_t* p) {
  const uint32_t h = p->bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1Fu) return float_of(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
  // zero or subnormal: mant * 2^-24, exact in float32 (a normal number there)
  return float_of(sign | bits_of(static_cast<float>(mant) * 0x1p-24f));
}

FP8KIT_TAIL uint8_t encode_scalar(float v, float scale, const Fmt& f) {
  const float p = v * scale;  // one float32 multiply (built with -ffp-contract=off)
  const uint32_t b = bits_of(p);
  const uint32_t sign = (b >> 24) & 0x80u;
  uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) {
    return static_cast<uint8_t>(0x7Fu | sign);  // NaN keeps its sign, as torch's cast does
  }
  a = std::min(a, f.fmax_bits);  // saturate (inf included)
  uint32_t code;
  if (a < f.min_normal_bits) {
    const float s = float_of(a) + f.magic;  // the FPU rounds to the FP8 quantum, ties to even
    code = bits_of(s) - f.magic_bits;
  } else {
    code = (a + f.half_minus_one + ((a >> f.shift) & 1u) - f.rebias) >> f.shift;
  }
  return static_cast<uint8_t>(code | sign);
}

// amax update that ignores NaN: a NaN |v| compares false and leaves acc unchanged.
FP8KIT_TAIL float amax_update(float acc, float v) {
  const float a = std::fabs(v);
  return a > acc ? a : acc;
}

template <typename T>
FP8KIT_TAIL float encode_span_scalar(const T* src, uint8_t* dst, int64_t n, float scale,
                                     const Fmt& f, float acc) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_f32(src + i);
    acc = amax_update(acc, v);
    dst[i] = encode_scalar(v, scale, f);
  }
  return acc;
}

template <typename T>
FP8KIT_TAIL float amax_span_scalar(const T* src, int64_t n, float acc) {
  for (int64_t i = 0; i < n; ++i) acc = amax_update(acc, load_f32(src + i));
  return acc;
}

// acc[j] += float32(src[j]) for j < n: one row's contribution to the column sums (dbias).
template <typename T>
FP8KIT_TAIL void colsum_span_scalar(const T* src, float* acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += load_f32(src + i);
}

// ---------------------------------------------------------------------------------------------
// AVX2 path: 32 elements per iteration (4 x 8 float32 lanes -> one 32-byte store)
// ---------------------------------------------------------------------------------------------

#if FP8KIT_HAVE_X86
#define FP8KIT_AVX2 __attribute__((target("avx2,fma,f16c")))

FP8KIT_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
FP8KIT_AVX2 inline __m256 load8(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
FP8KIT_AVX2 inline __m256 load8(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

struct VecFmt {
  __m256i min_normal_bits, rebias_minus_half, one, max_code, sign_mask, magic_bits;
  __m256 fmax, abs_mask, magic, scale;
  __m128i shift;
};

FP8KIT_AVX2 inline VecFmt make_vec_fmt(const Fmt& f, float scale) {
  VecFmt v;
  v.min_normal_bits = _mm256_set1_epi32(static_cast<int>(f.min_normal_bits));
  // a + (half - 1) - rebias, folded into one constant (wraps modulo 2^32 like the scalar code)
  v.rebias_minus_half = _mm256_set1_epi32(static_cast<int>(f.half_minus_one - f.rebias));
  v.one = _mm256_set1_epi32(1);
  v.max_code = _mm256_set1_epi32(0x7F);
  v.sign_mask = _mm256_set1_epi32(0x80);
  v.magic_bits = _mm256_set1_epi32(static_cast<int>(f.magic_bits));
  v.fmax = _mm256_set1_ps(float_of(f.fmax_bits));
  v.abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  v.magic = _mm256_set1_ps(f.magic);
  v.scale = _mm256_set1_ps(scale);
  v.shift = _mm_cvtsi32_si128(f.shift);
  return v;
}

// 8 float32 values -> 8 int32 FP8 codes (0..255); acc = max(acc, |x|) ignoring NaN.
// Same result as encode_scalar, with two shortcuts: min_ps(fmax, |p|) saturates and keeps a NaN
// (minps returns its second operand when either is NaN), and a NaN's bits, run through the
// normal-number formula, give a code above 0x7F that the final unsigned min turns into 0x7F
// (finite codes are at most 0x7E), so NaN needs no compare and blend of its own.
FP8KIT_AVX2 inline __m256i encode8(__m256 x, const VecFmt& v, __m256& acc) {
  // maxps returns its second operand when either is NaN: a NaN |x| leaves acc as it was.
  acc = _mm256_max_ps(_mm256_and_ps(x, v.abs_mask), acc);
  const __m256 p = _mm256_mul_ps(x, v.scale);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(p), 24), v.sign_mask);
  const __m256i a = _mm256_castps_si256(_mm256_min_ps(v.fmax, _mm256_and_ps(p, v.abs_mask)));
  const __m256i odd = _mm256_and_si256(_mm256_srl_epi32(a, v.shift), v.one);
  const __m256i normal = _mm256_srl_epi32(
      _mm256_add_epi32(_mm256_add_epi32(a, v.rebias_minus_half), odd), v.shift);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), v.magic)), v.magic_bits);
  const __m256i is_sub = _mm256_cmpgt_epi32(v.min_normal_bits, a);  // a <= 0x7FFFFFFF: signed ok
  const __m256i code = _mm256_min_epu32(_mm256_blendv_epi8(normal, sub, is_sub), v.max_code);
  return _mm256_or_si256(code, sign);
}

// Four vectors of int32 codes (elements 0-7, 8-15, 16-23, 24-31) -> 32 bytes in order.
FP8KIT_AVX2 inline __m256i pack32(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  const __m256i p01 = _mm256_packs_epi32(c0, c1);  // per lane: c0 lo/hi half, c1 lo/hi half
  const __m256i p23 = _mm256_packs_epi32(c2, c3);
  const __m256i b = _mm256_packus_epi16(p01, p23);  // dwords: c0l c1l c2l c3l | c0h c1h c2h c3h
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <typename T>
FP8KIT_AVX2 float encode_span_avx2(const T* src, uint8_t* dst, int64_t n, float scale,
                                   const Fmt& f, float acc_in, bool stream) {
  const VecFmt v = make_vec_fmt(f, scale);
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  if (stream) {
    // Scalar head up to a 32-byte aligned destination so the loop can use streaming stores.
    const int64_t head = std::min<int64_t>(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
    acc_in = encode_span_scalar(src, dst, head, scale, f, acc_in);
    i = head;
    for (; i + 32 <= n; i += 32) {
      const __m256i c0 = encode8(load8(src + i), v, acc0);
      const __m256i c1 = encode8(load8(src + i + 8), v, acc1);
      const __m256i c2 = encode8(load8(src + i + 16), v, acc0);
      const __m256i c3 = encode8(load8(src + i + 24), v, acc1);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), pack32(c0, c1, c2, c3));
    }
    _mm_sfence();
  } else {
    for (; i + 32 <= n; i += 32) {
      const __m256i c0 = encode8(load8(src + i), v, acc0);
      const __m256i c1 = encode8(load8(src + i + 8), v, acc1);
      const __m256i c2 = encode8(load8(src + i + 16), v, acc0);
      const __m256i c3 = encode8(load8(src + i + 24), v, acc1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), pack32(c0, c1, c2, c3));
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(acc0, acc1));
  float acc = acc_in;
  for (float l : lanes) acc = std::max(acc, l);
  return encode_span_scalar(src + i, dst + i, n - i, scale, f, acc);
}

template <typename T>
FP8KIT_AVX2 float amax_span_avx2(const T* src, int64_t n, float acc_in) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {  // max_ps(|x|, acc) keeps acc where |x| is NaN
      acc[k] = _mm256_max_ps(_mm256_and_ps(load8(src + i + 8 * k), abs_mask), acc[k]);
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]),
                                       _mm256_max_ps(acc[2], acc[3])));
  float result = acc_in;
  for (float l : lanes) result = std::max(result, l);
  return amax_span_scalar(src + i, n - i, result);
}

template <typename T>
FP8KIT_AVX2 void colsum_span_avx2(const T* src, float* acc, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), load8(src + i)));
  }
  colsum_span_scalar(src + i, acc + i, n - i);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 path: 64 elements per iteration (4 x 16 float32 lanes -> one 64-byte store)
// ---------------------------------------------------------------------------------------------

#define FP8KIT_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

FP8KIT_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
FP8KIT_AVX512 inline __m512 load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
FP8KIT_AVX512 inline __m512 load16(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

struct VecFmt512 {
  __m512i min_normal_bits, rebias_minus_half, one, max_code, sign_mask, magic_bits;
  __m512 fmax, magic, scale;
  __m128i shift;
};

FP8KIT_AVX512 inline VecFmt512 make_vec_fmt512(const Fmt& f, float scale) {
  VecFmt512 v;
  v.min_normal_bits = _mm512_set1_epi32(static_cast<int>(f.min_normal_bits));
  v.rebias_minus_half = _mm512_set1_epi32(static_cast<int>(f.half_minus_one - f.rebias));
  v.one = _mm512_set1_epi32(1);
  v.max_code = _mm512_set1_epi32(0x7F);
  v.sign_mask = _mm512_set1_epi32(0x80);
  v.magic_bits = _mm512_set1_epi32(static_cast<int>(f.magic_bits));
  v.fmax = _mm512_set1_ps(float_of(f.fmax_bits));
  v.magic = _mm512_set1_ps(f.magic);
  v.scale = _mm512_set1_ps(scale);
  v.shift = _mm_cvtsi32_si128(f.shift);
  return v;
}

// 16 float32 values -> 16 FP8 codes (bytes); the same steps as encode8.
FP8KIT_AVX512 inline __m128i encode16(__m512 x, const VecFmt512& v, __m512& acc) {
  acc = _mm512_max_ps(_mm512_abs_ps(x), acc);  // NaN |x| leaves acc as it was
  const __m512 p = _mm512_mul_ps(x, v.scale);
  const __m512i sign = _mm512_srli_epi32(_mm512_castps_si512(p), 24);  // masked by 0x80 below
  const __m512i a = _mm512_castps_si512(_mm512_min_ps(v.fmax, _mm512_abs_ps(p)));
  const __m512i odd = _mm512_and_si512(_mm512_srl_epi32(a, v.shift), v.one);
  const __m512i normal = _mm512_srl_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, v.rebias_minus_half), odd), v.shift);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), v.magic)), v.magic_bits);
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(a, v.min_normal_bits);
  const __m512i code = _mm512_min_epu32(_mm512_mask_blend_epi32(is_sub, normal, sub), v.max_code);
  // code | (sign & 0x80) in one ternary-logic op: imm bit (a*4 + b*2 + c) = a | (b & c) -> 0xF8
  return _mm512_cvtepi32_epi8(_mm512_ternarylogic_epi32(code, sign, v.sign_mask, 0xF8));
}

template <typename T>
FP8KIT_AVX512 float encode_span_avx512(const T* src, uint8_t* dst, int64_t n, float scale,
                                       const Fmt& f, float acc_in, bool stream) {
  const VecFmt512 v = make_vec_fmt512(f, scale);
  __m512 acc0 = _mm512_setzero_ps();
  __m512 acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  if (stream) {  // scalar head up to a 64-byte aligned destination, then whole-line stores
    i = std::min<int64_t>(n, (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63);
    acc_in = encode_span_scalar(src, dst, i, scale, f, acc_in);
  }
  for (; i + 64 <= n; i += 64) {
    const __m128i c0 = encode16(load16(src + i), v, acc0);
    const __m128i c1 = encode16(load16(src + i + 16), v, acc1);
    const __m128i c2 = encode16(load16(src + i + 32), v, acc0);
    const __m128i c3 = encode16(load16(src + i + 48), v, acc1);
    const __m512i line = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set_m128i(c1, c0)), _mm256_set_m128i(c3, c2), 1);
    if (stream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), line);
    } else {
      _mm512_storeu_si512(dst + i, line);
    }
  }
  if (stream) _mm_sfence();
  const float acc = std::max(acc_in, _mm512_reduce_max_ps(_mm512_max_ps(acc0, acc1)));
  return encode_span_avx2(src + i, dst + i, n - i, scale, f, acc, false);
}

template <typename T>
FP8KIT_AVX512 float amax_span_avx512(const T* src, int64_t n, float acc_in) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    for (int k = 0; k < 4; ++k) {
      acc[k] = _mm512_max_ps(_mm512_abs_ps(load16(src + i + 16 * k)), acc[k]);
    }
  }
  const __m512 m = _mm512_max_ps(_mm512_max_ps(acc[0], acc[1]), _mm512_max_ps(acc[2], acc[3]));
  return amax_span_avx2(src + i, n - i, std::max(acc_in, _mm512_reduce_max_ps(m)));
}

template <typename T>
FP8KIT_AVX512 void colsum_span_avx512(const T* src, float* acc, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), load16(src + i)));
  }
  colsum_span_avx2(src + i, acc + i, n - i);
}

bool cpu_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return has;
}

bool cpu_has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return has;
}
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
#endif

// ---------------------------------------------------------------------------------------------
// Dispatch helpers
// ---------------------------------------------------------------------------------------------

enum Isa : int32_t { kIsaAuto = 0, kIsaScalar = 1, kIsaAvx2 = 2, kIsaAvx512 = 3 };
enum InDtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum Status : int32_t {
  kOk = 0,
  kBadDtype = 1,
  kBadFormat = 2,
  kBadIsa = 3,
  kIsaUnavailable = 4,
  kBadShape = 5,
  kInternalError = 6,
};

// The best instruction set of this CPU (kIsaAvx512, kIsaAvx2 or kIsaScalar).
int32_t best_isa() {
  if (cpu_has_avx512()) return kIsaAvx512;
  return cpu_has_avx2() ? kIsaAvx2 : kIsaScalar;
}

// Encode n contiguous elements with the loop of instruction set `level` (an Isa, not auto).
template <typename T>
float encode_span(const T* src, uint8_t* dst, int64_t n, float scale, const Fmt& f, float acc,
                  int32_t level, bool stream) {
#if FP8KIT_HAVE_X86
  if (level == kIsaAvx512) return encode_span_avx512(src, dst, n, scale, f, acc, stream);
  if (level == kIsaAvx2) return encode_span_avx2(src, dst, n, scale, f, acc, stream);
#endif
  (void)level;
  (void)stream;
  return encode_span_scalar(src, dst, n, scale, f, acc);
}

// Column sums of one row span with the loop of instruction set `level`.
template <typename T>
void colsum_span(const T* src, float* acc, int64_t n, int32_t level) {
#if FP8KIT_HAVE_X86
  if (level == kIsaAvx512) return colsum_span_avx512(src, acc, n);
  if (level == kIsaAvx2) return colsum_span_avx2(src, acc, n);
#endif
  (void)level;
  colsum_span_scalar(src, acc, n);
}

// Outputs larger than this many bytes are written with streaming stores (they would not stay in
// cache anyway, and streaming skips the read-for-ownership of the destination lines).
constexpr int64_t kStreamBytes = int64_t{8} << 20;
// Elements per thread below which a call stays serial: an OpenMP region costs microseconds (much
// more when the other cores are busy), a 256K-element cast ~100 us on one core.
constexpr int64_t kGrain = int64_t{1} << 18;
// Dequantized outputs (4 or 2 bytes per element) of this many bytes and more are written with
// streaming stores. Measured on one core (CPU time): streaming halves the write time from 16 MiB
// up (write + first read back: equal at 16 MiB, 27% less at 32 MiB); below it, the output's
// first read (the GEMM that follows) profits from finding it in cache.
constexpr int64_t kDequantStreamBytes = int64_t{32} << 20;

template <typename T>
float cast_linear(const T* src, uint8_t* dst, int64_t n, float scale, const Fmt& f,
                  int32_t level) {
  const bool stream = level >= kIsaAvx2 && n >= kStreamBytes;
  return at::parallel_reduce(
      int64_t{0}, n, kGrain, 0.0f,
      [&](int64_t begin, int64_t end, float acc) {
        return encode_span(src + begin, dst + begin, end - begin, scale, f, acc, level, stream);
      },
      [](float a, float b) { return std::max(a, b); });
}

// Validate the common arguments; on success set the instruction set to use and the format.
int32_t prepare(int32_t in_dtype, int32_t fmt_id, int32_t isa, int32_t* level, Fmt* fmt) {
  if (in_dtype < kFloat32 || in_dtype > kFloat16) return kBadDtype;
  if (fmt_id != 0 && fmt_id != 1) return kBadFormat;
  if (isa < kIsaAuto || isa > kIsaAvx512) return kBadIsa;
  if (isa > best_isa()) return kIsaUnavailable;
  *level = isa == kIsaAuto ? best_isa() : isa;
  *fmt = make_fmt(fmt_id);
  return kOk;
}

// Call fn with src typed as const float* / const bf16_t* / const f16_t*.
template <typename Fn>
void dispatch_input(const void* src, int32_t in_dtype, Fn&& fn) {
  switch (in_dtype) {
    case kFloat32:
      fn(static_cast<const float*>(src));
      break;
    case kBFloat16:
      fn(static_cast<const bf16_t*>(src));
      break;
    default:
      fn(static_cast<const f16_t*>(src));
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// Cast + transpose (2-D): data (M, N) row-major and data_t (N, M) row-major in one read
// ---------------------------------------------------------------------------------------------

constexpr int64_t kTile = 32;  // AVX2 transpose tile (32 registers of 32 bytes)
constexpr int64_t kBandRows = 64;  // rows per band: each out_t row gets 64 bytes = 1 cache line
constexpr int64_t kBandCols = 4096;  // columns per chunk: 64 x 4096 FP8 bytes = 256 KiB (L2)

// Transpose a rows x cols byte block (row stride ld_src) into dst (row stride ld_dst).
inline void transpose_block_scalar(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols,
                                   uint8_t* dst, int64_t ld_dst) {
  for (int64_t c = 0; c < cols; ++c) {
    uint8_t* d = dst + c * ld_dst;
    for (int64_t r = 0; r < rows; ++r) d[r] = src[r * ld_src + c];
  }
}

#if FP8KIT_HAVE_X86
// Transpose a 32 x 32 byte tile (row stride ld_src) into dst (row stride ld_dst) with AVX2.
// The 32 x 32 transpose is four 16 x 16 ones: after pairing 128-bit halves, each 256-bit register
// holds a row of the upper 16 rows in lane 0 and the matching row of the lower 16 in lane 1, and
// four rounds of in-lane unpacks (8, 16, 32, 64-bit) transpose both lanes at once.
FP8KIT_AVX2 inline void transpose_tile32_avx2(const uint8_t* src, int64_t ld_src, uint8_t* dst,
                                              int64_t ld_dst) {
  __m256i r[32];
  for (int i = 0; i < 16; ++i) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * ld_src));
    const __m256i b =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (i + 16) * ld_src));
    r[i] = _mm256_permute2x128_si256(a, b, 0x20);       // row i, row i+16: columns 0-15
    r[i + 16] = _mm256_permute2x128_si256(a, b, 0x31);  // row i, row i+16: columns 16-31
  }
  // Output order of the four unpack rounds: u[k] holds column kCol[k] of the 16 x 16 block.
  static constexpr int kCol[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  for (int h = 0; h < 2; ++h) {
    const __m256i* v = r + h * 16;
    __m256i t[16];
    __m256i u[16];
    for (int i = 0; i < 8; ++i) {  // pairs of rows, bytes interleaved
      t[2 * i] = _mm256_unpacklo_epi8(v[2 * i], v[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_epi8(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // groups of 4 rows
      for (int j = 0; j < 2; ++j) {
        u[4 * i + j] = _mm256_unpacklo_epi16(t[4 * i + j], t[4 * i + j + 2]);
        u[4 * i + j + 2] = _mm256_unpackhi_epi16(t[4 * i + j], t[4 * i + j + 2]);
      }
    }
    for (int i = 0; i < 2; ++i) {  // groups of 8 rows
      for (int j = 0; j < 4; ++j) {
        t[8 * i + j] = _mm256_unpacklo_epi32(u[8 * i + j], u[8 * i + j + 4]);
        t[8 * i + j + 4] = _mm256_unpackhi_epi32(u[8 * i + j], u[8 * i + j + 4]);
      }
    }
    for (int j = 0; j < 8; ++j) {  // all 16 rows
      u[j] = _mm256_unpacklo_epi64(t[j], t[j + 8]);
      u[j + 8] = _mm256_unpackhi_epi64(t[j], t[j + 8]);
    }
    for (int k = 0; k < 16; ++k) {
      const int c = h * 16 + kCol[k];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * ld_dst), u[k]);
    }
  }
}

// 64 x 64 bytes of the band buffer (row stride ld) -> 64 rows of 64 bytes of out_t (row stride
// m), through an L1 buffer so every out_t store is a whole line (streaming when `stream`).
FP8KIT_AVX2 void transpose_block64_avx2(const uint8_t* buf, int64_t ld, uint8_t* dst, int64_t m,
                                        bool stream) {
  alignas(64) uint8_t tile_t[kBandRows * 64];
  for (int rb = 0; rb < 2; ++rb) {
    for (int cb = 0; cb < 2; ++cb) {
      transpose_tile32_avx2(buf + rb * kTile * ld + cb * kTile, ld,
                            tile_t + cb * kTile * 64 + rb * kTile, 64);
    }
  }
  for (int64_t c = 0; c < 64; ++c) {
    const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(tile_t + c * 64));
    const __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(tile_t + c * 64 + 32));
    __m256i* d = reinterpret_cast<__m256i*>(dst + c * m);
    if (stream) {
      _mm256_stream_si256(d, lo);
      _mm256_stream_si256(d + 1, hi);
    } else {
      _mm256_storeu_si256(d, lo);
      _mm256_storeu_si256(d + 1, hi);
    }
  }
}

// Copy w bytes (w % 32 == 0, dst 32-byte aligned) with streaming stores.
FP8KIT_AVX2 void stream_copy_avx2(uint8_t* dst, const uint8_t* src, int64_t w) {
  for (int64_t c = 0; c < w; c += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + c),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c)));
  }
}

FP8KIT_AVX2 void store_fence() { _mm_sfence(); }
#endif

// Bands [band_begin, band_end) of kBandRows rows, in column chunks of kBandCols: encode the
// chunk's rows (sequential reads of x) into a per-thread band buffer that stays in L2, copy it
// to out, and transpose it into out_t. x is read once; out and out_t are written once each
// (with streaming stores for large, line-aligned matrices: 6 bytes of traffic per float32).
// Without out_t the rows are encoded straight into out. With colsum (n floats), each row chunk's
// float32 values are added to its column sums right after encoding, while the chunk is in L1.
template <typename T>
float cast_bands(const T* src, uint8_t* out, uint8_t* out_t, float* colsum, int64_t m, int64_t n,
                 float scale, const Fmt& f, int32_t level, bool stream, int64_t band_begin,
                 int64_t band_end, float acc) {
  uint8_t* buf = nullptr;
  if (out_t != nullptr) {
    thread_local std::vector<uint8_t> storage;
    const size_t need = static_cast<size_t>(kBandRows * std::min(n, kBandCols) + 64);
    if (storage.size() < need) storage.resize(need);
    buf = storage.data() + ((64 - (reinterpret_cast<uintptr_t>(storage.data()) & 63)) & 63);
  }
  for (int64_t band = band_begin; band < band_end; ++band) {
    const int64_t r0 = band * kBandRows;
    const int64_t rows = std::min(kBandRows, m - r0);
    for (int64_t c0 = 0; c0 < n; c0 += kBandCols) {
      const int64_t w = std::min(kBandCols, n - c0);
      for (int64_t r = 0; r < rows; ++r) {
        const T* row = src + (r0 + r) * n + c0;
        uint8_t* out_row = out + (r0 + r) * n + c0;
        if (buf == nullptr) {
          acc = encode_span(row, out_row, w, scale, f, acc, level, false);
        } else {
          acc = encode_span(row, buf + r * w, w, scale, f, acc, level, false);
#if FP8KIT_HAVE_X86
          if (stream) {  // n % 64 == 0 and out line-aligned: whole lines
            stream_copy_avx2(out_row, buf + r * w, w);
          } else {
            std::memcpy(out_row, buf + r * w, static_cast<size_t>(w));
          }
#else
          std::memcpy(out_row, buf + r * w, static_cast<size_t>(w));
#endif
        }
        if (colsum != nullptr) colsum_span(row, colsum + c0, w, level);
      }
      if (buf == nullptr) continue;
      for (int64_t cb = 0; cb < w; cb += 64) {
        const int64_t cols = std::min<int64_t>(64, w - cb);
        uint8_t* dst = out_t + (c0 + cb) * m + r0;
#if FP8KIT_HAVE_X86
        if (level >= kIsaAvx2 && rows == kBandRows && cols == 64) {
          transpose_block64_avx2(buf + cb, w, dst, m, stream);
          continue;
        }
#endif
        transpose_block_scalar(buf + cb, w, rows, cols, dst, m);
      }
    }
  }
#if FP8KIT_HAVE_X86
  if (stream) store_fence();
#endif
  return acc;
}

// Whether the transposing cast of an (m, n) matrix writes with streaming stores: only for large
// outputs whose every store is a whole, aligned cache line.
inline bool transpose_streams(int32_t level, int64_t m, int64_t n, const uint8_t* out,
                              const uint8_t* out_t) {
  return level >= kIsaAvx2 && m * n >= kStreamBytes && m % 64 == 0 && n % 64 == 0 &&
         reinterpret_cast<uintptr_t>(out) % 64 == 0 &&
         reinterpret_cast<uintptr_t>(out_t) % 64 == 0;
}

template <typename T>
float cast_transpose_impl(const T* src, uint8_t* out, uint8_t* out_t, int64_t m, int64_t n,
                          float scale, const Fmt& f, int32_t level) {
  const int64_t bands = (m + kBandRows - 1) / kBandRows;
  const bool stream = transpose_streams(level, m, n, out, out_t);
  // grain in bands: about kGrain elements per task at least
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, n * kBandRows));
  return at::parallel_reduce(
      int64_t{0}, bands, grain, 0.0f,
      [&](int64_t b_begin, int64_t b_end, float acc) {
        return cast_bands(src, out, out_t, nullptr, m, n, scale, f, level, stream, b_begin, b_end,
                          acc);
      },
      [](float a, float b) { return std::max(a, b); });
}

// The cast of an (m, n) matrix with its column sums (colsum: n floats, overwritten) and,
// when out_t is not null, its transpose. The bands are split into at most one chunk per thread
// (one chunk below kGrain elements), each summing into its own row of partial sums; the chunk
// sums are added in chunk order, so the result depends only on the number of threads.
template <typename T>
float cast_colsum_impl(const T* src, uint8_t* out, uint8_t* out_t, float* colsum, int64_t m,
                       int64_t n, float scale, const Fmt& f, int32_t level) {
  const int64_t bands = (m + kBandRows - 1) / kBandRows;
  const bool stream = out_t != nullptr && transpose_streams(level, m, n, out, out_t);
  const int64_t by_size = std::max<int64_t>(1, (m * n) / kGrain);
  const int64_t chunks = std::min<int64_t>(
      bands, std::min<int64_t>(by_size, std::max<int64_t>(1, at::get_num_threads())));
  std::vector<float> partial(static_cast<size_t>(chunks * n), 0.0f);
  std::vector<float> amax(static_cast<size_t>(chunks), 0.0f);
  at::parallel_for(int64_t{0}, chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      amax[c] = cast_bands(src, out, out_t, partial.data() + c * n, m, n, scale, f, level, stream,
                           c * bands / chunks, (c + 1) * bands / chunks, 0.0f);
    }
  });
  std::memcpy(colsum, partial.data(), static_cast<size_t>(n) * sizeof(float));
  for (int64_t c = 1; c < chunks; ++c) {
    const float* p = partial.data() + c * n;
    for (int64_t j = 0; j < n; ++j) colsum[j] += p[j];
  }
  float result = 0.0f;
  for (float a : amax) result = std::max(result, a);
  return result;
}

// ---------------------------------------------------------------------------------------------
// amax alone (the first read of current scaling)
// ---------------------------------------------------------------------------------------------

template <typename T>
float amax_impl(const T* src, int64_t n, int32_t level) {
  return at::parallel_reduce(
      int64_t{0}, n, kGrain, 0.0f,
      [&](int64_t begin, int64_t end, float acc) {
#if FP8KIT_HAVE_X86
        if (level == kIsaAvx512) return amax_span_avx512(src + begin, end - begin, acc);
        if (level == kIsaAvx2) return amax_span_avx2(src + begin, end - begin, acc);
#endif
        return amax_span_scalar(src + begin, end - begin, acc);
      },
      [](float a, float b) { return std::max(a, b); });
}


// ---------------------------------------------------------------------------------------------
// FP8 -> float32 / bfloat16 (dequantize): out = float32(fp8) * scale
// ---------------------------------------------------------------------------------------------
//
// Every FP8 value is exact in float32, so float32(fp8) is exact and the result is one float32
// multiply, as torch's `data.to(float32) * scale_inv`. The vector loops decode through IEEE half
// (F16C vcvtph2ps: exact, float16 subnormals included):
//   E5M2:   the byte is the top byte of a float16 (same exponent width and bias): h = b << 8.
//   E4M3fn: h = sign << 15 | (b & 0x7F) << 7 is the float16 of fp8 * 2^-8 (the exponent field is
//           read with bias 15 instead of 7; E4M3 subnormals m * 2^-9 become the float16
//           subnormals m * 2^-17), so float32(fp8) = float(h) * 256, exact. The NaN codes
//           0x7F / 0xFF would give h = 0x3F80 (1.875): they are patched to 0x7F80, a quiet
//           float16 NaN whose float32 is 0x7FF00000 with the sign, the bits torch's own
//           conversion produces.
// The scalar loop (any CPU, and the tails) reads a 256-entry float32 table of the same values.
// bfloat16 output: the float32 result rounded to nearest even (exact, a truncation, when there is
// no scale: every FP8 value is a bfloat16 value); a NaN stays a quiet NaN with its sign.

// float32(code) for every byte of format fmt_id, bit for bit what torch's conversion returns.
inline float decode_scalar(uint32_t b, int32_t fmt_id) {
  if (fmt_id == 1) {
    const f16_t h{static_cast<uint16_t>(b << 8)};
    return load_f32(&h);
  }
  const uint32_t sign = (b & 0x80u) << 24;
  const uint32_t em = b & 0x7Fu;
  if (em == 0x7Fu) return float_of(sign | 0x7FF00000u);  // NaN
  if (em < 8u) return float_of(sign | bits_of(static_cast<float>(em) * 0x1p-9f));  // m * 2^-9
  return float_of(sign | ((em + (120u << 3)) << 20));  // exponent e + 120, mantissa m << 20
}

struct DecodeTables {
  float v[2][256];
};

// The 256 values of each format (built once, thread-safe static initialisation).
const float* decode_table(int32_t fmt_id) {
  static const DecodeTables tables = [] {
    DecodeTables t{};
    for (int32_t f = 0; f < 2; ++f) {
      for (uint32_t b = 0; b < 256; ++b) t.v[f][b] = decode_scalar(b, f);
    }
    return t;
  }();
  return tables.v[fmt_id];
}

// float32 -> bfloat16 bits, round to nearest even; NaN -> quiet NaN with the same sign.
FP8KIT_TAIL uint16_t bf16_rne(float p) {
  const uint32_t b = bits_of(p);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

FP8KIT_TAIL void store_out(float* d, float p) { *d = p; }
FP8KIT_TAIL void store_out(bf16_t* d, float p) { d->bits = bf16_rne(p); }

template <typename Out>
FP8KIT_TAIL void dequant_span_scalar(const uint8_t* src, Out* dst, int64_t n, float scale,
                                     int32_t fmt_id) {
  const float* lut = decode_table(fmt_id);
  for (int64_t i = 0; i < n; ++i) store_out(dst + i, lut[src[i]] * scale);  // one multiply
}

#if FP8KIT_HAVE_X86
// 16 FP8 codes -> the 16 float16 bit patterns described above (E5M2: the same values; E4M3fn:
// the values times 2^-8, NaN codes patched to a float16 NaN).
template <int32_t kFmt>
FP8KIT_AVX2 inline __m256i fp8_to_half16(__m128i codes) {
  const __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8);  // code << 8
  if (kFmt == 1) return t;
  // srai by 1: bit 15 = bit 14 = sign, bits 13..7 = the 7 exponent and mantissa bits; clear 14
  const __m256i h =
      _mm256_and_si256(_mm256_srai_epi16(t, 1), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m256i em = _mm256_set1_epi16(0x7F00);
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(t, em), em);
  return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x4000)));  // 0x3F80 -> 0x7F80
}

// float(fp8) * scale for 16 codes at s, as two vectors of 8 (elements 0-7, 8-15).
template <int32_t kFmt>
FP8KIT_AVX2 inline void decode16_avx2(const uint8_t* s, __m256 scale, __m256& f0, __m256& f1) {
  const __m256i h = fp8_to_half16<kFmt>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  f0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  f1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  if (kFmt == 0) {  // exact: undo the 2^-8 of the float16 encoding
    f0 = _mm256_mul_ps(f0, _mm256_set1_ps(256.0f));
    f1 = _mm256_mul_ps(f1, _mm256_set1_ps(256.0f));
  }
  f0 = _mm256_mul_ps(f0, scale);  // the one rounded multiply
  f1 = _mm256_mul_ps(f1, scale);
}

// 8 float32 -> 8 bfloat16 bit patterns in the low 16 bits of each int32 lane (as bf16_rne).
FP8KIT_AVX2 inline __m256i bf16_rne8(__m256 p) {
  const __m256i b = _mm256_castps_si256(p);
  const __m256i hi = _mm256_srli_epi32(b, 16);
  const __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

template <bool kStream>
FP8KIT_AVX2 inline void store16_avx2(float* d, __m256 f0, __m256 f1) {
  if (kStream) {
    _mm256_stream_ps(d, f0);
    _mm256_stream_ps(d + 8, f1);
  } else {
    _mm256_storeu_ps(d, f0);
    _mm256_storeu_ps(d + 8, f1);
  }
}

template <bool kStream>
FP8KIT_AVX2 inline void store16_avx2(bf16_t* d, __m256 f0, __m256 f1) {
  // packus per 128-bit lane gives 64-bit blocks f0[0:4] f1[0:4] f0[4:8] f1[4:8]: reorder them
  const __m256i v =
      _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_rne8(f0), bf16_rne8(f1)), 0xD8);
  if (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), v);
  }
}

template <typename Out, int32_t kFmt, bool kStream>
FP8KIT_AVX2 int64_t dequant_loop_avx2(const uint8_t* src, Out* dst, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 f0, f1, f2, f3;
    decode16_avx2<kFmt>(src + i, s, f0, f1);
    decode16_avx2<kFmt>(src + i + 16, s, f2, f3);
    store16_avx2<kStream>(dst + i, f0, f1);
    store16_avx2<kStream>(dst + i + 16, f2, f3);
  }
  for (; i + 16 <= n; i += 16) {
    __m256 f0, f1;
    decode16_avx2<kFmt>(src + i, s, f0, f1);
    store16_avx2<kStream>(dst + i, f0, f1);
  }
  if (kStream) _mm_sfence();
  return i;
}

template <typename Out, int32_t kFmt>
FP8KIT_AVX2 void dequant_span_avx2(const uint8_t* src, Out* dst, int64_t n, float scale,
                                   int64_t head, bool stream) {
  dequant_span_scalar(src, dst, head, scale, kFmt);
  int64_t i = head;
  i += stream ? dequant_loop_avx2<Out, kFmt, true>(src + i, dst + i, n - i, scale)
              : dequant_loop_avx2<Out, kFmt, false>(src + i, dst + i, n - i, scale);
  dequant_span_scalar(src + i, dst + i, n - i, scale, kFmt);
}

template <int32_t kFmt>
FP8KIT_AVX512 inline __m512 decode16_avx512(const uint8_t* s, __m512 scale) {
  __m512 f = _mm512_cvtph_ps(
      fp8_to_half16<kFmt>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
  if (kFmt == 0) f = _mm512_mul_ps(f, _mm512_set1_ps(256.0f));  // exact
  return _mm512_mul_ps(f, scale);                                // the one rounded multiply
}

// 16 float32 -> 16 bfloat16 bit patterns (as bf16_rne).
FP8KIT_AVX512 inline __m256i bf16_rne16(__m512 p) {
  const __m512i b = _mm512_castps_si512(p);
  const __m512i hi = _mm512_srli_epi32(b, 16);
  const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

template <bool kStream>
FP8KIT_AVX512 inline void store64_avx512(float* d, __m512 f0, __m512 f1, __m512 f2, __m512 f3) {
  if (kStream) {
    _mm512_stream_ps(d, f0);
    _mm512_stream_ps(d + 16, f1);
    _mm512_stream_ps(d + 32, f2);
    _mm512_stream_ps(d + 48, f3);
  } else {
    _mm512_storeu_ps(d, f0);
    _mm512_storeu_ps(d + 16, f1);
    _mm512_storeu_ps(d + 32, f2);
    _mm512_storeu_ps(d + 48, f3);
  }
}

template <bool kStream>
FP8KIT_AVX512 inline void store64_avx512(bf16_t* d, __m512 f0, __m512 f1, __m512 f2,
                                         __m512 f3) {
  const __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_rne16(f0)), bf16_rne16(f1), 1);
  const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_rne16(f2)), bf16_rne16(f3), 1);
  if (kStream) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d), lo);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 32), hi);
  } else {
    _mm512_storeu_si512(d, lo);
    _mm512_storeu_si512(d + 32, hi);
  }
}

template <typename Out, int32_t kFmt, bool kStream>
FP8KIT_AVX512 int64_t dequant_loop_avx512(const uint8_t* src, Out* dst, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512 f0 = decode16_avx512<kFmt>(src + i, s);
    const __m512 f1 = decode16_avx512<kFmt>(src + i + 16, s);
    const __m512 f2 = decode16_avx512<kFmt>(src + i + 32, s);
    const __m512 f3 = decode16_avx512<kFmt>(src + i + 48, s);
    store64_avx512<kStream>(dst + i, f0, f1, f2, f3);
  }
  if (kStream) _mm_sfence();
  return i;
}

template <typename Out, int32_t kFmt>
FP8KIT_AVX512 void dequant_span_avx512(const uint8_t* src, Out* dst, int64_t n, float scale,
                                       int64_t head, bool stream) {
  dequant_span_scalar(src, dst, head, scale, kFmt);
  int64_t i = head;
  i += stream ? dequant_loop_avx512<Out, kFmt, true>(src + i, dst + i, n - i, scale)
              : dequant_loop_avx512<Out, kFmt, false>(src + i, dst + i, n - i, scale);
  dequant_span_avx2<Out, kFmt>(src + i, dst + i, n - i, scale, 0, false);  // tail
}
#endif

// Decode n contiguous codes with the loop of instruction set `level`. With `stream`, a scalar
// head first aligns the destination to 64 bytes, then the vector loop writes with streaming
// stores (dst must be aligned to its element size, which torch's allocations are).
template <typename Out, int32_t kFmt>
void dequant_span(const uint8_t* src, Out* dst, int64_t n, float scale, int32_t level,
                  bool stream) {
  int64_t head = 0;
  if (stream) {
    const auto addr = reinterpret_cast<uintptr_t>(dst);
    head = std::min<int64_t>(
        n, static_cast<int64_t>(((64 - (addr & 63)) & 63) / sizeof(Out)));
  }
#if FP8KIT_HAVE_X86
  if (level == kIsaAvx512) return dequant_span_avx512<Out, kFmt>(src, dst, n, scale, head, stream);
  if (level == kIsaAvx2) return dequant_span_avx2<Out, kFmt>(src, dst, n, scale, head, stream);
#endif
  (void)level;
  (void)head;
  dequant_span_scalar(src, dst, n, scale, kFmt);
}

template <typename Out>
void dequant_impl(const uint8_t* src, Out* dst, int64_t n, float scale, int32_t fmt_id,
                  int32_t level) {
  const bool stream = level >= kIsaAvx2 &&
                      n * static_cast<int64_t>(sizeof(Out)) >= kDequantStreamBytes &&
                      reinterpret_cast<uintptr_t>(dst) % sizeof(Out) == 0;
  at::parallel_for(int64_t{0}, n, kGrain, [&](int64_t begin, int64_t end) {
    if (fmt_id == 0) {
      dequant_span<Out, 0>(src + begin, dst + begin, end - begin, scale, level, stream);
    } else {
      dequant_span<Out, 1>(src + begin, dst + begin, end - begin, scale, level, stream);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Scales (SPEC section 3 `new_scale`) and the fused cast
// ---------------------------------------------------------------------------------------------

// The delayed-scaling scale rule for one amax, bit for bit fp8kit's torch `compute_scale`:
//   amax 0, inf or NaN             -> old (unusable amax)
//   default   numerator / amax     (numerator = float32(fmax * 2^-margin), one IEEE division),
//             an infinite quotient -> FLT_MAX
//   power of 2: 2^(e - margin) with e the largest integer such that 2^e * amax <= fmax, capped
//             at 2^127, as float32 (subnormal below 2^-126, 0 below 2^-149). With
//             amax = (1 + ma) 2^ea and fmax = (1 + mf) 2^ef (23-bit mantissas ma, mf), e is
//             ef - ea, minus one when ma > mf: exact integer arithmetic, no log2.
struct ScaleRule {
  float numerator;
  int32_t power2;
  int32_t fmax_exp;
  uint32_t fmax_mant;
  int32_t margin;  // power-of-two rule only (an integer there)
};

inline float scale_from_amax(float amax, float old, const ScaleRule& rule) {
  if (!(amax > 0.0f && amax < INFINITY)) return old;
  if (rule.power2 != 0) {
    uint32_t a = bits_of(amax);
    int32_t ea;
    if (a < 0x800000u) {  // subnormal: normalise exactly by 2^24
      a = bits_of(amax * 16777216.0f);
      ea = static_cast<int32_t>(a >> 23) - 127 - 24;
    } else {
      ea = static_cast<int32_t>(a >> 23) - 127;
    }
    const uint32_t ma = a & 0x7FFFFFu;
    int32_t e = rule.fmax_exp - ea - (ma > rule.fmax_mant ? 1 : 0) - rule.margin;
    e = std::min(e, 127);
    if (e >= -126) return float_of(static_cast<uint32_t>(e + 127) << 23);
    if (e >= -149) return float_of(1u << (e + 149));
    return 0.0f;
  }
  const float s = rule.numerator / amax;
  return std::isinf(s) ? 3.4028234663852886e38f : s;
}

// float32 -> IEEE float16 bits, round to nearest even (overflow to inf, subnormals kept, NaN
// stays a quiet NaN with its sign).
FP8KIT_TAIL uint16_t f16_rne(float v) {
  const uint32_t b = bits_of(v);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (a < 0x38800000u) {  // below 2^-14: the float add of 0.5 (ulp 2^-24) rounds to the quantum
    return static_cast<uint16_t>(sign | (bits_of(float_of(a) + 0.5f) - 0x3F000000u));
  }
  return static_cast<uint16_t>(sign | ((a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23)) >> 13));
}

// Store n float32 sums as in_dtype (float32, bfloat16 or float16, rounded to nearest even).
void store_sums(const float* sums, void* dst, int32_t in_dtype, int64_t n) {
  if (in_dtype == kFloat32) {
    std::memcpy(dst, sums, static_cast<size_t>(n) * sizeof(float));
  } else if (in_dtype == kBFloat16) {
    auto* d = static_cast<uint16_t*>(dst);
    for (int64_t j = 0; j < n; ++j) d[j] = bf16_rne(sums[j]);
  } else {
    auto* d = static_cast<uint16_t*>(dst);
    for (int64_t j = 0; j < n; ++j) d[j] = f16_rne(sums[j]);
  }
}

// ---------------------------------------------------------------------------------------------
// The epilogue of a CPU FP8 GEMM (docs/performance.md, "CPU GEMM")
// ---------------------------------------------------------------------------------------------

FP8KIT_TAIL void store_rounded(float* d, float v) { *d = v; }
FP8KIT_TAIL void store_rounded(bf16_t* d, float v) { d->bits = bf16_rne(v); }
FP8KIT_TAIL void store_rounded(f16_t* d, float v) { d->bits = f16_rne(v); }

// One row's columns [0, n) of out = round(acc * s (+ bias)): one float32 multiply, one float32
// add of the bias (when there is one: adding 0 would turn -0 into +0), one rounding to Out.
template <bool kBias, typename Out>
FP8KIT_TAIL void epilogue_span_scalar(const float* a, int64_t n, float s, const float* bias,
                                      Out* o) {
  for (int64_t j = 0; j < n; ++j) {
    const float p = a[j] * s;
    store_rounded(o + j, kBias ? p + bias[j] : p);
  }
}

#if FP8KIT_HAVE_X86
// The vector rows: the same multiply and add per element (no FMA), the same rounding (the
// integer bf16_rne lanes, F16C's round-to-nearest-even conversion for float16, which keeps
// subnormals, overflows to inf and quiets a NaN keeping its top payload bits, as f16_rne).
FP8KIT_AVX2 inline void epilogue_store8(float* d, __m256 v) { _mm256_storeu_ps(d, v); }
FP8KIT_AVX2 inline void epilogue_store8(bf16_t* d, __m256 v) {
  const __m256i r = bf16_rne8(v);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d), packed);
}
FP8KIT_AVX2 inline void epilogue_store8(f16_t* d, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <bool kBias, typename Out>
FP8KIT_AVX2 void epilogue_span_avx2(const float* a, int64_t n, float s, const float* bias,
                                    Out* o) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(a + j), vs);
    if (kBias) p = _mm256_add_ps(p, _mm256_loadu_ps(bias + j));
    epilogue_store8(o + j, p);
  }
  epilogue_span_scalar<kBias>(a + j, n - j, s, kBias ? bias + j : bias, o + j);
}

FP8KIT_AVX512 inline void epilogue_store16(float* d, __m512 v) { _mm512_storeu_ps(d, v); }
FP8KIT_AVX512 inline void epilogue_store16(bf16_t* d, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), bf16_rne16(v));
}
FP8KIT_AVX512 inline void epilogue_store16(f16_t* d, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(d),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <bool kBias, typename Out>
FP8KIT_AVX512 void epilogue_span_avx512(const float* a, int64_t n, float s, const float* bias,
                                        Out* o) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(a + j), vs);
    if (kBias) p = _mm512_add_ps(p, _mm512_loadu_ps(bias + j));
    epilogue_store16(o + j, p);
  }
  epilogue_span_avx2<kBias>(a + j, n - j, s, kBias ? bias + j : bias, o + j);  // tail
}
#endif

// Rows [r0, r1) of the epilogue with the loop of instruction set `level` (the same bits).
template <bool kBias, typename Out>
void epilogue_rows(const float* acc, int64_t r0, int64_t r1, int64_t n, float s,
                   const float* bias, Out* out, int32_t level) {
#if FP8KIT_HAVE_X86
  if (level == kIsaAvx512) {
    for (int64_t i = r0; i < r1; ++i) {
      epilogue_span_avx512<kBias>(acc + i * n, n, s, bias, out + i * n);
    }
    return;
  }
  if (level == kIsaAvx2) {
    for (int64_t i = r0; i < r1; ++i) {
      epilogue_span_avx2<kBias>(acc + i * n, n, s, bias, out + i * n);
    }
    return;
  }
#endif
  (void)level;
  for (int64_t i = r0; i < r1; ++i) {
    epilogue_span_scalar<kBias>(acc + i * n, n, s, bias, out + i * n);
  }
}

template <typename Out>
void epilogue_impl(const float* acc, int64_t m, int64_t n, float s, const float* bias, Out* out,
                   int32_t level) {
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, n));
  at::parallel_for(int64_t{0}, m, grain, [&](int64_t r0, int64_t r1) {
    if (bias != nullptr) {
      epilogue_rows<true>(acc, r0, r1, n, s, bias, out, level);
    } else {
      epilogue_rows<false>(acc, r0, r1, n, s, bias, out, level);
    }
  });
}

// The bias (n,) of bias_dtype as float32 (empty for no bias: bias == nullptr).
std::vector<float> bias_as_float(const void* bias, int32_t bias_dtype, int64_t n) {
  std::vector<float> b;
  if (bias != nullptr) {
    b.resize(static_cast<size_t>(n));
    dispatch_input(bias, bias_dtype, [&](const auto* p) {
      for (int64_t j = 0; j < n; ++j) b[static_cast<size_t>(j)] = load_f32(p + j);
    });
  }
  return b;
}

// ---------------------------------------------------------------------------------------------
// A small FP8 GEMM in one call (docs/performance.md, "CPU GEMM")
// ---------------------------------------------------------------------------------------------
//
// acc[i][j] = sum over k = 0, 1, ..., K-1 (in that order, from +0) of float(a[i][k]) *
// float(b[k][j]), in float32. Every product of two FP8 values is exact in float32 (significands
// of at most 4 bits give a product of at most 8; exponents stay within 2^-32 .. 2^32), so each
// step is one rounded float32 add (or an inf / NaN, as IEEE) and the result is fixed by the order
// alone: the same bits from the scalar and the AVX2 loop (which AVX-512 CPUs run too; it
// vectorises across j, never across k) and from the torch reference `reference.small_fp8_gemm`.
// The epilogue is epilogue_impl above.

// Register blocks of kMr rows by kNr columns: the kMr x kNr sums stay in registers for the
// whole k loop. af: A's decoded values, row-major (mp, k), mp a multiple of kMr; bf: B's,
// row-major (k, np), np a multiple of kNr; the padding is zeros and its sums are never read.
// acc: row-major (m, n).
constexpr int64_t kMr = 4;
constexpr int64_t kNr = 16;

// Writes the sums of block (i0, j0) that lie inside acc.
inline void small_gemm_store(const float (*c)[kNr], int64_t i0, int64_t j0, int64_t m, int64_t n,
                             float* acc) {
  const int64_t rows = std::min(kMr, m - i0), cols = std::min(kNr, n - j0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) acc[(i0 + r) * n + j0 + j] = c[r][j];
  }
}

void small_gemm_blocks_scalar(const float* af, const float* bf, int64_t m, int64_t n,
                              int64_t np, int64_t k, float* acc) {
  for (int64_t i0 = 0; i0 < m; i0 += kMr) {
    for (int64_t j0 = 0; j0 < np; j0 += kNr) {
      float c[kMr][kNr] = {};
      for (int64_t kk = 0; kk < k; ++kk) {
        const float* br = bf + kk * np + j0;
        for (int64_t r = 0; r < kMr; ++r) {
          const float av = af[(i0 + r) * k + kk];
          for (int64_t j = 0; j < kNr; ++j) c[r][j] = c[r][j] + av * br[j];
        }
      }
      small_gemm_store(c, i0, j0, m, n, acc);
    }
  }
}

#if FP8KIT_HAVE_X86
// The same sums, 8 columns per vector: a multiply, then an add (no FMA: the product is exact
// anyway, so an FMA would give the same bits, but this keeps the loop the scalar one).
FP8KIT_AVX2 void small_gemm_blocks_avx2(const float* af, const float* bf, int64_t m, int64_t n,
                                        int64_t np, int64_t k, float* acc) {
  static_assert(kMr == 4 && kNr == 16, "the register block below is 4 x (2 x 8)");
  for (int64_t i0 = 0; i0 < m; i0 += kMr) {
    const float* a0 = af + i0 * k;
    for (int64_t j0 = 0; j0 < np; j0 += kNr) {
      __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
      __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
      __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
      __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
      for (int64_t kk = 0; kk < k; ++kk) {
        const float* br = bf + kk * np + j0;
        const __m256 b0 = _mm256_loadu_ps(br), b1 = _mm256_loadu_ps(br + 8);
        __m256 av = _mm256_broadcast_ss(a0 + kk);
        c00 = _mm256_add_ps(c00, _mm256_mul_ps(av, b0));
        c01 = _mm256_add_ps(c01, _mm256_mul_ps(av, b1));
        av = _mm256_broadcast_ss(a0 + k + kk);
        c10 = _mm256_add_ps(c10, _mm256_mul_ps(av, b0));
        c11 = _mm256_add_ps(c11, _mm256_mul_ps(av, b1));
        av = _mm256_broadcast_ss(a0 + 2 * k + kk);
        c20 = _mm256_add_ps(c20, _mm256_mul_ps(av, b0));
        c21 = _mm256_add_ps(c21, _mm256_mul_ps(av, b1));
        av = _mm256_broadcast_ss(a0 + 3 * k + kk);
        c30 = _mm256_add_ps(c30, _mm256_mul_ps(av, b0));
        c31 = _mm256_add_ps(c31, _mm256_mul_ps(av, b1));
      }
      alignas(32) float c[kMr][kNr];
      _mm256_store_ps(c[0], c00);
      _mm256_store_ps(c[0] + 8, c01);
      _mm256_store_ps(c[1], c10);
      _mm256_store_ps(c[1] + 8, c11);
      _mm256_store_ps(c[2], c20);
      _mm256_store_ps(c[2] + 8, c21);
      _mm256_store_ps(c[3], c30);
      _mm256_store_ps(c[3] + 8, c31);
      small_gemm_store(c, i0, j0, m, n, acc);
    }
  }
}
#endif

// The whole GEMM: decode A (m, k) and B (k, n) (any strides, in elements) through the tables
// into zero-padded row-major blocks, accumulate, then the epilogue into out.
template <typename Out>
void small_gemm_impl(const uint8_t* a, int64_t a_sm, int64_t a_sk, const float* lut_a,
                     const uint8_t* b, int64_t b_sk, int64_t b_sn, const float* lut_b, int64_t m,
                     int64_t n, int64_t k, float s, const float* bias, Out* out, float* acc,
                     int32_t level) {
  const int64_t mp = (m + kMr - 1) / kMr * kMr;
  const int64_t np = (n + kNr - 1) / kNr * kNr;
  std::vector<float> af(static_cast<size_t>(mp * k), 0.0f);
  std::vector<float> bf(static_cast<size_t>(k * np), 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t kk = 0; kk < k; ++kk) af[i * k + kk] = lut_a[a[i * a_sm + kk * a_sk]];
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t j = 0; j < n; ++j) bf[kk * np + j] = lut_b[b[kk * b_sk + j * b_sn]];
  }
#if FP8KIT_HAVE_X86
  if (level >= kIsaAvx2) {  // AVX-512 CPUs run the AVX2 block (the bits are the same)
    small_gemm_blocks_avx2(af.data(), bf.data(), m, n, np, k, acc);
  } else {
    small_gemm_blocks_scalar(af.data(), bf.data(), m, n, np, k, acc);
  }
#else
  small_gemm_blocks_scalar(af.data(), bf.data(), m, n, np, k, acc);
#endif
  epilogue_impl(acc, m, n, s, bias, out, level);
}

// ---------------------------------------------------------------------------------------------
// The delayed-scaling update event (SPEC section 3) on a whole (L, N) history
// ---------------------------------------------------------------------------------------------

constexpr int64_t kUpdateCols = 256;  // columns per block: rows are walked with these in L1

// Columns [j0, j0 + w) of the event: zero-skip, window amax, roll, count, scale, scale_inv.
// Returns how many of them had the value +inf.
int64_t update_block(float* hist, int64_t L, int64_t N, int64_t j0, int64_t w, float* scale,
                  float* scale_inv, int64_t* count, const uint8_t* ran, const float* staging,
                  int64_t* nonfinite, int32_t algo, int64_t interval, const ScaleRule& rule) {
  float r[kUpdateCols];
  float amax[kUpdateCols];
  uint8_t run[kUpdateCols];
  for (int64_t j = 0; j < w; ++j) {
    float v = staging != nullptr ? staging[j0 + j] : hist[j0 + j];
    if (ran != nullptr && ran[j0 + j] == 0) v = 0.0f;
    r[j] = v;
    amax[j] = v == v ? v : 0.0f;  // NaN ignored (section 3); 0 keeps the scale as NaN would
    run[j] = v != 0.0f;  // NaN counts as run, as torch's `!= 0`
  }
  for (int64_t i = 1; i < L; ++i) {
    const float* row = hist + i * N + j0;
    if (algo == 0) {
      for (int64_t j = 0; j < w; ++j) amax[j] = row[j] > amax[j] ? row[j] : amax[j];  // NaN: no
    }
    if (i >= 2) {
      float* prev = hist + (i - 1) * N + j0;
      for (int64_t j = 0; j < w; ++j) prev[j] = run[j] ? row[j] : prev[j];
    }
  }
  if (L >= 2) {
    float* last = hist + (L - 1) * N + j0;
    for (int64_t j = 0; j < w; ++j) last[j] = run[j] ? r[j] : last[j];
  }
  int64_t infinite = 0;
  for (int64_t j = 0; j < w; ++j) {
    const int64_t k = j0 + j;
    if (run[j]) {
      hist[k] = 0.0f;
      const int64_t c = count[k] + 1;
      count[k] = c;
      if ((c - 1) % interval == 0) scale[k] = scale_from_amax(amax[j], scale[k], rule);
      if (r[j] == INFINITY) {
        infinite += 1;
        if (nonfinite != nullptr) nonfinite[k] += 1;
      }
    }
    scale_inv[k] = 1.0f / scale[k];
  }
  return infinite;
}

// ---------------------------------------------------------------------------------------------
// Error sums of one cast, for the numerics inspector (docs/decisions/0256)
// ---------------------------------------------------------------------------------------------
//
// For a high-precision x (n elements) and its FP8 cast q (same order), with the float32 scale s
// the cast used and s_inv the dequantization factor, four numbers in one read of both:
//   saturated = count(|float32(x)| * s > fmax)            float32 multiply and compare
//   flushed   = count(x != 0 and float32(q) == 0)
//   signal    = sum of x^2 over the finite x              float64 squares and sums
//   noise     = sum of (x - float32(q) * s_inv)^2 over the finite x   (the product in float32)
// The counts are exact. The sums add float64 terms in one fixed order, whatever the loop (scalar
// or AVX2) and the thread count: x is cut into runs of kStatsChunk elements; in a run, element i
// goes to lane i % kStatsLanes, each lane summed in order; a run's total is its lanes summed
// from lane 0 up; the total is the runs' totals summed in order. (The torch reference sums in an
// order of its own: the same terms, other last bits.)
constexpr int64_t kStatsChunk = 4096;
constexpr int64_t kStatsLanes = 8;

struct ErrorSums {
  int64_t saturated = 0;
  int64_t flushed = 0;
  double signal = 0.0;
  double noise = 0.0;
};

// Per-lane partial sums of one run.
struct LaneSums {
  int64_t saturated = 0;
  int64_t flushed = 0;
  double signal[kStatsLanes] = {};
  double noise[kStatsLanes] = {};
};

// Elements [i0, n) of a run into their lanes (the scalar loop, and the vector loops' tails).
template <typename T>
FP8KIT_TAIL void error_sums_tail(const T* x, const uint8_t* q, int64_t i0, int64_t n, float s,
                                 float s_inv, float fmax, const float* lut, LaneSums& r) {
  for (int64_t i = i0; i < n; ++i) {
    const float v = load_f32(x + i);
    const float d = lut[q[i]];
    r.saturated += std::fabs(v) * s > fmax;
    r.flushed += v != 0.0f && d == 0.0f;
    if (std::isfinite(v)) {
      const double e = static_cast<double>(v) - static_cast<double>(d * s_inv);
      r.signal[i % kStatsLanes] += static_cast<double>(v) * static_cast<double>(v);
      r.noise[i % kStatsLanes] += e * e;
    }
  }
}

#if FP8KIT_HAVE_X86
// 8 elements into lanes 0-7: the low double vectors hold lanes 0-3, the high ones 4-7.
template <typename T>
FP8KIT_AVX2 inline void error_sums8_avx2(const T* x, __m256 d, __m256 vs, __m256 vs_inv,
                                         __m256 vfmax, int64_t& saturated, int64_t& flushed,
                                         __m256d* sig, __m256d* noise) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 v = load8(x);
  const __m256 a = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  saturated += __builtin_popcount(
      _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(a, vs), vfmax, _CMP_GT_OQ)));
  const __m256 nonzero = _mm256_cmp_ps(v, zero, _CMP_NEQ_UQ);  // NaN != 0, as in C
  flushed += __builtin_popcount(
      _mm256_movemask_ps(_mm256_and_ps(nonzero, _mm256_cmp_ps(d, zero, _CMP_EQ_OQ))));
  const __m256 finite = _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_LT_OQ);
  const __m256 xf = _mm256_and_ps(v, finite);  // non-finite elements add +0 to both sums
  const __m256 df = _mm256_and_ps(_mm256_mul_ps(d, vs_inv), finite);
  const __m256d x_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(xf));
  const __m256d x_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(xf, 1));
  const __m256d e_lo = _mm256_sub_pd(x_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(df)));
  const __m256d e_hi = _mm256_sub_pd(x_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(df, 1)));
  sig[0] = _mm256_add_pd(sig[0], _mm256_mul_pd(x_lo, x_lo));
  sig[1] = _mm256_add_pd(sig[1], _mm256_mul_pd(x_hi, x_hi));
  noise[0] = _mm256_add_pd(noise[0], _mm256_mul_pd(e_lo, e_lo));
  noise[1] = _mm256_add_pd(noise[1], _mm256_mul_pd(e_hi, e_hi));
}

// The lanes of a run, 16 elements per step (the FP8 codes decoded as the dequantize kernel
// does, exact: times 1), then the tail.
template <typename T, int32_t kFmt>
FP8KIT_AVX2 void error_sums_avx2(const T* x, const uint8_t* q, int64_t n, float s, float s_inv,
                                 float fmax, const float* lut, LaneSums& r) {
  static_assert(kStatsLanes == 8, "a half step is 8 float32 lanes");
  const __m256 vs = _mm256_set1_ps(s), vs_inv = _mm256_set1_ps(s_inv);
  const __m256 vfmax = _mm256_set1_ps(fmax), one = _mm256_set1_ps(1.0f);
  __m256d sig[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
  __m256d noise[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
  int64_t saturated = 0, flushed = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 d0, d1;
    decode16_avx2<kFmt>(q + i, one, d0, d1);
    error_sums8_avx2(x + i, d0, vs, vs_inv, vfmax, saturated, flushed, sig, noise);
    error_sums8_avx2(x + i + 8, d1, vs, vs_inv, vfmax, saturated, flushed, sig, noise);
  }
  r.saturated += saturated;
  r.flushed += flushed;
  _mm256_storeu_pd(r.signal, sig[0]);
  _mm256_storeu_pd(r.signal + 4, sig[1]);
  _mm256_storeu_pd(r.noise, noise[0]);
  _mm256_storeu_pd(r.noise + 4, noise[1]);
  error_sums_tail(x, q, i, n, s, s_inv, fmax, lut, r);
}
#endif

// One run (at most kStatsChunk elements) with the loop of instruction set `level`, its lanes
// folded from lane 0 up.
template <typename T>
ErrorSums error_sums_run(const T* x, const uint8_t* q, int64_t n, float s, float s_inv,
                         float fmax, int32_t fmt_id, int32_t level) {
  const float* lut = decode_table(fmt_id);
  LaneSums lanes;
#if FP8KIT_HAVE_X86
  if (level >= kIsaAvx2) {  // AVX-512 CPUs run the AVX2 loop (the bits are the same)
    if (fmt_id == 0) {
      error_sums_avx2<T, 0>(x, q, n, s, s_inv, fmax, lut, lanes);
    } else {
      error_sums_avx2<T, 1>(x, q, n, s, s_inv, fmax, lut, lanes);
    }
  } else {
    error_sums_tail(x, q, 0, n, s, s_inv, fmax, lut, lanes);
  }
#else
  error_sums_tail(x, q, 0, n, s, s_inv, fmax, lut, lanes);
#endif
  ErrorSums r;
  r.saturated = lanes.saturated;
  r.flushed = lanes.flushed;
  for (int64_t j = 0; j < kStatsLanes; ++j) {
    r.signal += lanes.signal[j];
    r.noise += lanes.noise[j];
  }
  return r;
}

template <typename T>
ErrorSums error_sums_impl(const T* x, const uint8_t* q, int64_t n, float s, float s_inv,
                          float fmax, int32_t fmt_id, int32_t level) {
  const int64_t chunks = (n + kStatsChunk - 1) / kStatsChunk;
  std::vector<ErrorSums> parts(static_cast<size_t>(chunks));
  at::parallel_for(int64_t{0}, chunks, kGrain / kStatsChunk, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * kStatsChunk;
      const int64_t len = std::min(kStatsChunk, n - begin);
      parts[c] = error_sums_run(x + begin, q + begin, len, s, s_inv, fmax, fmt_id, level);
    }
  });
  ErrorSums total;
  for (const ErrorSums& p : parts) {
    total.saturated += p.saturated;
    total.flushed += p.flushed;
    total.signal += p.signal;
    total.noise += p.noise;
  }
  return total;
}

}  // namespace
}  // namespace fp8kit_native

// ---------------------------------------------------------------------------------------------
// C ABI (ctypes). Every function returns a Status code (0 = success) and never throws.
// ---------------------------------------------------------------------------------------------

extern "C" {

// Best instruction set on this CPU: 1 = scalar, 2 = AVX2, 3 = AVX-512.
int32_t fp8kit_best_isa(void) { return fp8kit_native::best_isa(); }

// Cast n contiguous elements of src (in_dtype: 0 float32, 1 bfloat16, 2 float16) with *scale
// into dst (fmt: 0 float8_e4m3fn, 1 float8_e5m2); *amax = max|src| with NaN ignored.
int32_t fp8kit_cast(const void* src, int32_t in_dtype, uint8_t* dst, int64_t n,
                    const float* scale, int32_t fmt_id, int32_t isa, float* amax) {
  using namespace fp8kit_native;
  int32_t level = kIsaScalar;
  Fmt f{};
  const int32_t status = prepare(in_dtype, fmt_id, isa, &level, &f);
  if (status != kOk) return status;
  if (n < 0) return kBadShape;
  try {
    float result = 0.0f;
    if (n > 0) {
      const float s = *scale;
      dispatch_input(src, in_dtype,
                     [&](const auto* p) { result = cast_linear(p, dst, n, s, f, level); });
    }
    *amax = result;
  } catch (...) {
    return kInternalError;
  }
  return kOk;
}

// Cast a row-major (m, n) src into dst (m, n) and dst_t (n, m), both row-major.
int32_t fp8kit_cast_transpose(const void* src, int32_t in_dtype, uint8_t* dst, uint8_t* dst_t,
                              int64_t m, int64_t n, const float* scale, int32_t fmt_id,
                              int32_t isa, float* amax) {
  using namespace fp8kit_native;
  int32_t level = kIsaScalar;
  Fmt f{};
  const int32_t status = prepare(in_dtype, fmt_id, isa, &level, &f);
  if (status != kOk) return status;
  if (m < 0 || n < 0) return kBadShape;
  try {
    float result = 0.0f;
    if (m > 0 && n > 0) {
      const float s = *scale;
      dispatch_input(src, in_dtype, [&](const auto* p) {
        result = cast_transpose_impl(p, dst, dst_t, m, n, s, f, level);
      });
    }
    *amax = result;
  } catch (...) {
    return kInternalError;
  }
  return kOk;
}

// *amax = max|src| over n contiguous elements, NaN ignored (0 when n == 0 or all NaN).
int32_t fp8kit_amax(const void* src, int32_t in_dtype, int64_t n, int32_t isa, float* amax) {
  using namespace fp8kit_native;
  int32_t level = kIsaScalar;
  Fmt f{};
  const int32_t status = prepare(in_dtype, 0, isa, &level, &f);
  if (status != kOk) return status;
  if (n < 0) return kBadShape;
  try {
    float result = 0.0f;
    if (n > 0) {
      dispatch_input(src, in_dtype, [&](const auto* p) { result = amax_impl(p, n, level); });
    }
    *amax = result;
  } catch (...) {
    return kInternalError;
  }
  return kOk;
}

// dst[i] = float32(src[i]) * (*scale) for n FP8 codes (fmt: 0 float8_e4m3fn, 1 float8_e5m2), one
// float32 multiply (a null scale means 1: x * 1 is x for every decoded value); out_dtype 0 writes
// float32, 1 bfloat16 (the float32 result rounded to nearest even).
int32_t fp8kit_dequant(const uint8_t* src, int32_t fmt_id, void* dst, int32_t out_dtype, int64_t n,
                       const float* scale, int32_t isa) {
  using namespace fp8kit_native;
  int32_t level = kIsaScalar;
  Fmt f{};
  const int32_t status = prepare(kFloat32, fmt_id, isa, &level, &f);
  if (status != kOk) return status;
  if (out_dtype != kFloat32 && out_dtype != kBFloat16) return kBadDtype;
  if (n < 0) return kBadShape;
  try {
    if (n > 0) {
      const float s = scale == nullptr ? 1.0f : *scale;
      if (out_dtype == kFloat32) {
        dequant_impl(src, static_cast<float*>(dst), n, s, fmt_id, level);
      } else {
        dequant_impl(src, static_cast<bf16_t*>(dst), n, s, fmt_id, level);
      }
    }
  } catch (...) {
    return kInternalError;
  }
  return kOk;
}


// max|src| over n contiguous elements, NaN ignored: folded into *amax_fold (max) and/or stored
// to *amax_res, each when not null.
int32_t fp8kit_amax_fused(const void* src, int32_t in_dtype, int64_t n, int32_t isa,
                          float* amax_fold, float* amax_res) {
  float result = 0.0f;
  const int32_t status = fp8kit_amax(src, in_dtype, n, isa, &result);
  if (status != 0) return status;
  if (amax_fold != nullptr && result > *amax_fold) *amax_fold = result;
  if (amax_res != nullptr) *amax_res = result;
  return 0;
}

// The fused cast. src: m * n contiguous elements (row-major (m, n) when dst_t or dbias is
// given). The scale: mode 0 *scale; mode 1 the current scale of src (an amax pass first, then
// the rule with `rule`); mode 2 the current scale when *count == 0, else *scale. Writes dst
// (m, n); dst_t (n, m) when not null; the amax max|src| (NaN ignored) folded into *amax_fold
// (max) and/or stored to *amax_res when not null; *scale_inv = 1 / scale (IEEE division); and,
// when dbias is not null, the n float32 column sums stored as in_dtype.
int32_t fp8kit_cast_fused(const void* src, int32_t in_dtype, int64_t m, int64_t n, int32_t fmt_id,
                          int32_t isa, int32_t mode, const float* scale, const int64_t* count,
                          float numerator, int32_t power2, int32_t fmax_exp, uint32_t fmax_mant,
                          uint8_t* dst, uint8_t* dst_t, float* amax_fold, float* amax_res,
                          float* scale_inv, void* dbias) {
  using namespace fp8kit_native;
  int32_t level = kIsaScalar;
  Fmt f{};
  const int32_t status = prepare(in_dtype, fmt_id, isa, &level, &f);
  if (status != kOk) return status;
  if (m < 0 || n < 0 || mode < 0 || mode > 2) return kBadShape;
  try {
    const int64_t total = m * n;
    const ScaleRule rule{numerator, power2, fmax_exp, fmax_mant, 0};
    float s = 1.0f;
    if (mode == 1 || (mode == 2 && *count == 0)) {
      float a = 0.0f;
      if (total > 0) {
        dispatch_input(src, in_dtype, [&](const auto* p) { a = amax_impl(p, total, level); });
      }
      s = scale_from_amax(a, 1.0f, rule);
    } else {
      s = *scale;
    }
    float result = 0.0f;
    std::vector<float> sums;
    if (dbias != nullptr) sums.assign(static_cast<size_t>(n), 0.0f);
    if (total > 0) {
      dispatch_input(src, in_dtype, [&](const auto* p) {
        if (dbias != nullptr) {
          result = cast_colsum_impl(p, dst, dst_t, sums.data(), m, n, s, f, level);
        } else if (dst_t != nullptr) {
          result = cast_transpose_impl(p, dst, dst_t, m, n, s, f, level);
        } else {
          result = cast_linear(p, dst, total, s, f, level);
        }
      });
    }
    if (dbias != nullptr) store_sums(sums.data(), dbias, in_dtype, n);
    if (amax_fold != nullptr && result > *amax_fold) *amax_fold = result;
    if (amax_res != nullptr) *amax_res = result;
    *scale_inv = 1.0f / s;
  } catch (...) {
    return kInternalError;
  }
  return kOk;
}

// One delayed-scaling update event, in place, on a row-major (L, N) float32 history and the
// (N,) scale / scale_inv (float32) and count (int64). The event's value of column j is
// staging[j] (or hist[0, j] when staging is null), 0 where ran[j] == 0 (ran may be null).
// Columns whose value is 0 are skipped (unchanged, staging kept); the others get the window
// amax (algo 0: max of hist[1..L-1, j] and the value; 1: the value), the roll
// [0, H2, ..., H(L-1), value], count + 1, a new scale at events 1, 1 + interval, ..., and
// nonfinite[j] += 1 (when not null) if the value is +inf. scale_inv = 1 / scale everywhere.
// *infinite (when not null) = the number of columns whose value was +inf.
int32_t fp8kit_delayed_update(float* hist, int64_t L, int64_t N, float* scale, float* scale_inv,
                              int64_t* count, const uint8_t* ran, const float* staging,
                              int64_t* nonfinite, int32_t algo, int64_t interval, float numerator,
                              int32_t power2, int32_t fmax_exp, uint32_t fmax_mant, int32_t margin,
                              int64_t* infinite) {
  using namespace fp8kit_native;
  if (L < 1 || N < 0 || interval < 1) return kBadShape;
  if (algo != 0 && algo != 1) return kBadFormat;
  try {
    const ScaleRule rule{numerator, power2, fmax_exp, fmax_mant, margin};
    const int64_t blocks = (N + kUpdateCols - 1) / kUpdateCols;
    const int64_t grain = std::max<int64_t>(1, kGrain / (L * kUpdateCols));
    std::atomic<int64_t> total{0};
    at::parallel_for(int64_t{0}, blocks, grain, [&](int64_t b_begin, int64_t b_end) {
      int64_t part = 0;
      for (int64_t b = b_begin; b < b_end; ++b) {
        const int64_t j0 = b * kUpdateCols;
        part += update_block(hist, L, N, j0, std::min(kUpdateCols, N - j0), scale, scale_inv,
                             count, ran, staging, nonfinite, algo, interval, rule);
      }
      total += part;
    });
    if (infinite != nullptr) *infinite = total.load();
  } catch (...) {
    return kInternalError;
  }
  return kOk;
}

// The epilogue of a CPU FP8 GEMM whose float32 accumulator acc (m, n) is row-major:
// out = round_out(acc * (*a_scale * *b_scale) + float32(bias)), the scale product one float32
// multiply, the bias (n,) of bias_dtype (-1: no bias) added in float32, out (m, n) row-major of
// out_dtype (it may be acc itself for a float32 output). Dtype ids as in_dtype; isa as
// fp8kit_cast (every loop gives the same bits).
int32_t fp8kit_gemm_epilogue(const float* acc, int64_t m, int64_t n, const float* a_scale,
                             const float* b_scale, const void* bias, int32_t bias_dtype,
                             void* out, int32_t out_dtype, int32_t isa) {
  using namespace fp8kit_native;
  if (m < 0 || n < 0) return kBadShape;
  if (out_dtype < kFloat32 || out_dtype > kFloat16) return kBadDtype;
  if (bias != nullptr && (bias_dtype < kFloat32 || bias_dtype > kFloat16)) return kBadDtype;
  if (isa < kIsaAuto || isa > kIsaAvx512) return kBadIsa;
  if (isa > best_isa()) return kIsaUnavailable;
  const int32_t level = isa == kIsaAuto ? best_isa() : isa;
  try {
    const float s = *a_scale * *b_scale;
    const std::vector<float> b = bias_as_float(bias, bias_dtype, n);
    const float* bp = bias != nullptr ? b.data() : nullptr;
    if (out_dtype == kFloat32) {
      epilogue_impl(acc, m, n, s, bp, static_cast<float*>(out), level);
    } else if (out_dtype == kBFloat16) {
      epilogue_impl(acc, m, n, s, bp, static_cast<bf16_t*>(out), level);
    } else {
      epilogue_impl(acc, m, n, s, bp, static_cast<f16_t*>(out), level);
    }
  } catch (...) {
    return kInternalError;
  }
  return kOk;
}

// out[0..3] = saturated count, flushed count, signal and noise (float64) of the FP8 cast q
// (format q_fmt) of x (n elements of in_dtype), with the cast's scale *scale, dequantization
// factor *scale_inv and the format's largest finite value fmax (see "Error sums of one cast");
// isa as fp8kit_cast (every loop gives the same bits).
int32_t fp8kit_cast_error_sums(const void* x, int32_t in_dtype, const uint8_t* q, int32_t q_fmt,
                               int64_t n, const float* scale, const float* scale_inv, float fmax,
                               int32_t isa, double* out) {
  using namespace fp8kit_native;
  int32_t level = kIsaScalar;
  Fmt unused{};
  const int32_t status = prepare(in_dtype, q_fmt, isa, &level, &unused);
  if (status != kOk) return status;
  if (n < 0) return kBadShape;
  try {
    ErrorSums r;
    dispatch_input(x, in_dtype, [&](auto* src) {
      r = error_sums_impl(src, q, n, *scale, *scale_inv, fmax, q_fmt, level);
    });
    out[0] = static_cast<double>(r.saturated);
    out[1] = static_cast<double>(r.flushed);
    out[2] = r.signal;
    out[3] = r.noise;
  } catch (...) {
    return kInternalError;
  }
  return kOk;
}

// out (m, n) row-major of out_dtype = epilogue(A @ B) for FP8 A (m, k) of format a_fmt and B
// (k, n) of format b_fmt, element strides (a_sm, a_sk) and (b_sk, b_sn), accumulated in float32
// over k in order (see "A small FP8 GEMM in one call"); a_scale, b_scale, bias, bias_dtype and
// out_dtype as fp8kit_gemm_epilogue. Serial: meant for GEMMs of a few million multiply-adds.
int32_t fp8kit_small_gemm(const uint8_t* a, int32_t a_fmt, int64_t a_sm, int64_t a_sk,
                          const uint8_t* b, int32_t b_fmt, int64_t b_sk, int64_t b_sn, int64_t m,
                          int64_t n, int64_t k, const float* a_scale, const float* b_scale,
                          const void* bias, int32_t bias_dtype, void* out, int32_t out_dtype,
                          int32_t isa) {
  using namespace fp8kit_native;
  if (m < 0 || n < 0 || k < 0) return kBadShape;
  if ((a_fmt != 0 && a_fmt != 1) || (b_fmt != 0 && b_fmt != 1)) return kBadFormat;
  if (out_dtype < kFloat32 || out_dtype > kFloat16) return kBadDtype;
  if (bias != nullptr && (bias_dtype < kFloat32 || bias_dtype > kFloat16)) return kBadDtype;
  if (isa < kIsaAuto || isa > kIsaAvx512) return kBadIsa;
  if (isa > best_isa()) return kIsaUnavailable;
  const int32_t level = isa == kIsaAuto ? best_isa() : isa;
  try {
    const float s = *a_scale * *b_scale;
    const std::vector<float> bias_f = bias_as_float(bias, bias_dtype, n);
    const float* bp = bias != nullptr ? bias_f.data() : nullptr;
    const float* la = decode_table(a_fmt);
    const float* lb = decode_table(b_fmt);
    if (out_dtype == kFloat32) {  // accumulate in the output itself
      auto* o = static_cast<float*>(out);
      small_gemm_impl(a, a_sm, a_sk, la, b, b_sk, b_sn, lb, m, n, k, s, bp, o, o, level);
      return kOk;
    }
    std::vector<float> acc(static_cast<size_t>(m * n));
    if (out_dtype == kBFloat16) {
      small_gemm_impl(a, a_sm, a_sk, la, b, b_sk, b_sn, lb, m, n, k, s, bp,
                      static_cast<bf16_t*>(out), acc.data(), level);
    } else {
      small_gemm_impl(a, a_sm, a_sk, la, b, b_sk, b_sn, lb, m, n, k, s, bp,
                      static_cast<f16_t*>(out), acc.data(), level);
    }
  } catch (...) {
    return kInternalError;
  }
  return kOk;
}

}  // extern "C"
