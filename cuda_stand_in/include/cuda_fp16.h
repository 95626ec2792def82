// The stand-in's cuda_fp16.h: `__half` with CUDA's conversions to and from float, rounding to
// nearest even as the GPU's cvt.rn.f16.f32 does; a NaN becomes the canonical NaN 0x7fff.
#pragma once

#include <stdint.h>
#include <string.h>

struct __half {
    unsigned short __x;
};
typedef __half half;

__device__ __forceinline__ __half __float2half_rn(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const unsigned short sign = static_cast<unsigned short>((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return __half{0x7fff};
    }
    if (a >= 0x47800000u) {
        // 65536 and above, infinity included (65520 up to it rounds to infinity below).
        return __half{static_cast<unsigned short>(sign | 0x7c00u)};
    }
    if (a >= 0x38800000u) {
        // A normal half: rebias the exponent, round the 13 dropped bits to nearest even.
        const uint32_t r = a - 0x38000000u;
        const uint32_t rounded = (r + 0x0fffu + ((r >> 13) & 1u)) >> 13;
        return __half{static_cast<unsigned short>(sign | rounded)};
    }
    // A subnormal half (or zero): the value in units of 2^-24, rounded to nearest even.
    const uint32_t exponent = a >> 23;
    const uint32_t shift = 126u - exponent;
    if (shift > 24u) {
        return __half{sign};
    }
    const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
    uint32_t q = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (q & 1u))) {
        q += 1;
    }
    return __half{static_cast<unsigned short>(sign | q)};
}

__device__ __forceinline__ float __half2float(__half h) {
    const uint32_t sign = static_cast<uint32_t>(h.__x & 0x8000u) << 16;
    const uint32_t exponent = (h.__x >> 10) & 0x1fu;
    const uint32_t mantissa = h.__x & 0x3ffu;
    uint32_t x;
    if (exponent == 0x1f) {
        x = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent == 0) {
        // Zero or subnormal: mantissa * 2^-24, exact in float.
        float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
        memcpy(&x, &f, sizeof x);
        x |= sign;
    } else {
        x = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}
