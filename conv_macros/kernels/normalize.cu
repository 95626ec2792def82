// The normalization's affine step and activation, once the statistics are known: the CPU's
// `normalize` (forward) and the second half of LayerNorm's `evaluate_norm`.
//
// The statistics are per group: the channel for BatchNorm, the sample for LayerNorm; gamma and
// beta are per channel in both.

// y = gamma[c] * (z - mean[g]) * inv_std[g] + beta[c]; pre_activation = y (when not null, i.e.
// in `forward`), output = f(y); over `batch` images. `output` may be `z` itself (LayerNorm's
// evaluate normalizes the rounded convolution output in place).
extern "C" __global__ void __launch_bounds__(THREADS)
norm_affine(int batch, const T* z, const acc_t* mean, const acc_t* inv_std, const T* gamma,
            const T* beta, T* pre_activation, T* output) {
    const long long count = (long long)batch * NPIX * OC;
    for (long long i = first_element(); i < count; i += element_stride()) {
        const int c = (int)(i % OC);
        const int g = NORM == Norm::BatchNorm ? c : (int)(i / (NPIX * OC));
        const acc_t y = to_acc(gamma[c]) * (to_acc(z[i]) - mean[g]) * inv_std[g] + to_acc(beta[c]);
        if (pre_activation != nullptr) {
            pre_activation[i] = from_acc(y);
        }
        output[i] = from_acc(act_f(y));
    }
}
