// The CUDA dialect of the kernels, for the host compiler: the stand-in NVRTC force-includes this
// header (g++ -include) before every program it compiles.
//
// - `__global__`, `__device__`, `__forceinline__`, `__launch_bounds__` are plain C++;
//   `__shared__` is `static thread_local`: all threads of a block run on one OS thread, one
//   block after another, so a block's threads share one copy, which the next block reuses.
// - `threadIdx`, `blockIdx`, `blockDim`, `gridDim` are per-OS-thread variables that the
//   scheduler below sets before it runs a thread.
// - Each thread of a block runs on its own fiber (its own stack) until it reaches
//   `__syncthreads()` or returns; the barrier releases when every thread of the block has
//   arrived. A block in which some threads returned while others wait at a barrier is an error
//   (the launch fails), never a hang.
// - The kernels' math: the C library's functions, and the `_rn` intrinsics as separately rounded
//   IEEE operations (the stand-in compiles with -ffp-contract=off: no fused multiply-adds).
//
// The end of this file is the launcher the stand-in driver calls (`cuda_stand_in_launch`) and
// the machinery that calls a kernel with cuLaunchKernel's `void** kernelParams`.
#pragma once

#include <math.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <cmath>
#include <type_traits>
#include <utility>

// Bumped whenever the structs shared with the stand-in library change.
#define CUDA_STAND_IN_ABI 1
#define CUDA_STAND_IN_EXPORT extern "C" __attribute__((visibility("default")))

// The NVRTC stand-in preprocesses a program once with CUDA_STAND_IN_SCAN defined, to find its
// `extern "C" __global__` functions with their launch bounds, after macro expansion.
#ifndef CUDA_STAND_IN_SCAN
#define __global__
#define __launch_bounds__(...)
#endif
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __shared__ static thread_local

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

static thread_local uint3 cuda_stand_in_thread_idx;
static thread_local uint3 cuda_stand_in_block_idx;
static thread_local dim3 cuda_stand_in_block_dim;
static thread_local dim3 cuda_stand_in_grid_dim;
// Read-only in kernels, as on the GPU.
#define threadIdx (static_cast<const uint3&>(cuda_stand_in_thread_idx))
#define blockIdx (static_cast<const uint3&>(cuda_stand_in_block_idx))
#define blockDim (static_cast<const dim3&>(cuda_stand_in_block_dim))
#define gridDim (static_cast<const dim3&>(cuda_stand_in_grid_dim))

constexpr int warpSize = 32;

namespace cuda_stand_in {
inline void barrier();
}

inline void __syncthreads() { cuda_stand_in::barrier(); }

