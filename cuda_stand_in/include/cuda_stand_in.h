// The CUDA dialect of the kernels, for the host compiler: the stand-in NVRTC force-includes this
// header (g++ -include) before every program it compiles.
//
// - `__global__`, `__device__`, `__forceinline__`, `__launch_bounds__` are plain C++;
//   `__shared__` is `static`: one launch of a module runs at a time, its blocks one after
//   another on one OS thread, so a block's threads share one copy, which the next block reuses.
// - `threadIdx`, `blockIdx`, `blockDim`, `gridDim` are variables the scheduler below sets
//   before it runs a thread.
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
#include <string.h>

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
#define __shared__ static

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

// One launch of a module runs at a time (the stand-in serializes them), on one OS thread.
static uint3 cuda_stand_in_thread_idx;
static uint3 cuda_stand_in_block_idx;
static dim3 cuda_stand_in_block_dim;
static dim3 cuda_stand_in_grid_dim;
// Read-only in kernels, as on the GPU.
#define threadIdx (static_cast<const uint3&>(cuda_stand_in_thread_idx))
#define blockIdx (static_cast<const uint3&>(cuda_stand_in_block_idx))
#define blockDim (static_cast<const dim3&>(cuda_stand_in_block_dim))
#define gridDim (static_cast<const dim3&>(cuda_stand_in_grid_dim))

constexpr int warpSize = 32;

