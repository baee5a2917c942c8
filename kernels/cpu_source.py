"""The C++ source of the CPU kernels, compiled on first use by `swarm.kernels.cpu` (kept here so it ships as code).

One pass over memory per call: each group of `group_size` elements is loaded once into L1 (converted to
float32 and, for AQ-SGD, differenced against the buffer), reduced to min/max, coded, packed, and for AQ-SGD
the buffer is updated before moving to the next group. The arithmetic is exactly that of
`swarm.kernels.reference` (see its docstring); `-ffp-contract=off` keeps the compiler from fusing it.
The entry points take a range of groups [g0, g1) so Python can split a tensor across threads (ctypes
releases the GIL); the group size must be a multiple of 8, so every group starts on a byte of the stream.
"""

SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the bitstream is packed with little-endian words");

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef _Float16 v8h __attribute__((vector_size(16)));
typedef uint16_t v8s __attribute__((vector_size(16)));

enum { F32 = 0, F16 = 1, BF16 = 2 };
enum { NONFINITE = 1, TOO_LARGE = 2 };

inline uint32_t as_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Element types: load widens to float32 exactly; store rounds to nearest even, as torch's .to(dtype).
template <int DT> struct Elem;
template <> struct Elem<F32> {
  typedef float T;
  static float load(T v) { return v; }
  static T store(float f) { return f; }
};
template <> struct Elem<F16> {
  typedef _Float16 T;
  static float load(T v) { return (float)v; }
  static T store(float f) { return (_Float16)f; }
};
template <> struct Elem<BF16> {
  typedef uint16_t T;
  static float load(T v) { return as_float((uint32_t)v << 16); }
  static T store(float f) {
    uint32_t u = as_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
  }
};

// Eight elements at a time, with the same conversions as Elem. GCC scalarizes _Float16 vector conversions,
// hence the F16C intrinsics (the same IEEE round-to-nearest-even) where the CPU has them.
template <int DT> inline v8f load8(const typename Elem<DT>::T* p) {
  if constexpr (DT == F32) {
    v8f v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else if constexpr (DT == F16) {
#if defined(__F16C__)
    __m128i h;
    std::memcpy(&h, p, sizeof h);
    return (v8f)_mm256_cvtph_ps(h);
#else
    v8h h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v8f);
#endif
  } else {
    v8s h;
    std::memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
  }
}

template <int DT> inline void store8(typename Elem<DT>::T* p, v8f v) {
  if constexpr (DT == F32) {
    std::memcpy(p, &v, sizeof v);
  } else if constexpr (DT == F16) {
#if defined(__F16C__)
    const __m128i h = _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const v8h h = __builtin_convertvector(v, v8h);
#endif
    std::memcpy(p, &h, sizeof h);
  } else {
    v8u u = (v8u)v;
    const v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v8i nan = (v8i)(u & 0x7fffffffu) > 0x7f800000;
    const v8s h = __builtin_convertvector(nan ? (v8u){0x7fc0, 0x7fc0, 0x7fc0, 0x7fc0, 0x7fc0, 0x7fc0, 0x7fc0, 0x7fc0}
                                              : rounded, v8s);
    std::memcpy(p, &h, sizeof h);
  }
}

// Min, max and "any NaN/Inf" of n floats, 8 lanes at a time.
inline int min_max(const float* x, int64_t n, float* lo_out, float* hi_out) {
  const float inf = INFINITY;
  v8f lo = {inf, inf, inf, inf, inf, inf, inf, inf};
  v8f hi = -lo;
  v8i bad = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    v8f v;
    std::memcpy(&v, x + j, sizeof v);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    bad |= (v - v) != 0;  // NaN for NaN and +-Inf
  }
  float l = inf, h = -inf;
  int b = 0;
  for (int k = 0; k < 8; ++k) {
    l = lo[k] < l ? lo[k] : l;
    h = hi[k] > h ? hi[k] : h;
    b |= bad[k];
  }
  for (; j < n; ++j) {
    l = x[j] < l ? x[j] : l;
    h = x[j] > h ? x[j] : h;
    b |= (x[j] - x[j]) != 0;
  }
  *lo_out = l;
  *hi_out = h;
  return b ? NONFINITE : 0;
}