// CUDA's integer and floating-point min/max overloads.
__device__ __forceinline__ int min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int max(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
__device__ __forceinline__ unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
__device__ __forceinline__ long long min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ unsigned long long min(unsigned long long a, unsigned long long b) {
    return a < b ? a : b;
}
__device__ __forceinline__ unsigned long long max(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}
__device__ __forceinline__ float min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ float max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double min(double a, double b) { return fmin(a, b); }
__device__ __forceinline__ double max(double a, double b) { return fmax(a, b); }

// Each a single IEEE operation in round-to-nearest-even.
__device__ __forceinline__ float __fadd_rn(float a, float b) { return a + b; }
__device__ __forceinline__ float __fsub_rn(float a, float b) { return a - b; }
__device__ __forceinline__ float __fmul_rn(float a, float b) { return a * b; }
__device__ __forceinline__ float __fdiv_rn(float a, float b) { return a / b; }
__device__ __forceinline__ float __fsqrt_rn(float a) { return sqrtf(a); }
__device__ __forceinline__ double __dadd_rn(double a, double b) { return a + b; }
__device__ __forceinline__ double __dsub_rn(double a, double b) { return a - b; }
__device__ __forceinline__ double __dmul_rn(double a, double b) { return a * b; }
__device__ __forceinline__ double __ddiv_rn(double a, double b) { return a / b; }
__device__ __forceinline__ double __dsqrt_rn(double a) { return sqrt(a); }

namespace cuda_stand_in {

// What the stand-in library offers a module (Rust: exec::Api).
struct Api {
    // Whether `p` lies inside a live device allocation.
    int (*valid_pointer)(const void* p);
    // Around the run of a launch: a fault (SIGSEGV, SIGBUS) in between calls `landing(arg)`.
    void (*enter_kernel)(void (*landing)(void*), void* arg);
    void (*leave_kernel)();
};

// One `extern "C" __global__` function of the module (Rust: exec::KernelEntry).
struct Kernel {
    const char* name;
    // Runs the kernel for the current thread with cuLaunchKernel's parameter array.
    void (*run)(void** params);
    // The index of the first pointer parameter outside every live allocation, or -1.
    int (*check)(void** params, const Api* api);
    // How many parameters the kernel takes.
    unsigned int params;
    // __launch_bounds__'s maximum threads per block, 0 without.
    unsigned int max_threads;
};

// One launch (Rust: exec::Launch).
struct Launch {
    const Kernel* kernel;
    void** params;
    unsigned int grid[3];
    unsigned int block[3];
    // One stack per thread of a block, each `stack_size` bytes above a guard page.
    void* const* stacks;
    size_t stack_size;
    const Api* api;
    // 0: threads in index order and blocks in index order; 1: a fresh pseudo-random order of
    // the threads in every barrier phase, and the blocks in a pseudo-random order, from `seed`.
    unsigned int permuted;
    unsigned long long seed;
};

// cuda_stand_in_launch's results (Rust: exec::launch).
enum Status : int { OK = 0, DIVERGENT_BARRIER = 1, FAULT = 2, NO_MEMORY = 3 };

template <class A>
inline A& argument(void* slot) {
    return *static_cast<A*>(slot);
}

template <class... A, size_t... I>
inline void call_with(void (*f)(A...), void** params, std::index_sequence<I...>) {
    // Each thread gets its own copies of the arguments, as each GPU thread does.
    f(argument<A>(params[I])...);
}

// Calls `f` with cuLaunchKernel's parameters, each read as the type `f` declares.
template <class... A>
inline void call(void (*f)(A...), void** params) {
    call_with(f, params, std::index_sequence_for<A...>{});
}

template <class A>
inline bool valid_argument(void* slot, const Api* api) {
    if constexpr (std::is_pointer<A>::value) {
        const void* p = argument<A>(slot);
        return p == nullptr || api->valid_pointer(p) != 0;
    } else {
        return true;
    }
}

template <class... A, size_t... I>
inline int check_with(void (*)(A...), void** params, const Api* api,
                      std::index_sequence<I...>) {
    int bad = -1;
    ((bad < 0 && !valid_argument<A>(params[I], api) ? (bad = static_cast<int>(I)) : 0), ...);
    return bad;
}

// The first pointer parameter of `f` outside device memory (null is allowed), or -1.
template <class... A>
inline int check(void (*f)(A...), void** params, const Api* api) {
    return check_with(f, params, api, std::index_sequence_for<A...>{});
}

template <class... A>
constexpr unsigned int parameter_count(void (*)(A...)) {
    return sizeof...(A);
}

// ---- The scheduler: a block's threads as fibers on the launching OS thread. ----
//
// ucontext makes each fiber (makecontext, entered once with setcontext); switches between a
// fiber and the scheduler are _setjmp/_longjmp, which skip swapcontext's signal-mask system
// call (twenty times faster, and the suites run millions of barrier phases).

constexpr unsigned int MAX_THREADS = 1024;

enum ThreadState : unsigned char { NOT_STARTED, RUNNING, AT_BARRIER, DONE };

struct Fiber {
    jmp_buf context;
    void* stack;
    unsigned int thread;
    bool started;
};

struct Scheduler {
    const Launch* launch;
    unsigned int threads;
    unsigned char state[MAX_THREADS];
    Fiber* fiber_of[MAX_THREADS];
    // The order in which this phase runs the threads, and how far it got.
    unsigned int order[MAX_THREADS];
    unsigned int next;
    Fiber fibers[MAX_THREADS];
    unsigned int fibers_made;
    Fiber* idle[MAX_THREADS];
    unsigned int idle_count;
    Fiber* current;
    unsigned int at_barrier;
    unsigned int done;
    jmp_buf home;
    sigjmp_buf fault;
};

static thread_local Scheduler* scheduler;

inline void set_thread(const Scheduler* s, unsigned int t) {
    const unsigned int* b = s->launch->block;
    cuda_stand_in_thread_idx = uint3{t % b[0], t / b[0] % b[1], t / (b[0] * b[1])};
}

// SplitMix64: the permuted schedule's pseudo-random numbers.
inline unsigned long long mix(unsigned long long x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

inline void make_order(Scheduler* s, unsigned long long block, unsigned int phase) {
    const unsigned int n = s->threads;
    for (unsigned int i = 0; i < n; ++i) {
        s->order[i] = i;
    }
    if (!s->launch->permuted) {
        return;
    }
    unsigned long long r = mix(s->launch->seed ^ mix(block ^ mix(phase)));
    for (unsigned int i = n - 1; i > 0; --i) {
        r = mix(r);
        const unsigned int j = static_cast<unsigned int>(r % (i + 1));
        const unsigned int t = s->order[i];
        s->order[i] = s->order[j];
        s->order[j] = t;
    }
}

// Back to the scheduler; returns when the scheduler resumes this fiber.
__attribute__((noinline)) inline void yield(Scheduler* s, Fiber* f) {
    if (_setjmp(f->context) == 0) {
        _longjmp(s->home, 1);
    }
}

[[noreturn]] inline void fiber_main() {
    Scheduler* s = scheduler;
    Fiber* f = s->current;
    for (;;) {
        s->launch->kernel->run(s->launch->params);
        s->state[f->thread] = DONE;
        s->done += 1;
        // A thread that returns frees its fiber for the next thread of the phase that has not
        // started: without barriers a block runs on one fiber, one thread after another.
        if (s->next < s->threads && s->state[s->order[s->next]] == NOT_STARTED) {
            const unsigned int t = s->order[s->next++];
            s->state[t] = RUNNING;
            s->fiber_of[t] = f;
            f->thread = t;
            set_thread(s, t);
            continue;
        }
        s->idle[s->idle_count++] = f;
        yield(s, f);
    }
}

__attribute__((noinline)) inline void resume(Scheduler* s, Fiber* f) {
    s->current = f;
    set_thread(s, f->thread);
    if (_setjmp(s->home) == 0) {
        if (!f->started) {
            f->started = true;
            ucontext_t start;
            getcontext(&start);
            start.uc_stack.ss_sp = f->stack;
            start.uc_stack.ss_size = s->launch->stack_size;
            start.uc_link = nullptr;
            makecontext(&start, fiber_main, 0);
            setcontext(&start);
        }
        _longjmp(f->context, 1);
    }
}

__attribute__((noinline)) inline void barrier() {
    Scheduler* s = scheduler;
    Fiber* f = s->current;
    s->state[f->thread] = AT_BARRIER;
    s->at_barrier += 1;
    yield(s, f);
}

inline Fiber* take_fiber(Scheduler* s) {
    if (s->idle_count > 0) {
        return s->idle[--s->idle_count];
    }
    Fiber* f = &s->fibers[s->fibers_made];
    f->stack = s->launch->stacks[s->fibers_made];
    f->started = false;
    s->fibers_made += 1;
    return f;
}

inline Status run_block(Scheduler* s, unsigned long long block) {
    for (unsigned int t = 0; t < s->threads; ++t) {
        s->state[t] = NOT_STARTED;
    }
    s->done = 0;
    for (unsigned int phase = 0;; ++phase) {
        make_order(s, block, phase);
        s->next = 0;
        s->at_barrier = 0;
        while (s->next < s->threads) {
            const unsigned int t = s->order[s->next++];
            const unsigned char state = s->state[t];
            if (state == DONE) {
                continue;
            }
            Fiber* f = state == NOT_STARTED ? take_fiber(s) : s->fiber_of[t];
            f->thread = t;
            s->fiber_of[t] = f;
            s->state[t] = RUNNING;
            resume(s, f);
        }
        if (s->at_barrier == 0) {
            return OK;
        }
        if (s->done > 0) {
            // Some threads returned while others wait at a barrier they can never pass.
            return DIVERGENT_BARRIER;
        }
    }
}

inline unsigned long long gcd(unsigned long long a, unsigned long long b) {
    while (b != 0) {
        const unsigned long long t = a % b;
        a = b;
        b = t;
    }
    return a;
}

[[noreturn]] inline void land(void* fault) { siglongjmp(*static_cast<sigjmp_buf*>(fault), 1); }

inline Status run_blocks(Scheduler* s) {
    const Launch* l = s->launch;
    const unsigned long long gx = l->grid[0], gy = l->grid[1], gz = l->grid[2];
    const unsigned long long blocks = gx * gy * gz;
    // The permuted schedule visits block (a * i + c) mod blocks, a coprime to blocks.
    unsigned long long a = 1, c = 0;
    if (l->permuted && blocks > 1) {
        a = mix(l->seed) % blocks | 1;
        while (gcd(a, blocks) != 1) {
            a += 2;
        }
        c = mix(l->seed + 1) % blocks;
    }
    for (unsigned long long i = 0; i < blocks; ++i) {
        const unsigned long long b =
            static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * i + c) % blocks);
        cuda_stand_in_block_idx = uint3{static_cast<unsigned int>(b % gx),
                                        static_cast<unsigned int>(b / gx % gy),
                                        static_cast<unsigned int>(b / (gx * gy))};
        const Status status = run_block(s, b);
        if (status != OK) {
            return status;
        }
    }
    return OK;
}

}  // namespace cuda_stand_in

