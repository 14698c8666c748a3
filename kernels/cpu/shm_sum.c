/* The sum of one fp32 tensor across the tensor-parallel ranks of one host, through a shared-memory segment.
 *
 * Why: torch.distributed's gloo goes through the kernel's loopback, ~400 us a call on the development machines,
 * two calls a layer: three times a whole single-stream step of a 135M model (docs/scaling.md). Here each rank copies
 * its rows into its slot of a shared buffer, raises its flag, waits for every flag, and sums the slots in rank order,
 * so every rank ends with the same bits. Two buffers alternate by generation, so one meeting a call suffices: a rank
 * can only write a buffer again two calls later, after every rank has arrived at the call between, that is, after
 * every rank has finished reading it.
 *
 * Segment layout: `ranks` flags, each an int64 on its own 64-byte line, then buffer 0 and buffer 1, each `ranks`
 * slots of `slot` floats. The caller zeroes it once and hands each rank the same generation sequence 1, 2, ... */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "arch/simd.h"

#define FLAG_STRIDE 8 /* int64s: one cache line a flag, so ranks raising flags do not share a line */
#define SPINS_BEFORE_YIELD 2048 /* a rank without a core of its own must not spin out the one it waits for */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int64_t hp_shm_sum_bytes(int ranks, int64_t slot) {
    return (int64_t)ranks * FLAG_STRIDE * 8 + 2 * (int64_t)ranks * slot * 4;
}

/* x [n] (n <= slot) summed in place across the ranks. Returns 0, or -1 if some rank had not arrived after
 * timeout_s seconds (the caller checks whether its peers live, and calls again with the same generation). */
int hp_shm_sum(char *base, int rank, int ranks, int64_t slot, float *x, int64_t n, int64_t generation,
               double timeout_s) {
    int64_t *flags = (int64_t *)base;
    float *buffer = (float *)(base + (int64_t)ranks * FLAG_STRIDE * 8) + (generation & 1) * (int64_t)ranks * slot;
    if (__atomic_load_n(&flags[rank * FLAG_STRIDE], __ATOMIC_RELAXED) < generation) {  /* not a retry */
        memcpy(buffer + rank * slot, x, (size_t)n * sizeof(float));
        __atomic_store_n(&flags[rank * FLAG_STRIDE], generation, __ATOMIC_RELEASE);
    }
    double deadline = 0;
    for (int r = 0; r < ranks; r++) {
        for (int spins = 0; __atomic_load_n(&flags[r * FLAG_STRIDE], __ATOMIC_ACQUIRE) < generation;) {
            if (++spins < SPINS_BEFORE_YIELD) {
                cpu_relax();
                continue;
            }
            spins = 0;
            sched_yield();
            double t = now_s();
            if (deadline == 0) {
                deadline = t + timeout_s;
            } else if (t > deadline) {
                return -1;
            }
        }
    }
#pragma omp parallel for if (n * ranks > 262144) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float s = buffer[i];
        for (int r = 1; r < ranks; r++) s += buffer[r * slot + i];
        x[i] = s;
    }
    return 0;
}