// The stored (min, scale) on the exact grid; the rule is spelled out in swarm.kernels.reference.
inline int grid_params(float lo, float hi, int levels, float* min_out, float* scale_out) {
  float span = hi - lo;
  float mag = std::fmax(std::fmax(std::fabs(lo), std::fabs(hi)), span);
  if (!(mag < 0x1p126f)) return TOO_LARGE;
  if (span == 0.0f) {
    *min_out = lo;
    *scale_out = 0.0f;
    return 0;
  }
  int e = (int)((as_bits(mag) >> 23) & 0xffu) - 127 - 22;
  if (e < -126) e = -126;
  float quantum = as_float((uint32_t)(e + 127) << 23);
  float inverse_quantum = as_float((uint32_t)(127 - e) << 23);
  float k_lo = std::floor(lo * inverse_quantum);
  float k_hi = std::ceil(hi * inverse_quantum);
  int32_t steps = ((int32_t)(k_hi - k_lo) + levels - 1) / levels;
  *min_out = k_lo * quantum;
  *scale_out = (float)steps * quantum;
  return 0;
}

inline uint32_t mix32(uint32_t x) {  // "lowbias32" (C. Wellons): a cheap, well-mixing 32-bit bijection
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Codes of one group: floor((x - min) / scale + u), u = 0.5 (nearest) or uniform in [0, 1) from a hash of
// the element's index keyed by the seed. One lowbias32 round suffices: for a fixed element, u is a bijection of
// a uniformly random key, so it is uniform and independent across seeds; neighbours get unrelated values.
inline void encode(const float* x, int64_t n, float mn, float scale, int levels, int stochastic,
                   uint64_t first, uint32_t k0, uint32_t k1, uint8_t* codes) {
  const float denom = scale > 0.0f ? scale : 1.0f;
  const float top = (float)levels;
  if (stochastic) {
    const uint32_t key = k0 ^ mix32((uint32_t)(first >> 32) ^ k1);
    const uint32_t base = (uint32_t)first;
    for (int64_t j = 0; j < n; ++j) {
      uint32_t h = mix32((base + (uint32_t)j) ^ key);
      float u = (float)(h >> 8) * 0x1p-24f;
      float k = std::floor((x[j] - mn) / denom + u);
      k = k < 0.0f ? 0.0f : k;
      k = k > top ? top : k;
      codes[j] = (uint8_t)(int32_t)k;
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      float k = std::floor((x[j] - mn) / denom + 0.5f);
      k = k < 0.0f ? 0.0f : k;
      k = k > top ? top : k;
      codes[j] = (uint8_t)(int32_t)k;
    }
  }
}

// Codes to the bitstream; codes[n..n+7] must be zero (they pad the last byte). Widths that divide 8 build
// whole bytes in a loop the compiler vectorizes; 3-bit codes go eight to a 3-byte little-endian word.
template <int B> inline void pack(const uint8_t* codes, int64_t n, uint8_t* out) {
  if constexpr (8 % B == 0) {
    constexpr int per_byte = 8 / B;
    const int64_t nbytes = (n * B + 7) / 8;
    for (int64_t i = 0; i < nbytes; ++i) {
      uint32_t byte = 0;
      for (int k = 0; k < per_byte; ++k) byte |= (uint32_t)codes[per_byte * i + k] << (k * B);
      out[i] = (uint8_t)byte;
    }
  } else {
    const int64_t units = (n + 7) / 8;
    for (int64_t u = 0; u + 1 < units; ++u) {
      uint64_t w = 0;
      for (int k = 0; k < 8; ++k) w |= (uint64_t)codes[8 * u + k] << (k * B);
      std::memcpy(out + u * B, &w, B);
    }
    if (units) {
      uint64_t w = 0;
      for (int k = 0; k < 8; ++k) w |= (uint64_t)codes[8 * (units - 1) + k] << (k * B);
      std::memcpy(out + (units - 1) * B, &w, (size_t)((n * B + 7) / 8 - (units - 1) * B));
    }
  }
}

// Eight codes of B bits from their B-byte word (`nbytes` of it present), as float32 lanes.
template <int B> inline v8f decode8(const uint8_t* in, int nbytes) {
  uint64_t w = 0;
  std::memcpy(&w, in, nbytes);
  v8u lanes;
  if (B == 8) {
    const uint32_t lo = (uint32_t)w, hi = (uint32_t)(w >> 32);
    lanes = (v8u){lo, lo, lo, lo, hi, hi, hi, hi} >> (v8u){0, 8, 16, 24, 0, 8, 16, 24};
  } else {
    const uint32_t v = (uint32_t)w;
    lanes = (v8u){v, v, v, v, v, v, v, v} >> (v8u){0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B};
  }
  return __builtin_convertvector((v8i)(lanes & ((1u << B) - 1)), v8f);
}

// out[j] = mn + code_j * scale (exact, see the reference), or m[j] <- (m[j] + that).to(m.dtype) when ADD.
// SYM (the symmetric quantizer): out[j] = (code_j - mn) * scale, with mn = 2^(bits-1) and scale = the step.
template <int B, int DT, bool ADD, bool SYM = false>
inline void decode_group(const uint8_t* in, int64_t n, float mn, float scale, typename Elem<DT>::T* out) {
  const v8f vmn = {mn, mn, mn, mn, mn, mn, mn, mn};
  const v8f vscale = {scale, scale, scale, scale, scale, scale, scale, scale};
  const int64_t units = n / 8;
  for (int64_t u = 0; u < units; ++u) {
    v8f v = SYM ? (decode8<B>(in + u * B, B) - vmn) * vscale : vmn + decode8<B>(in + u * B, B) * vscale;
    if (ADD) v = load8<DT>(out + 8 * u) + v;
    store8<DT>(out + 8 * u, v);
  }
  const int64_t rest = n - units * 8;
  if (rest) {
    const v8f c = decode8<B>(in + units * B, (int)((rest * B + 7) / 8));
    const v8f v = SYM ? (c - vmn) * vscale : vmn + c * vscale;
    for (int64_t k = 0; k < rest; ++k) {
      typename Elem<DT>::T* o = out + 8 * units + k;
      *o = Elem<DT>::store(ADD ? Elem<DT>::load(*o) + v[k] : v[k]);
    }
  }
}

template <int DT, bool ADD, bool SYM = false>
inline void decode_bits(int bits, const uint8_t* in, int64_t n, float mn, float scale, typename Elem<DT>::T* out) {
  switch (bits) {
    case 2: decode_group<2, DT, ADD, SYM>(in, n, mn, scale, out); break;
    case 3: decode_group<3, DT, ADD, SYM>(in, n, mn, scale, out); break;
    case 4: decode_group<4, DT, ADD, SYM>(in, n, mn, scale, out); break;
    default: decode_group<8, DT, ADD, SYM>(in, n, mn, scale, out); break;
  }
}

inline void pack_bits(int bits, const uint8_t* codes, int64_t n, uint8_t* out) {
  switch (bits) {
    case 2: pack<2>(codes, n, out); break;
    case 3: pack<3>(codes, n, out); break;
    case 4: pack<4>(codes, n, out); break;
    default: pack<8>(codes, n, out); break;
  }
}

// Status of a range: -1 if every group was fine, else (first bad group << 2) | reason.
inline int64_t failure(int64_t g, int reason) { return (g << 2) | reason; }

// One group of float32 values (already differenced for AQ-SGD): stats, grid, codes, packing.
inline int quantize_group(const float* x, int64_t n, int bits, int stochastic, uint64_t first, uint32_t k0,
                          uint32_t k1, uint8_t* codes, uint8_t* packed, float* scale, float* mn) {
  float lo, hi;
  int reason = min_max(x, n, &lo, &hi);
  if (!reason) reason = grid_params(lo, hi, (1 << bits) - 1, mn, scale);
  if (reason) return reason;
  encode(x, n, *mn, *scale, (1 << bits) - 1, stochastic, first, k0, k1, codes);
  std::memset(codes + n, 0, 8);  // the padding of a partial last byte
  pack_bits(bits, codes, n, packed);
  return 0;
}

// Widen (and for AQ-SGD difference) one group to float32: dst[j] = x[j] - y[j] (or x[j] without y).
template <int XDT, int YDT>
inline void widen(const typename Elem<XDT>::T* x, const typename Elem<YDT>::T* y, int64_t n, float* dst) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    v8f v = load8<XDT>(x + j);
    if (y) v -= load8<YDT>(y + j);
    std::memcpy(dst + j, &v, sizeof v);
  }
  for (; j < n; ++j) dst[j] = Elem<XDT>::load(x[j]) - (y ? Elem<YDT>::load(y[j]) : 0.0f);
}

