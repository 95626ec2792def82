// The start and the end of every backward pass: the gradient through the activation, and the
// bias gradient.

// dz = d_output * f'(pre_activation), f' taken from the stored output where it can be (the
// CPU's `df_given_output`), in the accumulator type, over `count` elements (BATCH * NPIX * OC):
// the CPU's `d_conv` before the norm. Without a norm this is already the gradient at the
// convolution output; with one, bn_backward_* or ln_* continue in place.
extern "C" __global__ void __launch_bounds__(THREADS)
activation_backward(long long count, const T* d_output, const T* pre_activation, const T* output,
                    acc_t* dz) {
    for (long long i = first_element(); i < count; i += element_stride()) {
        dz[i] = to_acc(d_output[i]) * act_df(to_acc(pre_activation[i]), to_acc(output[i]));
    }
}

// The bias gradient d_bias[c] += sum over the ROWS output pixels of dz[pixel][c], in two
// phases so that it spreads over the GPU and stays deterministic (no atomics):
//
// 1. bias_grad_partial: BIAS_CHUNKS * OC work items, item (k, c) sums rows
//    [k * BIAS_CHUNK_ROWS, (k + 1) * BIAS_CHUNK_ROWS) of channel c in row order into
//    partials[k * OC + c]. Neighbouring threads take neighbouring channels, so each row is read
//    coalesced.
// 2. bias_grad_finish: one block per channel sums its BIAS_CHUNKS partials (block_sum) and adds
//    the total to d_bias.
//
// `partials` is the layer's reduction scratch (__CUDA_SCRATCH elements of acc_t).
extern "C" __global__ void __launch_bounds__(THREADS)
bias_grad_partial(const acc_t* dz, acc_t* partials) {
    for (long long item = first_element(); item < (long long)BIAS_CHUNKS * OC;
         item += element_stride()) {
        const int c = (int)(item % OC);
        const int k = (int)(item / OC);
        const int end = min((k + 1) * BIAS_CHUNK_ROWS, ROWS);
        acc_t sum = ACC(0);
        for (int q = k * BIAS_CHUNK_ROWS; q < end; ++q) {
            sum += dz[(long long)q * OC + c];
        }
        partials[item] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
bias_grad_finish(const acc_t* partials, acc_t* d_bias) {
    finish_partials<OC, BIAS_CHUNKS>(partials, d_bias);
}