// Runs a launch to completion on the calling thread. The stand-in driver has validated the
// geometry (at most MAX_THREADS threads per block) and the pointer parameters.
CUDA_STAND_IN_EXPORT int cuda_stand_in_launch(const cuda_stand_in::Launch* l) {
    using namespace cuda_stand_in;
    Scheduler* const s = static_cast<Scheduler*>(calloc(1, sizeof(Scheduler)));
    if (s == nullptr) {
        return NO_MEMORY;
    }
    s->launch = l;
    s->threads = l->block[0] * l->block[1] * l->block[2];
    cuda_stand_in_block_dim = dim3{l->block[0], l->block[1], l->block[2]};
    cuda_stand_in_grid_dim = dim3{l->grid[0], l->grid[1], l->grid[2]};
    scheduler = s;
    int status;
    if (sigsetjmp(s->fault, 1) == 0) {
        l->api->enter_kernel(land, &s->fault);
        status = run_blocks(s);
        l->api->leave_kernel();
    } else {
        // A fault: the stand-in's handler left the kernel and jumped here.
        status = FAULT;
    }
    scheduler = nullptr;
    free(s);
    return status;
}

CUDA_STAND_IN_EXPORT int cuda_stand_in_abi() { return CUDA_STAND_IN_ABI; }

// `CUDA_STAND_IN_KERNEL(name, bounds)`: the entry of an `extern "C" __global__` function in the
// table the stand-in NVRTC appends to a program.
#define CUDA_STAND_IN_KERNEL(name, bounds)                                                    \
    cuda_stand_in::Kernel {                                                                   \
        #name, [](void** params) { cuda_stand_in::call(name, params); },                      \
            [](void** params, const cuda_stand_in::Api* api) {                                \
                return cuda_stand_in::check(name, params, api);                               \
            },                                                                                \
            cuda_stand_in::parameter_count(name), static_cast<unsigned int>(bounds)           \
    }
