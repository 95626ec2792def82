// The kernels of `network!` entries that are not layers: pooling, a standalone activation and a
// residual block's sum. The generated block defines the entry's sizes as a layer's (input IH,
// IW, IC; output OH, OW, OC; window KH, KW, SH, SW, PH, PW; BATCH), the element type and
// CONV_ACTIVATION as for a layer, and one of NETWORK_MAX_POOL, NETWORK_AVG_POOL,
// NETWORK_ACTIVATION or NETWORK_RESIDUAL. Every kernel writes its output (no accumulation) and
// sums in a fixed order, as the CPU's generated code does.

#if defined(NETWORK_MAX_POOL) || defined(NETWORK_AVG_POOL)
static_assert(IC == OC, "pooling keeps the channels");

// The window of output pixel (oh, ow) starts at input row oh * SH - PH, column ow * SW - PW.

// forward: y[b][oh][ow][c], over `count` = batch * OH * OW * OC items. Max: the largest value
// of the window's positions inside the image (padding never wins); average: their sum over
// KH * KW (the divisor counts padded positions, PyTorch's default). The last NaN wins a max window.
extern "C" __global__ void __launch_bounds__(THREADS)
pool_forward(long long count, const T* x, T* y) {
    for (long long i = first_element(); i < count; i += element_stride()) {
        const int c = (int)(i % OC);
        long long p = i / OC;
        const int ow = (int)(p % OW);
        p /= OW;
        const int oh = (int)(p % OH);
        const long long b = p / OH;
#if defined(NETWORK_MAX_POOL)
        bool found = false;
#endif
        acc_t value = ACC(0);
        for (int ky = 0; ky < KH; ++ky) {
            const int iy = oh * SH - PH + ky;
            if (iy < 0 || iy >= IH) continue;
            for (int kx = 0; kx < KW; ++kx) {
                const int ix = ow * SW - PW + kx;
                if (ix < 0 || ix >= IW) continue;
                const acc_t v = to_acc(x[((b * IH + iy) * IW + ix) * IC + c]);
#if defined(NETWORK_MAX_POOL)
                // The last NaN wins, as in PyTorch (`val > maxval || isnan(val)`) and the CPU's code.
                if (!found || v > value || v != v) value = v;
                found = true;
#else
                value += v;
#endif
            }
        }
#if defined(NETWORK_AVG_POOL)
        value = value / ACC(KH * KW);
#endif
        y[i] = from_acc(value);
    }
}

#if defined(NETWORK_MAX_POOL)
// Whether input position (iy, ix) is the first maximum, in row-major order, of output pixel
// (oh, ow)'s window over channel c of image b.
__device__ __forceinline__ bool first_maximum(const T* x, long long b, int c, int oh, int ow,
                                              int iy, int ix) {
    bool found = false;
    acc_t best = ACC(0);
    int best_y = 0, best_x = 0;
    for (int ky = 0; ky < KH; ++ky) {
        const int y = oh * SH - PH + ky;
        if (y < 0 || y >= IH) continue;
        for (int kx = 0; kx < KW; ++kx) {
            const int x_ = ow * SW - PW + kx;
            if (x_ < 0 || x_ >= IW) continue;
            const acc_t v = to_acc(x[((b * IH + y) * IW + x_) * IC + c]);
            if (!found || v > best || v != v) {
                best = v;
                best_y = y;
                best_x = x_;
            }
            found = true;
        }
    }
    return found && best_y == iy && best_x == ix;
}
#endif

// backward: dx[b][iy][ix][c], over `count` = batch * IH * IW * IC items: the sum, over the
// windows holding the position (output rows, then columns, ascending), of dy where the position
// is the window's first maximum (max) or of dy / (KH * KW) (average). Gathered per input
// position, so no two threads write one value.
extern "C" __global__ void __launch_bounds__(THREADS)
pool_backward(long long count, const T* x, const T* dy, T* dx) {
    for (long long i = first_element(); i < count; i += element_stride()) {
        const int c = (int)(i % IC);
        long long p = i / IC;
        const int ix = (int)(p % IW);
        p /= IW;
        const int iy = (int)(p % IH);
        const long long b = p / IH;
        // Windows with oh * SH - PH <= iy < oh * SH - PH + KH, likewise for columns.
        const int oh_lo = iy + PH - KH + 1 > 0 ? (iy + PH - KH + 1 + SH - 1) / SH : 0;
        const int oh_hi = (iy + PH) / SH < OH - 1 ? (iy + PH) / SH : OH - 1;
        const int ow_lo = ix + PW - KW + 1 > 0 ? (ix + PW - KW + 1 + SW - 1) / SW : 0;
        const int ow_hi = (ix + PW) / SW < OW - 1 ? (ix + PW) / SW : OW - 1;
        acc_t sum = ACC(0);
        for (int oh = oh_lo; oh <= oh_hi; ++oh) {
            for (int ow = ow_lo; ow <= ow_hi; ++ow) {
                const acc_t g = to_acc(dy[((b * OH + oh) * OW + ow) * OC + c]);
#if defined(NETWORK_MAX_POOL)
                if (first_maximum(x, b, c, oh, ow, iy, ix)) sum += g;
#else
                (void)x;
                sum += g / ACC(KH * KW);
#endif
            }
        }
        dx[i] = from_acc(sum);
    }
}
#endif

#if defined(NETWORK_ACTIVATION)
// forward: y = f(x), over `count` elements.
extern "C" __global__ void __launch_bounds__(THREADS)
entry_activation_forward(long long count, const T* x, T* y) {
    for (long long i = first_element(); i < count; i += element_stride()) {
        y[i] = from_acc(act_f(to_acc(x[i])));
    }
}

// backward: dx = dy * f'(x), the derivative taken from the stored output y where it can be (as
// a layer's), over `count` elements.
extern "C" __global__ void __launch_bounds__(THREADS)
entry_activation_backward(long long count, const T* x, const T* y, const T* dy, T* dx) {
    for (long long i = first_element(); i < count; i += element_stride()) {
        dx[i] = from_acc(to_acc(dy[i]) * act_df(to_acc(x[i]), to_acc(y[i])));
    }
}
#endif

#if defined(NETWORK_RESIDUAL)
// out = a + b, over `count` elements: the block's output x + f(x), and in the backward pass the
// input gradient d + (f's input gradient).
extern "C" __global__ void __launch_bounds__(THREADS)
residual_add(long long count, const T* a, const T* b, T* out) {
    for (long long i = first_element(); i < count; i += element_stride()) {
        out[i] = from_acc(to_acc(a[i]) + to_acc(b[i]));
    }
}
#endif
