// Widening to the accumulator type, for half-precision layers whose convolution runs in cuDNN:
// cuDNN's half-precision convolutions take and produce half tensors, but the layer's gradients
// are f32 (dz, the weight gradient accumulated into f32 gradients). So the input and the
// weights are widened once per call and cuDNN runs in f32 on them: the CPU's arithmetic, which
// also widens both before convolving.

// dst = src exactly, over `count` elements.
extern "C" __global__ void __launch_bounds__(THREADS)
widen(long long count, const T* src, acc_t* dst) {
    for (long long i = first_element(); i < count; i += element_stride()) {
        dst[i] = to_acc(src[i]);
    }
}
