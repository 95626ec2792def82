// BatchNorm: per-channel statistics over (batch, OH, OW), the running-statistics update, the
// folded evaluation, and the backward pass (conv_macros/src/expand/norm.rs on the CPU).
//
// One block per channel: the channel's BATCH * NPIX values are THREADS-strided over the
// threads, each summing its own in row order, then combined by block_sum's fixed tree. Two
// passes as on the CPU: the mean, then the squared deviations from it (no E[x^2] - E[x]^2).

constexpr acc_t EPSILON = ACC(EPS);
constexpr acc_t MOMENTUM_ACC = ACC(MOMENTUM);

// Training statistics of the convolution output `z` (BATCH images): mean and
// 1 / sqrt(biased var + eps) per channel into the forward state, and
// running = (1 - momentum) * running + momentum * batch statistic for mean and biased variance.
extern "C" __global__ void __launch_bounds__(THREADS)
bn_stats_train(const T* z, acc_t* mean, acc_t* inv_std, acc_t* running_mean,
               acc_t* running_var) {
    const acc_t n = ACC(ROWS);
    for (int c = blockIdx.x; c < OC; c += gridDim.x) {
        acc_t sum = ACC(0);
        for (int q = threadIdx.x; q < ROWS; q += THREADS) {
            sum += to_acc(z[(long long)q * OC + c]);
        }
        const acc_t m = block_sum(sum) / n;
        acc_t squares = ACC(0);
        for (int q = threadIdx.x; q < ROWS; q += THREADS) {
            const acc_t d = to_acc(z[(long long)q * OC + c]) - m;
            squares += d * d;
        }
        const acc_t var = block_sum(squares) / n;
        if (threadIdx.x == 0) {
            mean[c] = m;
            inv_std[c] = ACC(1) / acc_sqrt(var + EPSILON);
            running_mean[c] = (ACC(1) - MOMENTUM_ACC) * running_mean[c] + MOMENTUM_ACC * m;
            running_var[c] = (ACC(1) - MOMENTUM_ACC) * running_var[c] + MOMENTUM_ACC * var;
        }
    }
}

// Evaluation-mode statistics for `forward`: the running ones, as mean and inv_std.
extern "C" __global__ void __launch_bounds__(THREADS)
bn_stats_eval(const acc_t* running_mean, const acc_t* running_var, acc_t* mean,
              acc_t* inv_std) {
    for (long long c = first_element(); c < OC; c += element_stride()) {
        mean[c] = running_mean[c];
        inv_std[c] = ACC(1) / acc_sqrt(running_var[c] + EPSILON);
    }
}

// `evaluate`: output = f(y * scale + shift) over `batch` images, with the running statistics
// folded per channel into scale = gamma / sqrt(running_var + eps) and
// shift = beta - scale * running_mean (the CPU's `eval_affine`). `y` is the convolution output
// in the accumulator type, unrounded, as the CPU applies the fold to its tiles.
extern "C" __global__ void __launch_bounds__(THREADS)
bn_evaluate(int batch, const acc_t* y, const T* gamma, const T* beta, const acc_t* running_mean,
            const acc_t* running_var, T* output) {
    const long long count = (long long)batch * NPIX * OC;
    for (long long i = first_element(); i < count; i += element_stride()) {
        const int c = (int)(i % OC);
        const acc_t scale = to_acc(gamma[c]) / acc_sqrt(running_var[c] + EPSILON);
        const acc_t shift = to_acc(beta[c]) - scale * running_mean[c];
        output[i] = from_acc(act_f(y[i] * scale + shift));
    }
}

// Backward through training-mode BatchNorm, in place on `dz` (BATCH images), which holds the
// gradient at the pre-activation (activation_backward's output). With
// xhat = (z - mean) * inv_std over the channel's N = BATCH * NPIX values:
//   d_gamma += sum(dz * xhat), d_beta += sum(dz)    (when the gradients are not null)
//   dz = gamma * inv_std * (dz - sum(dz) / N - xhat * sum(dz * xhat) / N)
extern "C" __global__ void __launch_bounds__(THREADS)
bn_backward_train(acc_t* dz, const T* z, const acc_t* mean, const acc_t* inv_std,
                  const T* gamma, acc_t* d_gamma, acc_t* d_beta) {
    const acc_t n = ACC(ROWS);
    for (int c = blockIdx.x; c < OC; c += gridDim.x) {
        const acc_t m = mean[c];
        const acc_t s = inv_std[c];
        acc_t sum = ACC(0);
        acc_t sum_xhat = ACC(0);
        for (int q = threadIdx.x; q < ROWS; q += THREADS) {
            const long long i = (long long)q * OC + c;
            sum += dz[i];
            sum_xhat += dz[i] * (to_acc(z[i]) - m) * s;
        }
        sum = block_sum(sum);
        sum_xhat = block_sum(sum_xhat);
        if (threadIdx.x == 0 && d_gamma != nullptr) {
            d_gamma[c] += sum_xhat;
            d_beta[c] += sum;
        }
        const acc_t mean_d = sum / n;
        const acc_t mean_dx = sum_xhat / n;
        const acc_t scale = to_acc(gamma[c]) * s;
        for (int q = threadIdx.x; q < ROWS; q += THREADS) {
            const long long i = (long long)q * OC + c;
            const acc_t xhat = (to_acc(z[i]) - m) * s;
            dz[i] = scale * (dz[i] - mean_d - xhat * mean_dx);
        }
    }
}

// Backward through evaluation-mode BatchNorm (the running statistics are constants), in place
// on `dz`: d_gamma += sum(dz * xhat), d_beta += sum(dz) (when not null); dz *= gamma * inv_std.
extern "C" __global__ void __launch_bounds__(THREADS)
bn_backward_eval(acc_t* dz, const T* z, const acc_t* mean, const acc_t* inv_std, const T* gamma,
                 acc_t* d_gamma, acc_t* d_beta) {
    for (int c = blockIdx.x; c < OC; c += gridDim.x) {
        const acc_t m = mean[c];
        const acc_t s = inv_std[c];
        if (d_gamma != nullptr) {
            acc_t sum = ACC(0);
            acc_t sum_xhat = ACC(0);
            for (int q = threadIdx.x; q < ROWS; q += THREADS) {
                const long long i = (long long)q * OC + c;
                sum += dz[i];
                sum_xhat += dz[i] * (to_acc(z[i]) - m) * s;
            }
            sum = block_sum(sum);
            sum_xhat = block_sum(sum_xhat);
            if (threadIdx.x == 0) {
                d_gamma[c] += sum_xhat;
                d_beta[c] += sum;
            }
        }
        const acc_t scale = to_acc(gamma[c]) * s;
        for (int q = threadIdx.x; q < ROWS; q += THREADS) {
            dz[(long long)q * OC + c] *= scale;
        }
    }
}
