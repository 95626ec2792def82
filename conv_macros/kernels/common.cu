// Shared by every kernel of a layer: element and accumulator types, the activation function,
// derived sizes and the deterministic block reduction.
//
// Comes after the generated block, which defines the spec's numbers (BATCH, IH, IW, IC, OH, OW,
// OC, KH, KW, SH, SW, PH, PW, the reduction chunking) as constexpr, and CONV_ELEMENT_*,
// CONV_ACTIVATION and CONV_NORM as macros.
//
// Launch contract, the same for every kernel: blockDim.x == THREADS (1-D), any gridDim.x >= 1.
// Each kernel loops over its work items with a grid stride, and every sum runs in an order fixed
// by the item and THREADS alone, so results never depend on the grid or on scheduling.

constexpr int THREADS = 256;

// Storage type T (tensors, parameters) and accumulator type acc_t (every sum, statistics,
// gradients): f32 for f32 and the half types, f64 for f64, as `Element::Acc` on the CPU.
#if defined(CONV_ELEMENT_F16)
#include <cuda_fp16.h>
typedef __half T;
typedef float acc_t;
__device__ __forceinline__ acc_t to_acc(T v) { return __half2float(v); }
__device__ __forceinline__ T from_acc(acc_t v) { return __float2half_rn(v); }
#elif defined(CONV_ELEMENT_BF16)
#include <cuda_bf16.h>
typedef __nv_bfloat16 T;
typedef float acc_t;
__device__ __forceinline__ acc_t to_acc(T v) { return __bfloat162float(v); }
__device__ __forceinline__ T from_acc(acc_t v) { return __float2bfloat16_rn(v); }
#elif defined(CONV_ELEMENT_F32)
typedef float T;
typedef float acc_t;
__device__ __forceinline__ acc_t to_acc(T v) { return v; }
__device__ __forceinline__ T from_acc(acc_t v) { return v; }
#elif defined(CONV_ELEMENT_F64)
typedef double T;
typedef double acc_t;
__device__ __forceinline__ acc_t to_acc(T v) { return v; }
__device__ __forceinline__ T from_acc(acc_t v) { return v; }
#else
#error "the generated block defines no CONV_ELEMENT_*"
#endif

