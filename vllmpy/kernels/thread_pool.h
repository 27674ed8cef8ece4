/* A persistent worker pool for the decode-path kernels, whose calls are short (10-300 us) and many
 * (~80 a decode step).
 *
 * Why not OpenMP's team: its parallel region ends in a barrier every thread must reach, so on a busy
 * host (2 cores shared with other processes) a worker that is not scheduled stalls the caller for a
 * time slice, at every call: 10x slower layers were measured under load. Here the work is split into
 * chunks that threads claim from one atomic counter; the caller claims chunks too and waits only for
 * chunks another thread has claimed, so a worker that wakes late finds nothing left and costs nothing.
 * Idle workers spin briefly (the next call usually comes within microseconds), then sleep on a
 * condition variable; nothing spins while no kernel runs.
 *
 * Beside OpenMP: libgomp's worker spins for milliseconds after each region (GOMP_SPINCOUNT), so when the
 * calls between two pool jobs include OpenMP regions (the decode attention kernel's), a pool worker spinning
 * next to it makes three busy threads on two cores. The batch-1 row dots stay on OpenMP for that reason
 * (ggml_blocks.c); a decode path moves onto the pool with the regions around it.
 *
 * Job slots: a job's generation g and its next chunk index share one 64-bit counter. A thread claims
 * chunk c of job g by CAS (g, c) -> (g, c + 1); success proves job g+1 was not yet published, and a
 * job's fields live in slot g % 2, which only job g + 2 rewrites, after g + 1 was published: so the
 * fields a successful claimant reads are job g's. Chunks claimed at or past the count are no work.
 * Callers are serialized by a mutex (one job at a time); after fork the child forgets the workers
 * (pthread_atfork) and starts new ones on its first parallel call. */
#ifndef VQ_THREAD_POOL_H
#define VQ_THREAD_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#ifdef __x86_64__
#include <immintrin.h>
#define POOL_RELAX() _mm_pause()
#else
#define POOL_RELAX() ((void)0)
#endif

#define POOL_MAX_THREADS 64
#define POOL_SPIN_NS 200000 /* an idle worker's spin before it sleeps: decode calls come every few us */

typedef void (*pool_task)(void *ctx, int64_t chunk);

typedef struct {
    pool_task fn;
    void *ctx;
    int64_t chunks;
    atomic_int helpers;       /* workers that may join: the caller's thread count less one */
    atomic_int_fast64_t done; /* chunks finished */
} PoolJob;

static struct {
    _Atomic uint64_t counter; /* generation << 32 | next chunk */
    PoolJob slot[2];
    atomic_int sleepers, workers;
    pthread_mutex_t lock, caller;
    pthread_cond_t wake;
    int registered;
} pool = {0, {{0}}, 0, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};

static inline int64_t pool_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim and run chunks of job `gen` until none is left; returns when the counter moved past it. */
static void pool_work(uint32_t gen) {
    uint64_t seen = atomic_load(&pool.counter);
    while ((uint32_t)(seen >> 32) == gen) {
        if (!atomic_compare_exchange_weak(&pool.counter, &seen, seen + 1)) continue; /* seen reloaded */
        PoolJob *job = &pool.slot[gen & 1];
        const int64_t chunk = (int64_t)(uint32_t)seen;
        if (chunk >= job->chunks) return;
        job->fn(job->ctx, chunk);
        atomic_fetch_add(&job->done, 1);
        seen = atomic_load(&pool.counter);
    }
}

static void *pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    uint32_t gen = (uint32_t)(atomic_load(&pool.counter) >> 32);
    for (;;) {
        const int64_t start = pool_now_ns();
        for (int i = 0; (uint32_t)(atomic_load(&pool.counter) >> 32) == gen; i++) {
            POOL_RELAX();
            if ((i & 63) == 63 && pool_now_ns() - start > POOL_SPIN_NS) {
                pthread_mutex_lock(&pool.lock);
                atomic_fetch_add(&pool.sleepers, 1);
                while ((uint32_t)(atomic_load(&pool.counter) >> 32) == gen) pthread_cond_wait(&pool.wake, &pool.lock);
                atomic_fetch_sub(&pool.sleepers, 1);
                pthread_mutex_unlock(&pool.lock);
            }
        }
        gen = (uint32_t)(atomic_load(&pool.counter) >> 32);
        /* a stale read here only decides whether to try: claims are checked against the generation */
        if (id < atomic_load_explicit(&pool.slot[gen & 1].helpers, memory_order_relaxed)) pool_work(gen);
    }
    return 0;
}

static void pool_forget_after_fork(void) {
    pthread_mutex_init(&pool.lock, 0);
    pthread_mutex_init(&pool.caller, 0);
    pthread_cond_init(&pool.wake, 0);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.workers, 0);
}

/* Workers up to threads - 1 (started once, kept); fewer where the system refuses threads. */
static void pool_grow(int threads) {
    if (!pool.registered) {
        pthread_atfork(0, 0, pool_forget_after_fork);
        pool.registered = 1;
    }
    while (atomic_load(&pool.workers) < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)atomic_load(&pool.workers));
        pthread_attr_destroy(&attr);
        if (failed) break;
        atomic_fetch_add(&pool.workers, 1);
    }
}

/* fn(ctx, c) for every c < chunks, on up to `threads` threads (the caller one of them); returns when all
 * are done. Chunks run in any order and on any thread: each must write its own outputs only. */
static void pool_run(int threads, int64_t chunks, pool_task fn, void *ctx) {
    if (threads > POOL_MAX_THREADS) threads = POOL_MAX_THREADS;
    if (threads <= 1 || chunks <= 1) {
        for (int64_t c = 0; c < chunks; c++) fn(ctx, c);
        return;
    }
    pthread_mutex_lock(&pool.caller);
    pool_grow(threads);
    const uint32_t gen = (uint32_t)(atomic_load(&pool.counter) >> 32) + 1;
    PoolJob *job = &pool.slot[gen & 1];
    job->fn = fn, job->ctx = ctx, job->chunks = chunks;
    atomic_store_explicit(&job->helpers, threads - 1, memory_order_relaxed);
    atomic_store(&job->done, 0);
    atomic_store(&pool.counter, (uint64_t)gen << 32); /* publishes the slot */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    pool_work(gen);
    /* Only chunks another thread claimed remain: yield the core to it if it was preempted. */
    for (int i = 0; atomic_load(&job->done) < chunks; i++) {
        POOL_RELAX();
        if (i > 4096) sched_yield();
    }
    pthread_mutex_unlock(&pool.caller);
}

#endif
