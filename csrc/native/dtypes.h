// Element types and reduce ops shared with aiak_training/common/dtypes.py.
// The numbering follows Horovod's DataType / ReduceOp enums, extended with BOOL and BFLOAT16.
#pragma once
#include <cstdint>
#include <cstring>

namespace aiak {

enum DataType : int {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, INT32 = 4, INT64 = 5,
  FLOAT16 = 6, FLOAT32 = 7, FLOAT64 = 8, BOOL = 9, BFLOAT16 = 10,
};

enum ReduceOp : int { AVERAGE = 0, SUM = 1, ADASUM = 2, MIN = 3, MAX = 4, PRODUCT = 5 };

// IEEE half <-> float, exact in both directions (round-to-nearest-even on the way down).
inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
  }
  if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // rounds to inf
  if (absx < 0x38800000u) {  // subnormal or zero in half
    // Use float arithmetic to round: add a magic number that aligns the ulp.
    float a;
    std::memcpy(&a, &absx, 4);
    a += 0.5f;  // 2^-1: half subnormal ulp is 2^-24, aligned by adding 0.5 (ulp 2^-24)
    uint32_t r;
    std::memcpy(&r, &a, 4);
    return (uint16_t)(sign | (r - 0x3f000000u));
  }
  uint32_t mant_odd = (absx >> 13) & 1;
  absx += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return (uint16_t)(sign | (absx >> 13));
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1);  // round to nearest even
  return (uint16_t)(x >> 16);
}

}  // namespace aiak
