// The direct forward convolution of a layer with a norm: the norm's kernels take the sum.

// y = conv_sum, over `batch` images (`forward` and `evaluate`), into the accumulator type.
// Work items: batch * NPIX * OC outputs.
extern "C" __global__ void __launch_bounds__(THREADS)
conv_forward(int batch, const T* x, const T* w, const T* bias, acc_t* y) {
    const long long count = (long long)batch * NPIX * OC;
    for (long long i = first_element(); i < count; i += element_stride()) {
        y[i] = conv_sum(i, x, w, bias);
    }
}
