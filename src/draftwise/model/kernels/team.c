/* The decoder's thread team: dw_decoder runs every layer of a call on one OpenMP team, its threads
 * meeting at a spin barrier between ops, instead of a fork and a join of the team per product
 * (about 10 per layer). Where waiting OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE, or a virtual
 * machine whose idle CPUs halt) each fork wakes a sleeping thread: tens of microseconds, a fifth of
 * a 28-layer batch-1 step. Inside a team the products take the calling thread's share of their
 * work (DW_SHARES in kernels.h) and the ops that one thread does (norms, RoPE, the K/V writes) run
 * on thread 0; the shares are the ones the forked loops take, so the bits are the same. */
#include "kernels.h"
#include <sched.h>
#ifdef _OPENMP
#include <omp.h>
#endif

__thread int dw_team_tid, dw_team_nt;
static __thread struct dw_team_bar *team_bar;
static __thread int team_sense;

/* spins before a waiting thread starts yielding its CPU (a thread preempted by other work) */
#define TEAM_SPINS 20000

void dw_team_enter(struct dw_team_bar *bar, int tid, int nt) {
    team_bar = bar;
    team_sense = 0;
    dw_team_tid = tid;
    dw_team_nt = nt;
}

void dw_team_leave(void) { dw_team_tid = dw_team_nt = 0; }

/* Every thread of the team waits here until all have arrived (a sense-reversing barrier); the
 * writes made before it by any thread are visible after it to all. Outside a team: nothing. */
void dw_team_barrier(void) {
    if (dw_team_nt <= 1) return;
    struct dw_team_bar *b = team_bar;
    int s = team_sense = !team_sense;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == dw_team_nt) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, s, __ATOMIC_RELEASE);
        return;
    }
    for (long i = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != s; i++) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if (i > TEAM_SPINS) sched_yield();
    }
}

/* fn(arg) on one OpenMP team of `threads` threads (or on the calling thread alone: one thread, no
 * OpenMP, or already inside a team): fn's results, or-ed. */
int dw_team_run(int threads, int (*fn)(void *), void *arg) {
    int rc = 0;
#ifdef _OPENMP
    if (threads > 1 && !dw_team_nt) {
        struct dw_team_bar bar = {0, 0};
#pragma omp parallel num_threads(threads) reduction(| : rc)
        {
            dw_team_enter(&bar, omp_get_thread_num(), omp_get_num_threads());
            rc |= fn(arg);
            dw_team_leave();
        }
        return rc;
    }
#endif
    return fn(arg);
}
