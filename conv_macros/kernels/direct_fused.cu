// The direct forward convolution of a layer without a norm, with the activation in the same
// kernel: one launch per operation and no intermediate buffer. As on the CPU, the activation
// sees the unrounded sum and only its result is rounded to T. Work items: batch * NPIX * OC.

// evaluate: output = f(conv_sum), over `batch` images.
extern "C" __global__ void __launch_bounds__(THREADS)
conv_evaluate(int batch, const T* x, const T* w, const T* bias, T* output) {
    const long long count = (long long)batch * NPIX * OC;
    for (long long i = first_element(); i < count; i += element_stride()) {
        output[i] = from_acc(act_f(conv_sum(i, x, w, bias)));
    }
}

// forward: pre_activation = conv_sum, output = f(conv_sum), over the BATCH images.
extern "C" __global__ void __launch_bounds__(THREADS)
conv_forward_activation(const T* x, const T* w, const T* bias, T* pre_activation, T* output) {
    const long long count = (long long)BATCH * NPIX * OC;
    for (long long i = first_element(); i < count; i += element_stride()) {
        const acc_t sum = conv_sum(i, x, w, bias);
        pre_activation[i] = from_acc(sum);
        output[i] = from_acc(act_f(sum));
    }
}
