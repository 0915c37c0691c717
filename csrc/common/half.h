// float16 and bfloat16 <-> float32 in portable C++, for every extension in csrc/.
//
// Rounding is to nearest even, bit-identical to torch (c10::Half / F16C's vcvtps2ph and
// c10::BFloat16), subnormals included.  NaN: float16 keeps the sign and the top payload bits
// and sets the quiet bit, as vcvtps2ph does (torch converts with it); bfloat16 NaN becomes
// 0x7FC0, as c10::BFloat16's scalar conversion (torch's vectorised CPU path writes 0xFFFF
// instead: any quiet NaN is a NaN).  The widening conversions are exact.
//
// Everything is static inline.  Translation units built with -mavx2 / -mavx512f include this
// too; with plain `inline` the linker keeps one copy per function for the whole extension,
// and that copy may be the AVX-512 one, which the baseline code would then call on a
// machine without AVX-512.  Static functions stay private to their translation unit.
#pragma once

#include <cstdint>
#include <cstring>

namespace aiak {

static inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    return bits_float(float_bits(float(mant) * 5.9604644775390625e-08f) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (mant << 13));  // inf, NaN
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t float_to_half(float f) {
  uint32_t x = float_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return sign | 0x7E00u | uint16_t((x >> 13) & 0x3FFu);  // NaN
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // inf, or rounds to >= 65520: inf
  if (x < 0x38800000u) {
    // Subnormal (or zero) in half.  Adding 0.5f lines the 2^-24 grid up with the last
    // mantissa bit of the sum, so the FPU's round-to-nearest-even does the rounding.
    return sign | uint16_t(float_bits(bits_float(x) + 0.5f) - 0x3F000000u);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even.
  x += 0xC8000FFFu + ((x >> 13) & 1u);
  return sign | uint16_t(x >> 13);
}

static inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

static inline uint16_t float_to_bf16(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  x += 0x7FFFu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

}  // namespace aiak