template <int DT>
int64_t quantize_range(const void* x_, int64_t numel, int64_t gs, int64_t g0, int64_t g1, int bits,
                       int stochastic, uint32_t k0, uint32_t k1, uint8_t* packed, float* scales, float* mins) {
  typedef typename Elem<DT>::T T;
  const T* x = static_cast<const T*>(x_);
  std::vector<float> buf(DT == F32 ? 0 : gs);
  std::vector<uint8_t> codes(gs + 8, 0);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t start = g * gs, n = numel - start < gs ? numel - start : gs;
    const float* src;
    if constexpr (DT == F32) {
      src = x + start;
    } else {
      widen<DT, DT>(x + start, nullptr, n, buf.data());
      src = buf.data();
    }
    int reason = quantize_group(src, n, bits, stochastic, (uint64_t)start, k0, k1, codes.data(),
                                packed + start / 8 * bits, scales + g, mins + g);
    if (reason) return failure(g, reason);
  }
  return -1;
}

template <int ADT, int MDT>
int64_t aqsgd_range(const void* a_, void* m_, int64_t numel, int64_t gs, int64_t g0, int64_t g1, int bits,
                    int stochastic, uint32_t k0, uint32_t k1, uint8_t* packed, float* scales, float* mins) {
  const typename Elem<ADT>::T* a = static_cast<const typename Elem<ADT>::T*>(a_);
  typename Elem<MDT>::T* m = static_cast<typename Elem<MDT>::T*>(m_);
  std::vector<float> delta(gs);
  std::vector<uint8_t> codes(gs + 8, 0);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t start = g * gs, n = numel - start < gs ? numel - start : gs;
    widen<ADT, MDT>(a + start, m + start, n, delta.data());
    uint8_t* out = packed + start / 8 * bits;
    int reason = quantize_group(delta.data(), n, bits, stochastic, (uint64_t)start, k0, k1, codes.data(), out,
                                scales + g, mins + g);
    if (reason) return failure(g, reason);
    decode_bits<MDT, true>(bits, out, n, mins[g], scales[g], m + start);  // the receiver's apply_delta, verbatim
  }
  return -1;
}

