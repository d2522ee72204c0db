/* threadpool.h: the one pool of worker threads every kernel runs on.
 *
 * OpenMP keeps a separate team of spinning threads for each thread that calls into it; the
 * pipeline calls the kernels from whichever worker thread anyio picks, so teams multiplied
 * and spun against each other (a decode step took 50x longer). This pool is global: any
 * thread may submit, submissions run one at a time, and the caller works as thread 0.
 * Workers spin briefly after a job (decode submits every few microseconds) and then sleep,
 * so they leave the cores to flash reads when compute pauses.
 */
#ifndef LEVER_THREADPOOL_H
#define LEVER_THREADPOOL_H

#include <stdatomic.h>

/* A job: called by the submitter and by each worker that joins in time (at most nth calls in
 * all, with distinct ith < nth). A worker the OS has not scheduled yet must not hold the job
 * up, so jobs claim their work from a shared counter (lever_claim) instead of a fixed share:
 * the submitter alone finishes whatever nobody else took. Who computes a piece never changes
 * its result. */
typedef void (*lever_job_fn)(void *ctx, int ith, int nth);

/* Cores to use when a call asks for n_threads <= 0 (LEVER_NUM_THREADS, else online CPUs). */
int lever_threads_default(void);

/* Runs fn on up to nth = n_threads threads (<= 0: default), capped at the pool's size;
 * returns when every call that started has returned. */
void lever_parallel(lever_job_fn fn, void *ctx, int n_threads);

/* Work items [0, n) handed out `chunk` at a time to whichever thread asks. */
typedef struct {
    atomic_llong next;
    long long n, chunk;
} lever_counter;

static inline void lever_counter_init(lever_counter *c, long long n, long long chunk) {
    atomic_init(&c->next, 0);
    c->n = n;
    c->chunk = chunk > 0 ? chunk : 1;
}

/* Claims the next chunk [*begin, *end); 0 when all are taken. */
static inline int lever_claim(lever_counter *c, long long *begin, long long *end) {
    const long long b = atomic_fetch_add_explicit(&c->next, c->chunk, memory_order_relaxed);
    if (b >= c->n) return 0;
    *begin = b;
    *end = b + c->chunk < c->n ? b + c->chunk : c->n;
    return 1;
}

#endif
