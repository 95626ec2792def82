// The stand-in's cuda_bf16.h: `__nv_bfloat16` with CUDA's conversions to and from float,
// rounding to nearest even as the GPU's cvt.rn.bf16.f32 does; a NaN becomes the canonical NaN
// 0x7fff.
#pragma once

#include <stdint.h>
#include <string.h>

struct __nv_bfloat16 {
    unsigned short __x;
};
typedef __nv_bfloat16 nv_bfloat16;

__device__ __forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return __nv_bfloat16{0x7fff};
    }
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    return __nv_bfloat16{static_cast<unsigned short>(rounded)};
}

__device__ __forceinline__ float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t x = static_cast<uint32_t>(h.__x) << 16;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}
