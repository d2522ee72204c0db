/* threadpool.c: a global fork-join pool (see threadpool.h for why not OpenMP). */
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#define MAX_THREADS 64
/* ~0.5 ms of pause instructions: longer than the gap between two kernel calls of a decode
 * step, shorter than a flash read, so workers sleep while the pipeline waits on storage. */
#define SPIN_ITERS 20000
#define CLOSED (1 << 20) /* joined at or above this: the job no longer takes workers */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static struct {
    pthread_once_t once;
    pthread_mutex_t submit;  /* one job at a time, from any thread */
    pthread_mutex_t lock;    /* guards sleepers and the wake-up */
    pthread_cond_t wake;
    int n_workers;
    int sleepers;
    atomic_uint_fast64_t generation; /* bumped for each job */
    atomic_int joined;               /* workers that entered the current job (CLOSED: too late) */
    atomic_int done;                 /* of those, the ones that have returned */
    lever_job_fn fn;
    void *ctx;
    int nth;
} g = {.once = PTHREAD_ONCE_INIT, .submit = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
       .wake = PTHREAD_COND_INITIALIZER};

int lever_threads_default(void) {
    const char *env = getenv("LEVER_NUM_THREADS");
    long n = env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    return (int)(n > MAX_THREADS ? MAX_THREADS : n);
}

static uint_fast64_t wait_for_job(uint_fast64_t seen) {
    uint_fast64_t gen;
    for (int spins = 0; (gen = atomic_load_explicit(&g.generation, memory_order_acquire)) == seen;) {
        if (++spins < SPIN_ITERS) {
            cpu_relax();
            continue;
        }
        pthread_mutex_lock(&g.lock);
        g.sleepers++;
        while ((gen = atomic_load_explicit(&g.generation, memory_order_acquire)) == seen)
            pthread_cond_wait(&g.wake, &g.lock);
        g.sleepers--;
        pthread_mutex_unlock(&g.lock);
        break;
    }
    return gen;
}

static void *worker_main(void *arg) {
    (void)arg;
    uint_fast64_t seen = 0;
    for (;;) {
        seen = wait_for_job(seen);
        const int n = atomic_fetch_add_explicit(&g.joined, 1, memory_order_acquire);
        if (n < g.nth - 1) {
            g.fn(g.ctx, n + 1, g.nth);
            atomic_fetch_add_explicit(&g.done, 1, memory_order_release);
        }
    }
    return NULL;
}

static void start_workers(void) {
    const int want = lever_threads_default() - 1;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < want; i++) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker_main, NULL) != 0) break;
        g.n_workers++;
    }
    pthread_attr_destroy(&attr);
}

void lever_parallel(lever_job_fn fn, void *ctx, int n_threads) {
    int nth = n_threads > 0 ? n_threads : lever_threads_default();
    if (nth > 1) {
        pthread_once(&g.once, start_workers);
        if (nth > g.n_workers + 1) nth = g.n_workers + 1;
    }
    if (nth <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&g.submit);
    g.fn = fn;
    g.ctx = ctx;
    g.nth = nth;
    atomic_store_explicit(&g.done, 0, memory_order_relaxed);
    atomic_store_explicit(&g.joined, 0, memory_order_release);
    pthread_mutex_lock(&g.lock); /* a sleeping worker checks the generation under this lock */
    atomic_fetch_add_explicit(&g.generation, 1, memory_order_release);
    if (g.sleepers) pthread_cond_broadcast(&g.wake);
    pthread_mutex_unlock(&g.lock);
    fn(ctx, 0, nth);
    /* Close the job: workers that have not joined yet never will; wait for those that did. */
    int joined = atomic_exchange_explicit(&g.joined, CLOSED, memory_order_acq_rel);
    if (joined > nth - 1) joined = nth - 1;
    while (atomic_load_explicit(&g.done, memory_order_acquire) < joined) cpu_relax();
    pthread_mutex_unlock(&g.submit);
}
