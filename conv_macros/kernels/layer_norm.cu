// LayerNorm: per-sample statistics over (OH, OW, OC) with per-channel gamma and beta, and the
// backward pass (conv_macros/src/expand/norm.rs on the CPU).
//
// Statistics and the input gradient take one block per sample (the sample's NPIX * OC values
// are contiguous, THREADS-strided over the threads, combined by block_sum's fixed tree); the
// parameter gradients take one block per channel.

constexpr acc_t EPSILON = ACC(EPS);
constexpr int SAMPLE = NPIX * OC; // values per sample

// Mean and 1 / sqrt(biased var + eps) of each of `batch` samples of `z`, in two passes (the
// mean, then squared deviations from it). `forward` passes the state's convolution output;
// `evaluate` the rounded convolution output, normalized in place by norm_affine afterwards.
extern "C" __global__ void __launch_bounds__(THREADS)
ln_stats(int batch, const T* z, acc_t* mean, acc_t* inv_std) {
    const acc_t n = ACC(SAMPLE);
    for (int s = blockIdx.x; s < batch; s += gridDim.x) {
        const T* zs = z + (long long)s * SAMPLE;
        acc_t sum = ACC(0);
        for (int i = threadIdx.x; i < SAMPLE; i += THREADS) {
            sum += to_acc(zs[i]);
        }
        const acc_t m = block_sum(sum) / n;
        acc_t squares = ACC(0);
        for (int i = threadIdx.x; i < SAMPLE; i += THREADS) {
            const acc_t d = to_acc(zs[i]) - m;
            squares += d * d;
        }
        squares = block_sum(squares);
        if (threadIdx.x == 0) {
            mean[s] = m;
            inv_std[s] = ACC(1) / acc_sqrt(squares / n + EPSILON);
        }
    }
}

// The parameter gradients, from `dz` holding the gradient at the pre-activation (BATCH images):
// d_gamma[c] += sum(dz * xhat), d_beta[c] += sum(dz), with xhat = (z - mean) * inv_std of the
// value's sample. As on the CPU each sample's sum is formed first and added to the gradient in
// sample order. Must run before ln_backward, which overwrites `dz`.
extern "C" __global__ void __launch_bounds__(THREADS)
ln_param_grads(const acc_t* dz, const T* z, const acc_t* mean, const acc_t* inv_std,
               acc_t* d_gamma, acc_t* d_beta) {
    for (int c = blockIdx.x; c < OC; c += gridDim.x) {
        acc_t total_gamma = d_gamma[c];
        acc_t total_beta = d_beta[c];
        for (int s = 0; s < BATCH; ++s) {
            const acc_t m = mean[s];
            const acc_t is = inv_std[s];
            acc_t sum_gamma = ACC(0);
            acc_t sum_beta = ACC(0);
            for (int p = threadIdx.x; p < NPIX; p += THREADS) {
                const long long i = (long long)s * SAMPLE + (long long)p * OC + c;
                const acc_t xhat = (to_acc(z[i]) - m) * is;
                sum_gamma += dz[i] * xhat;
                sum_beta += dz[i];
            }
            total_gamma += block_sum(sum_gamma);
            total_beta += block_sum(sum_beta);
        }
        if (threadIdx.x == 0) {
            d_gamma[c] = total_gamma;
            d_beta[c] = total_beta;
        }
    }
}

// The gradient at the convolution output, in place on `dz` (BATCH images). Per sample, with
// g = dz * gamma[c] over its N = NPIX * OC values:
//   dz = inv_std * (g - sum(g) / N - xhat * sum(g * xhat) / N)
extern "C" __global__ void __launch_bounds__(THREADS)
ln_backward(acc_t* dz, const T* z, const acc_t* mean, const acc_t* inv_std, const T* gamma) {
    const acc_t n = ACC(SAMPLE);
    for (int s = blockIdx.x; s < BATCH; s += gridDim.x) {
        const acc_t m = mean[s];
        const acc_t is = inv_std[s];
        acc_t* ds = dz + (long long)s * SAMPLE;
        const T* zs = z + (long long)s * SAMPLE;
        acc_t sum_g = ACC(0);
        acc_t sum_gx = ACC(0);
        for (int i = threadIdx.x; i < SAMPLE; i += THREADS) {
            const acc_t xhat = (to_acc(zs[i]) - m) * is;
            const acc_t g = ds[i] * to_acc(gamma[i % OC]);
            sum_g += g;
            sum_gx += g * xhat;
        }
        const acc_t mean_g = block_sum(sum_g) / n;
        const acc_t mean_gx = block_sum(sum_gx) / n;
        for (int i = threadIdx.x; i < SAMPLE; i += THREADS) {
            const acc_t xhat = (to_acc(zs[i]) - m) * is;
            ds[i] = is * (ds[i] * to_acc(gamma[i % OC]) - mean_g - xhat * mean_gx);
        }
    }
}
