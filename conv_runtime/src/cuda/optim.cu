// Optimizer updates on the GPU, one thread per parameter element (grid-stride), with the
// arithmetic of conv_runtime/src/optim.rs operation for operation. The `_rn` intrinsics round
// each operation on its own (NVRTC would otherwise contract a*b+c into one FMA), so a GPU step
// equals the CPU step bit for bit. Scalars arrive as double and are exact in the accumulator
// type: the host computes them in that type (bias corrections included), as the CPU step does.
//
// Arguments of every kernel: n (long long), the parameters (P*), their gradients (A*), the f32
// master copy (A*, half-precision parameters only, else nullptr) and whether to fill it from the
// parameters first (int), then the optimizer's state buffers (A*) and scalars (below).

#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float quot(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float root(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double quot(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double root(double a) { return __dsqrt_rn(a); }

__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ double widen(double v) { return v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(double* p, double v) { *p = v; }

#define FOR_EACH_ELEMENT(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

// The value the update starts from: the master copy (filled first when asked) or the parameter.
template <typename P, typename A>
__device__ __forceinline__ A start(long long i, const P* param, A* master, int init_master) {
    if (master == nullptr) return widen(param[i]);
    if (init_master) master[i] = widen(param[i]);
    return master[i];
}

template <typename P, typename A>
__device__ __forceinline__ void finish(long long i, P* param, A* master, A x) {
    if (master != nullptr) master[i] = x;
    store(&param[i], x);
}

// torch.optim.SGD: state `buf` (the momentum buffer, unused without momentum).
template <typename P, typename A>
__device__ void sgd(long long n, P* param, const A* grad, A* master, int init_master, A* buf,
                    double lr_, double momentum_, double dampening_, double wd_, int nesterov,
                    int first) {
    const A lr = (A)lr_, momentum = (A)momentum_, dampening = (A)dampening_, wd = (A)wd_;
    FOR_EACH_ELEMENT(i, n) {
        A x = start(i, param, master, init_master);
        A g = add(grad[i], mul(wd, x));
        if (momentum != (A)0) {
            const A b = first ? g : add(mul(momentum, buf[i]), mul(sub((A)1, dampening), g));
            buf[i] = b;
            g = nesterov ? add(g, mul(momentum, b)) : b;
        }
        finish(i, param, master, sub(x, mul(lr, g)));
    }
}

// torch.optim.Adam: state `m`, `v`; `step_size` = lr / (1 - beta1^t) and `correction2_sqrt` =
// sqrt(1 - beta2^t), computed by the host.
template <typename P, typename A>
__device__ void adam(long long n, P* param, const A* grad, A* master, int init_master, A* m,
                     A* v, double step_size_, double beta1_, double beta2_, double eps_,
                     double wd_, double correction2_sqrt_) {
    const A step_size = (A)step_size_, b1 = (A)beta1_, b2 = (A)beta2_, eps = (A)eps_,
            wd = (A)wd_, correction2_sqrt = (A)correction2_sqrt_;
    FOR_EACH_ELEMENT(i, n) {
        A x = start(i, param, master, init_master);
        const A g = add(grad[i], mul(wd, x));
        const A mi = add(mul(b1, m[i]), mul(sub((A)1, b1), g));
        const A vi = add(mul(b2, v[i]), mul(mul(sub((A)1, b2), g), g));
        m[i] = mi;
        v[i] = vi;
        const A denom = add(quot(root(vi), correction2_sqrt), eps);
        finish(i, param, master, sub(x, quot(mul(step_size, mi), denom)));
    }
}

#define OPTIMIZERS(NAME, P, A)                                                                   \
    extern "C" __global__ void sgd_##NAME(long long n, P* param, const A* grad, A* master,      \
                                          int init_master, A* buf, double lr, double momentum,  \
                                          double dampening, double wd, int nesterov, int first) { \
        sgd<P, A>(n, param, grad, master, init_master, buf, lr, momentum, dampening, wd,        \
                  nesterov, first);                                                              \
    }                                                                                            \
    extern "C" __global__ void adam_##NAME(long long n, P* param, const A* grad, A* master,     \
                                           int init_master, A* m, A* v, double step_size,        \
                                           double beta1, double beta2, double eps, double wd,    \
                                           double correction2_sqrt) {                            \
        adam<P, A>(n, param, grad, master, init_master, m, v, step_size, beta1, beta2, eps, wd, \
                   correction2_sqrt);                                                            \
    }

OPTIMIZERS(f64, double, double)
OPTIMIZERS(f32, float, float)
OPTIMIZERS(f16, __half, float)
OPTIMIZERS(bf16, __nv_bfloat16, float)