template <int DT, bool ADD>
void decode_range(const uint8_t* packed, const float* scales, const float* mins, int64_t numel, int64_t gs,
                  int64_t g0, int64_t g1, int bits, void* out_) {
  typename Elem<DT>::T* out = static_cast<typename Elem<DT>::T*>(out_);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t start = g * gs, n = numel - start < gs ? numel - start : gs;
    decode_bits<DT, ADD>(bits, packed + start / 8 * bits, n, mins[g], scales[g], out + start);
  }
}

// The symmetric max-abs quantizer (swarm.kernels.symmetric is the spec): fp16 scale = max |x| rounded, step =
// scale / half, codes clip(round(x / max(step, tiny)), -half, half - 1) + half; noise as `encode` (key fixed).
inline int abs_max(const float* x, int64_t n, float* out) {
  v8f hi = {0, 0, 0, 0, 0, 0, 0, 0};
  v8i bad = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    v8f v;
    std::memcpy(&v, x + j, sizeof v);
    const v8f a = v < 0 ? -v : v;
    hi = a > hi ? a : hi;
    bad |= (v - v) != 0;
  }
  float h = 0.0f;
  int b = 0;
  for (int k = 0; k < 8; ++k) {
    h = hi[k] > h ? hi[k] : h;
    b |= bad[k];
  }
  for (; j < n; ++j) {
    const float a = std::fabs(x[j]);
    h = a > h ? a : h;
    b |= (x[j] - x[j]) != 0;
  }
  *out = h;
  return b ? NONFINITE : 0;
}

