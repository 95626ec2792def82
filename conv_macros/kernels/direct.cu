// Direct convolution, for layers whose convolutions cost less than a cuDNN call: forward,
// input gradient and weight gradient. NHWC activations, OHWI weights, zero padding, strides;
// products and sums in the accumulator type, T converted on load.
//
// Each output value is one work item computed by one thread in a fixed order, so there are no
// atomics and the results are the same on every run. The loop bounds are the spec's constants:
// the compiler sees every trip count and drops the border tests of an unpadded layer.
//
// This file holds the forward sum the forward kernels share; the kernels are in
// direct_forward.cu (layers with a norm), direct_fused.cu (without one: the activation in the
// same kernel) and direct_backward.cu (both gradients), each included where the spec uses it.

// bias[oc] + sum over (kh, kw, ic) of x * w for work item `i` (an output value of `x`'s images,
// channel fastest: the threads of a warp share the input pixel and read the weights, a few KB
// and cached, by channel), in the accumulator type and the CPU's order: the bias, then the
// window row by row.
__device__ __forceinline__ acc_t conv_sum(long long i, const T* x, const T* w, const T* bias) {
    const int oc = (int)(i % OC);
    const long long pixel = i / OC;
    const int ow = (int)(pixel % OW);
    const int oh = (int)(pixel / OW % OH);
    const long long n = pixel / NPIX;
    const T* image = x + n * IH * IW * IC;
    const T* filter = w + (long long)oc * WINDOW;
    acc_t sum = to_acc(bias[oc]);
    for (int kh = 0; kh < KH; ++kh) {
        const int ih = oh * SH - PH + kh;
        if (PADDED && (ih < 0 || ih >= IH)) {
            continue;
        }
        for (int kw = 0; kw < KW; ++kw) {
            const int iw = ow * SW - PW + kw;
            if (PADDED && (iw < 0 || iw >= IW)) {
                continue;
            }
            const T* xp = image + (ih * IW + iw) * IC;
            const T* wp = filter + (kh * KW + kw) * IC;
            for (int ic = 0; ic < IC; ++ic) {
                sum += to_acc(xp[ic]) * to_acc(wp[ic]);
            }
        }
    }
    return sum;
}
