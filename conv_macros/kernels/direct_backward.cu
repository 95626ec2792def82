// The direct convolution's gradients (see direct.cu for the conventions).

// d_input = the transposed convolution of dz (BATCH images) with w, gathered: each input value
// sums dz[pixel][oc] * w[oc][kh][kw][ic] over the output pixels whose window covered it with
// tap (kh, kw). Overwrites d_input, as the CPU does. Work items: BATCH * IH * IW * IC inputs,
// channel fastest.
extern "C" __global__ void __launch_bounds__(THREADS)
conv_backward_data(const acc_t* dz, const T* w, T* d_input) {
    const long long count = (long long)BATCH * IH * IW * IC;
    for (long long i = first_element(); i < count; i += element_stride()) {
        const int ic = (int)(i % IC);
        const long long pixel = i / IC;
        const int iw = (int)(pixel % IW);
        const int ih = (int)(pixel / IW % IH);
        const long long n = pixel / (IH * IW);
        acc_t sum = ACC(0);
        for (int kh = 0; kh < KH; ++kh) {
            // Tap kh of output row oh reads input row oh * SH - PH + kh.
            const int th = ih + PH - kh;
            if (th < 0 || th % SH != 0 || th / SH >= OH) {
                continue;
            }
            const int oh = th / SH;
            for (int kw = 0; kw < KW; ++kw) {
                const int tw = iw + PW - kw;
                if (tw < 0 || tw % SW != 0 || tw / SW >= OW) {
                    continue;
                }
                const int ow = tw / SW;
                const acc_t* dzp = dz + ((n * OH + oh) * OW + ow) * OC;
                const T* wp = w + (kh * KW + kw) * IC + ic;
                for (int oc = 0; oc < OC; ++oc) {
                    sum += dzp[oc] * to_acc(wp[(long long)oc * WINDOW]);
                }
            }
        }
        d_input[i] = from_acc(sum);
    }
}

// The weight gradient d_w[oc][kh][kw][ic] += sum over the ROWS output pixels of
// x[pixel's input at tap (kh, kw)][ic] * dz[pixel][oc], in two phases like the bias gradient
// (backward.cu), deterministic and spread over the GPU:
//
// 1. conv_backward_weights_partial: WEIGHT_CHUNKS * OC * WINDOW work items; item (k, j), j the
//    OHWI index, sums rows [k * WEIGHT_CHUNK_ROWS, (k + 1) * WEIGHT_CHUNK_ROWS) in row order into
//    partials[k * OC * WINDOW + j]. Neighbouring threads take neighbouring input channels of
//    the same tap and output channel: coalesced input reads, one broadcast dz value.
// 2. conv_backward_weights_finish: one block per weight sums its WEIGHT_CHUNKS partials
//    (block_sum) and adds the total to d_w.
//
// `partials` is the layer's reduction scratch (__CUDA_SCRATCH elements of acc_t).
extern "C" __global__ void __launch_bounds__(THREADS)
conv_backward_weights_partial(const T* x, const acc_t* dz, acc_t* partials) {
    constexpr int LEN = OC * WINDOW;
    for (long long item = first_element(); item < (long long)WEIGHT_CHUNKS * LEN;
         item += element_stride()) {
        const int j = (int)(item % LEN);
        const int k = (int)(item / LEN);
        const int oc = j / WINDOW;
        const int r = j % WINDOW;
        const int ic = r % IC;
        const int kw = r / IC % KW;
        const int kh = r / (IC * KW);
        const int end = min((k + 1) * WEIGHT_CHUNK_ROWS, ROWS);
        acc_t sum = ACC(0);
        for (int q = k * WEIGHT_CHUNK_ROWS; q < end; ++q) {
            const int n = q / NPIX;
            const int p = q % NPIX;
            const int ih = p / OW * SH - PH + kh;
            const int iw = p % OW * SW - PW + kw;
            if (PADDED && (ih < 0 || ih >= IH || iw < 0 || iw >= IW)) {
                continue;
            }
            const long long xi = (((long long)n * IH + ih) * IW + iw) * IC + ic;
            sum += to_acc(x[xi]) * dz[(long long)q * OC + oc];
        }
        partials[item] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
conv_backward_weights_finish(const acc_t* partials, acc_t* d_weights) {
    finish_partials<OC * WINDOW, WEIGHT_CHUNKS>(partials, d_weights);
}
