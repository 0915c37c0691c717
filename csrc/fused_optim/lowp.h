// Scalar bf16/fp16 <-> fp32 conversions, round to nearest even, bit-identical to c10::BFloat16
// / c10::Half and to F16C's vcvtps2ph.  Static inline: every TU gets its own private copy, so
// the copies compiled with AVX flags can never be picked for the baseline TU by the linker.
#pragma once

#include <cstdint>
#include <cstring>

namespace aiak_fo {

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

static inline uint16_t f32_to_bf16(float f) {
  if (f != f) return 0x7FC0;  // quiet NaN, as c10::BFloat16 does
  uint32_t u = f32_bits(f);
  u += ((u >> 16) & 1u) + 0x7FFFu;
  return uint16_t(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24 is exact in fp32
    float mag = float(mant) * 5.9604644775390625e-08f;
    return bits_f32(f32_bits(mag) | sign);
  }
  if (exp == 31) return bits_f32(sign | 0x7F800000u | (mant << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) return sign | (x > 0x7F800000u ? 0x7E00 : 0x7C00);  // NaN / inf
  if (x >= 0x477FF000u) return sign | 0x7C00;  // rounds to >= 65520: overflow to inf
  if (x < 0x38800000u) {
    // Result is subnormal (or zero).  Adding 0.5f lines the 2^-24 grid up with the fp32
    // mantissa's last bit, so the FPU's round-to-nearest-even does the rounding for us.
    volatile float shifted = bits_f32(x) + 0.5f;
    return sign | uint16_t(f32_bits(shifted) - 0x3F000000u);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even.
  const uint32_t odd = (x >> 13) & 1u;
  x += 0xC8000FFFu + odd;
  return sign | uint16_t(x >> 13);
}

}  // namespace aiak_fo