namespace cuda_stand_in {
static void barrier();
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
enum Status : int { OK = 0, DIVERGENT_BARRIER = 1, FAULT = 2 };

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
// Each thread runs on a fiber (its own stack) until it returns or reaches a barrier; then the
// fiber switches straight to the fiber of the next thread of the phase. A fiber whose thread
// returned takes the next thread that has not started, so a block without barriers runs on one
// fiber, thread after thread. The switch is a few instructions of assembly (callee-saved
// registers and the floating-point control words): swapcontext's signal-mask system call would
// cost a hundred times more, and the suites run billions of barrier phases.

#if !defined(__x86_64__)
#error "the CUDA stand-in's fibers switch stacks with x86-64 assembly"
#endif

constexpr unsigned int MAX_THREADS = 1024;

enum ThreadState : unsigned char { NOT_STARTED, RUNNING, AT_BARRIER, DONE };

// Saves the calling context on its stack, stores the stack pointer in `*save` and resumes the
// context whose stack pointer is `load`.
extern "C" void cuda_stand_in_switch(void** save, void* load);
asm(R"(
    .text
    .p2align 4
    .hidden cuda_stand_in_switch
    .globl cuda_stand_in_switch
    .type cuda_stand_in_switch, @function
cuda_stand_in_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_stand_in_switch, .-cuda_stand_in_switch
)");

struct Fiber {
    // Where its context is saved while another runs.
    void* sp;
    unsigned int thread;
};

struct Scheduler {
    const Launch* launch;
    unsigned int threads;
    unsigned char state[MAX_THREADS];
    Fiber* fiber_of[MAX_THREADS];
    uint3 index[MAX_THREADS];
    // This phase's order of the threads (permuted schedule), and how far it got.
    unsigned int order[MAX_THREADS];
    unsigned int next;
    unsigned int phase;
    unsigned long long block;
    Fiber fibers[MAX_THREADS];
    unsigned int fibers_made;
    Fiber* idle[MAX_THREADS];
    unsigned int idle_count;
    Fiber* current;
    // The launcher's own context, resumed when a block ends.
    Fiber home;
    unsigned int at_barrier;
    unsigned int done;
    Status result;
    sigjmp_buf fault;
};

// One launch at a time per module: the stand-in serializes them.
static Scheduler scheduler;

// SplitMix64: the permuted schedule's pseudo-random numbers.
static unsigned long long mix(unsigned long long x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void start_phase(Scheduler& s) {
    s.next = 0;
    s.at_barrier = 0;
    if (!s.launch->permuted) {
        return;
    }
    const unsigned int n = s.threads;
    for (unsigned int i = 0; i < n; ++i) {
        s.order[i] = i;
    }
    // Fisher-Yates with a linear congruential generator seeded per launch, block and phase,
    // and a multiply-shift in place of the modulo: cheap, for a fresh order every phase.
    unsigned long long r = mix(s.launch->seed ^ mix(s.block ^ mix(s.phase)));
    for (unsigned int i = n - 1; i > 0; --i) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        const unsigned int j = static_cast<unsigned int>(((r >> 32) * (i + 1)) >> 32);
        const unsigned int t = s.order[i];
        s.order[i] = s.order[j];
        s.order[j] = t;
    }
}

static unsigned int order_at(const Scheduler& s, unsigned int i) {
    return s.launch->permuted ? s.order[i] : i;
}

static void fiber_main();

// A fiber's initial stack, as cuda_stand_in_switch leaves one: the control words, six
// registers, and the address it returns to (fiber_main, entered as if called).
static Fiber* new_fiber(Scheduler& s) {
    Fiber* f = &s.fibers[s.fibers_made];
    const uintptr_t top =
        (reinterpret_cast<uintptr_t>(s.launch->stacks[s.fibers_made]) + s.launch->stack_size) &
        ~static_cast<uintptr_t>(15);
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;
    *--sp = reinterpret_cast<void*>(&fiber_main);
    for (int i = 0; i < 6; ++i) {
        *--sp = nullptr;
    }
    // MXCSR and the x87 control word as a program starts: round to nearest, no traps.
    *--sp = reinterpret_cast<void*>(static_cast<uintptr_t>(0x037f) << 32 | 0x1f80);
    f->sp = sp;
    s.fibers_made += 1;
    return f;
}

// Runs thread `t` on fiber `f` next, switching from `self` (which resumes when something
// switches back to it).
static void run_on(Scheduler& s, Fiber* self, Fiber* f, unsigned int t) {
    s.state[t] = RUNNING;
    s.fiber_of[t] = f;
    f->thread = t;
    s.current = f;
    cuda_stand_in_thread_idx = s.index[t];
    if (f != self) {
        cuda_stand_in_switch(&self->sp, f->sp);
    }
}

// After `self` stopped (its thread at a barrier, or done and idle): runs whatever comes next.
// Returns when `self` is resumed.
__attribute__((noinline)) static void dispatch(Fiber* self) {
    Scheduler& s = scheduler;
    for (;;) {
        while (s.next < s.threads) {
            const unsigned int t = order_at(s, s.next++);
            switch (s.state[t]) {
                case NOT_STARTED: {
                    Fiber* f = s.idle_count > 0 ? s.idle[--s.idle_count] : new_fiber(s);
                    run_on(s, self, f, t);
                    return;
                }
                case AT_BARRIER:
                    run_on(s, self, s.fiber_of[t], t);
                    return;
                default:
                    break;
            }
        }
        if (s.at_barrier == 0 || s.done > 0) {
            // The block is done, or some threads returned while others wait at a barrier
            // they can never pass.
            s.result = s.at_barrier == 0 ? OK : DIVERGENT_BARRIER;
            cuda_stand_in_switch(&self->sp, s.home.sp);
            return;
        }
        s.phase += 1;
        start_phase(s);
    }
}

static void fiber_main() {
    Scheduler& s = scheduler;
    for (;;) {
        Fiber* f = s.current;
        s.launch->kernel->run(s.launch->params);
        s.state[f->thread] = DONE;
        s.done += 1;
        // In the first phase every thread after this one has yet to start: take the next.
        if (s.phase == 0 && s.next < s.threads) {
            const unsigned int t = order_at(s, s.next++);
            run_on(s, f, f, t);
            continue;
        }
        s.idle[s.idle_count++] = f;
        dispatch(f);
    }
}

__attribute__((noinline)) static void barrier() {
    Scheduler& s = scheduler;
    Fiber* f = s.current;
    s.state[f->thread] = AT_BARRIER;
    s.at_barrier += 1;
    dispatch(f);
}

static Status run_block(Scheduler& s, unsigned long long block) {
    for (unsigned int t = 0; t < s.threads; ++t) {
        s.state[t] = NOT_STARTED;
    }
    s.block = block;
    s.phase = 0;
    s.done = 0;
    start_phase(s);
    dispatch(&s.home);
    return s.result;
}

static unsigned long long gcd(unsigned long long a, unsigned long long b) {
    while (b != 0) {
        const unsigned long long t = a % b;
        a = b;
        b = t;
    }
    return a;
}

[[noreturn]] static void land(void* fault) {
    siglongjmp(*static_cast<sigjmp_buf*>(fault), 1);
}

static Status run_blocks(Scheduler& s) {
    const Launch* l = s.launch;
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
    Scheduler& s = scheduler;
    s.launch = l;
    s.threads = l->block[0] * l->block[1] * l->block[2];
    s.fibers_made = 0;
    s.idle_count = 0;
    for (unsigned int t = 0; t < s.threads; ++t) {
        s.index[t] = uint3{t % l->block[0], t / l->block[0] % l->block[1],
                           t / (l->block[0] * l->block[1])};
    }
    cuda_stand_in_block_dim = dim3{l->block[0], l->block[1], l->block[2]};
    cuda_stand_in_grid_dim = dim3{l->grid[0], l->grid[1], l->grid[2]};
    if (sigsetjmp(s.fault, 1) != 0) {
        // A fault: the stand-in's handler left the kernel and jumped here.
        return FAULT;
    }
    l->api->enter_kernel(land, &s.fault);
    const Status status = run_blocks(s);
    l->api->leave_kernel();
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
