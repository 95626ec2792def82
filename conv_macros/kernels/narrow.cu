// Rounding accumulator values to the storage type, for half-precision layers: the convolution's
// output into the state a norm reads (the CPU keeps `conv` in T), LayerNorm's evaluate output
// before it is normalized in place, and cuDNN's f32 input gradient into `d_input`.

// dst = round(src), over `count` elements.
extern "C" __global__ void __launch_bounds__(THREADS)
narrow(long long count, const acc_t* src, T* dst) {
    for (long long i = first_element(); i < count; i += element_stride()) {
        dst[i] = from_acc(src[i]);
    }
}