inline int sym_quantize_group(const float* x, int64_t n, int bits, int stochastic, uint64_t first, uint32_t key,
                              uint8_t* codes, uint8_t* packed, uint16_t* scale_out, float* step_out) {
  float amax;
  if (abs_max(x, n, &amax)) return NONFINITE;
  const _Float16 scale = (_Float16)(amax < 65504.0f ? amax : 65504.0f);
  std::memcpy(scale_out, &scale, 2);
  const float half = (float)(1 << (bits - 1));
  const float step = (float)scale / half;
  const float d = step > 0x1p-126f ? step : 0x1p-126f;
  const float lo = -half, hi = half - 1.0f;
  if (stochastic) {
    const uint32_t base = (uint32_t)first;
    for (int64_t j = 0; j < n; ++j) {
      const float u = (float)(mix32((base + (uint32_t)j) ^ key) >> 8) * 0x1p-24f;
      float k = std::floor(x[j] / d + u);
      k = k < lo ? lo : k;
      k = k > hi ? hi : k;
      codes[j] = (uint8_t)(int32_t)(k + half);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      float k = __builtin_rintf(x[j] / d);  // half to even, as torch.round
      k = k < lo ? lo : k;
      k = k > hi ? hi : k;
      codes[j] = (uint8_t)(int32_t)(k + half);
    }
  }
  std::memset(codes + n, 0, 8);
  pack_bits(bits, codes, n, packed);
  *step_out = step;
  return 0;
}

template <int ADT, int MDT>
int64_t sym_range(const void* a_, void* m_, int64_t numel, int64_t gs, int64_t g0, int64_t g1, int bits,
                  int stochastic, uint32_t key, uint8_t* packed, uint16_t* scales) {
  const typename Elem<ADT>::T* a = static_cast<const typename Elem<ADT>::T*>(a_);
  typename Elem<MDT>::T* m = static_cast<typename Elem<MDT>::T*>(m_);
  std::vector<float> delta(gs);
  std::vector<uint8_t> codes(gs + 8, 0);
  const float half = (float)(1 << (bits - 1));
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t start = g * gs, n = numel - start < gs ? numel - start : gs;
    widen<ADT, MDT>(a + start, m ? m + start : nullptr, n, delta.data());
    uint8_t* out = packed + start / 8 * bits;
    float step;
    if (sym_quantize_group(delta.data(), n, bits, stochastic, (uint64_t)start, key, codes.data(), out, scales + g,
                           &step))
      return failure(g, NONFINITE);
    if (m) decode_bits<MDT, true, true>(bits, out, n, half, step, m + start);
  }
  return -1;
}

template <int DT, bool ADD>
void sym_decode_range(const uint8_t* packed, const uint16_t* scales, int64_t numel, int64_t gs, int64_t g0,
                      int64_t g1, int bits, void* out_) {
  typename Elem<DT>::T* out = static_cast<typename Elem<DT>::T*>(out_);
  const float half = (float)(1 << (bits - 1));
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t start = g * gs, n = numel - start < gs ? numel - start : gs;
    _Float16 scale;
    std::memcpy(&scale, scales + g, 2);
    decode_bits<DT, ADD, true>(bits, packed + start / 8 * bits, n, half, (float)scale / half, out + start);
  }
}

}  // namespace