// The accumulator's math, one overload per accumulator type; the precise library functions
// (no fast-math intrinsics), as the CPU calls f32::tanh and friends.
__device__ __forceinline__ float acc_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double acc_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double acc_sqrt(double x) { return sqrt(x); }
// fmax/fmin return the other operand for a NaN, as Rust's f32::max/min do.
__device__ __forceinline__ float acc_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double acc_max(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float acc_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ double acc_min(double a, double b) { return fmin(a, b); }

// Constants are written as the runtime writes them (`R::from_f64(x)`): the f64 value rounded to
// the accumulator type, so both sides start from the same numbers.
#define ACC(x) static_cast<acc_t>(x)

// The spec's choices, named as in the spec.
enum class Activation { Identity, Relu, Gelu, Tanh, FastTanh, Sigmoid };
enum class Norm { None, BatchNorm, LayerNorm };
constexpr Activation ACTIVATION = Activation::CONV_ACTIVATION;
constexpr Norm NORM = Norm::CONV_NORM;

// Derived sizes.
constexpr int NPIX = OH * OW;             // output pixels per image
constexpr int ROWS = BATCH * NPIX;        // output pixels of the training batch
constexpr int WINDOW = KH * KW * IC;      // weights per output channel (OHWI row)
constexpr bool PADDED = PH > 0 || PW > 0; // whether a window can leave the image

// The activation at the pre-activation x; the formulas of conv_runtime/src/activation.rs,
// operation for operation.
__device__ __forceinline__ acc_t act_f(acc_t x) {
    if constexpr (ACTIVATION == Activation::Identity) {
        return x;
    } else if constexpr (ACTIVATION == Activation::Relu) {
        return x > ACC(0) ? x : ACC(0);
    } else if constexpr (ACTIVATION == Activation::Gelu) {
        // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), PyTorch's approximate="tanh".
        const acc_t t = acc_tanh(ACC(0.7978845608028654) * (x + ACC(0.044715) * x * x * x));
        return ACC(0.5) * x * (ACC(1) + t);
    } else if constexpr (ACTIVATION == Activation::Tanh) {
        return acc_tanh(x);
    } else if constexpr (ACTIVATION == Activation::FastTanh) {
        // rl_tools' rational tanh on [-3, 3].
        const acc_t c = acc_min(acc_max(x, ACC(-3)), ACC(3));
        const acc_t c2 = c * c;
        return c * (ACC(27) + c2) / (ACC(27) + ACC(9) * c2);
    } else {
        return ACC(1) / (ACC(1) + acc_exp(-x));
    }
}

// The derivative the backward pass multiplies by, at the pre-activation x whose stored output
// is y (rounded to T as stored): the activations that have one take it from y, as the CPU's
// `df_given_output` does, so that half-precision layers see the same rounded value.
__device__ __forceinline__ acc_t act_df(acc_t x, acc_t y) {
    if constexpr (ACTIVATION == Activation::Identity) {
        return ACC(1);
    } else if constexpr (ACTIVATION == Activation::Relu) {
        // 0 at 0, PyTorch's convention.
        return x > ACC(0) ? ACC(1) : ACC(0);
    } else if constexpr (ACTIVATION == Activation::Gelu) {
        const acc_t t = acc_tanh(ACC(0.7978845608028654) * (x + ACC(0.044715) * x * x * x));
        const acc_t inner = ACC(0.7978845608028654) * (ACC(1) + ACC(3.0 * 0.044715) * x * x);
        return ACC(0.5) * (ACC(1) + t) + ACC(0.5) * x * (ACC(1) - t * t) * inner;
    } else if constexpr (ACTIVATION == Activation::Tanh || ACTIVATION == Activation::FastTanh) {
        // rl_tools' 1 - f(x)^2 for FastTanh, also outside [-3, 3] where the clamped f is flat.
        return ACC(1) - y * y;
    } else {
        return y * (ACC(1) - y);
    }
}

// Sum of one value per thread over the block, returned to every thread. A fixed binary tree
// over thread indices: the same inputs give the same bits on every run. All threads of the
// block must call it (it synchronizes).
__device__ acc_t block_sum(acc_t value) {
    __shared__ acc_t partial[THREADS];
    partial[threadIdx.x] = value;
    __syncthreads();
    for (int half = THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            partial[threadIdx.x] += partial[threadIdx.x + half];
        }
        __syncthreads();
    }
    const acc_t total = partial[0];
    // The next call overwrites `partial`: every thread must have read the total first.
    __syncthreads();
    return total;
}

// Second phase of a chunked column reduction: grad[j] += sum over the CHUNKS partial sums
// partials[k * LEN + j], one block per j. Chunk k's partials were summed over a fixed row range
// by one thread each (first phase), so the whole reduction has a fixed order.
template <int LEN, int CHUNKS>
__device__ void finish_partials(const acc_t* partials, acc_t* grad) {
    for (int j = blockIdx.x; j < LEN; j += gridDim.x) {
        acc_t sum = ACC(0);
        for (int k = threadIdx.x; k < CHUNKS; k += THREADS) {
            sum += partials[(long long)k * LEN + j];
        }
        sum = block_sum(sum);
        if (threadIdx.x == 0) {
            grad[j] += sum;
        }
    }
}

// The first element index of this thread and the stride of a grid-stride loop over elements.
__device__ __forceinline__ long long first_element() {
    return (long long)blockIdx.x * THREADS + threadIdx.x;
}
__device__ __forceinline__ long long element_stride() {
    return (long long)gridDim.x * THREADS;
}
