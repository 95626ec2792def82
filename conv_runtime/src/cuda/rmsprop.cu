// RMSprop's update on the GPU: the kernels `RmsProp::step_cuda` launches. This text continues
// optim.cu (it uses its rounding helpers, `start`, `finish` and FOR_EACH_ELEMENT), so the two
// are one NVRTC program: OPTIMIZER_SOURCE = concat!(include_str!("optim.cu"),
// include_str!("rmsprop.cu")). As there, each operation is rounded on its own, in the order of
// `RmsProp::step` in conv_runtime/src/optim.rs, so a GPU step equals the CPU step bit for bit.
//
// Arguments: as every optimizer kernel (n, param, grad, master, init_master), then the state:
// `buf` (the momentum buffer, read only for momentum > 0), `v` (the mean of the squared
// gradients) and `mean` (the mean of the gradients, centered only: nullptr otherwise), then the
// scalars, exact in the accumulator type (the host passes the optimizer's own values).

// torch.optim.RMSprop. `weight` = 1 - alpha is the new gradient's weight in both running means;
// the mean follows at::native::lerp, whose formula depends on the weight.
template <typename P, typename A>
__device__ void rmsprop(long long n, P* param, const A* grad, A* master, int init_master, A* buf,
                        A* v, A* mean, double lr_, double alpha_, double eps_, double wd_,
                        double momentum_, int centered) {
    const A lr = (A)lr_, alpha = (A)alpha_, eps = (A)eps_, wd = (A)wd_, momentum = (A)momentum_;
    const A weight = sub((A)1, alpha);
    const bool small_weight = weight < (A)0.5 && weight > (A)-0.5;
    FOR_EACH_ELEMENT(i, n) {
        A x = start(i, param, master, init_master);
        const A g = add(grad[i], mul(wd, x));
        const A vi = add(mul(alpha, v[i]), mul(mul(weight, g), g));
        v[i] = vi;
        A r;
        if (centered) {
            const A m0 = mean[i];
            const A mi = small_weight ? add(m0, mul(weight, sub(g, m0)))
                                      : sub(g, mul(sub(g, m0), sub((A)1, weight)));
            mean[i] = mi;
            r = root(sub(vi, mul(mi, mi)));
        } else {
            r = root(vi);
        }
        const A avg = add(r, eps);
        if (momentum > (A)0) {
            const A b = add(mul(momentum, buf[i]), quot(g, avg));
            buf[i] = b;
            x = sub(x, mul(lr, b));
        } else {
            x = sub(x, mul(lr, quot(g, avg)));
        }
        finish(i, param, master, x);
    }
}

#define RMSPROP(NAME, P, A)                                                                      \
    extern "C" __global__ void rmsprop_##NAME(long long n, P* param, const A* grad, A* master,  \
                                              int init_master, A* buf, A* v, A* mean, double lr, \
                                              double alpha, double eps, double wd,               \
                                              double momentum, int centered) {                   \
        rmsprop<P, A>(n, param, grad, master, init_master, buf, v, mean, lr, alpha, eps, wd,     \
                      momentum, centered);                                                       \
    }

RMSPROP(f64, double, double)
RMSPROP(f32, float, float)
RMSPROP(f16, __half, float)
RMSPROP(bf16, __nv_bfloat16, float)