#define SWARM_DISPATCH1(dt, call) \
  switch (dt) {                   \
    case F32: call(F32); break;   \
    case F16: call(F16); break;   \
    default: call(BF16); break;   \
  }

extern "C" {

int64_t swarm_quantize(const void* x, int x_dtype, int64_t numel, int64_t gs, int64_t g0, int64_t g1, int bits,
                       int stochastic, uint32_t k0, uint32_t k1, uint8_t* packed, float* scales, float* mins) {
#define CALL(DT) return quantize_range<DT>(x, numel, gs, g0, g1, bits, stochastic, k0, k1, packed, scales, mins)
  SWARM_DISPATCH1(x_dtype, CALL)
#undef CALL
  return -1;
}

int64_t swarm_aqsgd_update(const void* a, int a_dtype, void* m, int m_dtype, int64_t numel, int64_t gs, int64_t g0,
                           int64_t g1, int bits, int stochastic, uint32_t k0, uint32_t k1, uint8_t* packed,
                           float* scales, float* mins) {
#define CALL_M(MDT, ADT) \
  return aqsgd_range<ADT, MDT>(a, m, numel, gs, g0, g1, bits, stochastic, k0, k1, packed, scales, mins)
#define CALL_A(ADT)                         \
  switch (m_dtype) {                        \
    case F32: CALL_M(F32, ADT); break;      \
    case F16: CALL_M(F16, ADT); break;      \
    default: CALL_M(BF16, ADT); break;      \
  }
  SWARM_DISPATCH1(a_dtype, CALL_A)
#undef CALL_A
#undef CALL_M
  return -1;
}

void swarm_dequantize(const uint8_t* packed, const float* scales, const float* mins, int64_t numel, int64_t gs,
                      int64_t g0, int64_t g1, int bits, void* out, int out_dtype) {
#define CALL(DT) decode_range<DT, false>(packed, scales, mins, numel, gs, g0, g1, bits, out)
  SWARM_DISPATCH1(out_dtype, CALL)
#undef CALL
}

void swarm_apply_delta(void* m, int m_dtype, const uint8_t* packed, const float* scales, const float* mins,
                       int64_t numel, int64_t gs, int64_t g0, int64_t g1, int bits) {
#define CALL(DT) decode_range<DT, true>(packed, scales, mins, numel, gs, g0, g1, bits, m)
  SWARM_DISPATCH1(m_dtype, CALL)
#undef CALL
}

// a_dtype/m_dtype as above; m == nullptr quantizes a alone (m_dtype then names a's dtype again).
int64_t swarm_sym_quantize(const void* a, int a_dtype, void* m, int m_dtype, int64_t numel, int64_t gs, int64_t g0,
                           int64_t g1, int bits, int stochastic, uint32_t key, uint8_t* packed, uint16_t* scales) {
#define CALL_M(MDT, ADT) return sym_range<ADT, MDT>(a, m, numel, gs, g0, g1, bits, stochastic, key, packed, scales)
#define CALL_A(ADT)                         \
  switch (m_dtype) {                        \
    case F32: CALL_M(F32, ADT); break;      \
    case F16: CALL_M(F16, ADT); break;      \
    default: CALL_M(BF16, ADT); break;      \
  }
  SWARM_DISPATCH1(a_dtype, CALL_A)
#undef CALL_A
#undef CALL_M
  return -1;
}

void swarm_sym_decode(const uint8_t* packed, const uint16_t* scales, int64_t numel, int64_t gs, int64_t g0,
                      int64_t g1, int bits, void* out, int out_dtype, int add) {
#define CALL(DT) \
  if (add) sym_decode_range<DT, true>(packed, scales, numel, gs, g0, g1, bits, out); \
  else sym_decode_range<DT, false>(packed, scales, numel, gs, g0, g1, bits, out);
  SWARM_DISPATCH1(out_dtype, CALL)
#undef CALL
}

}  // extern "C"
"""
