// The forward epilogue of a layer without normalization: the activation applied to the
// convolution's output (with bias) `y`, which the convolution leaves in the accumulator type
// (the direct kernel, or cuDNN; for f32 and f64 layers `y` may be the destination itself).
// As on the CPU, the activation sees the unrounded sum and only its result is rounded to T.

// forward: pre_activation = y, output = f(y), over `count` elements (BATCH * NPIX * OC).
extern "C" __global__ void __launch_bounds__(THREADS)
activation_forward(long long count, const acc_t* y, T* pre_activation, T* output) {
    for (long long i = first_element(); i < count; i += element_stride()) {
        const acc_t v = y[i];
        pre_activation[i] = from_acc(v);
        output[i] = from_acc(act_f(v));
    }
}

// evaluate: output = f(y), over `count` elements (any batch * NPIX * OC).
extern "C" __global__ void __launch_bounds__(THREADS)
activation_evaluate(long long count, const acc_t* y, T* output) {
    for (long long i = first_element(); i < count; i += element_stride()) {
        output[i] = from_acc(act_f(y[i]));
    }
}
