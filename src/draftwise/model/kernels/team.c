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

/* Denormal floats flushed to zero (FTZ) and read as zero (DAZ) while a call runs: an attention's
 * softmax over a peaked distribution leaves probabilities below float32's normal range (1.2e-38),
 * and every multiply-add that reads or makes one takes a microcode assist of a hundred cycles or
 * more on x86: a DSpark block's attention over 150 keys of a real drafter ran 8x slower than over
 * random keys. Values that small change no sum they enter. The caller's mode comes back after. */
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
static unsigned fp_enter(void) {
    unsigned m = _mm_getcsr();
    _mm_setcsr(m | 0x8040u); /* FTZ (bit 15) | DAZ (bit 6) */
    return m;
}
static void fp_leave(unsigned m) { _mm_setcsr(m); }
#else
static unsigned fp_enter(void) { return 0; }
static void fp_leave(unsigned m) { (void)m; }
#endif

/* fn(arg) on one OpenMP team of `threads` threads (or on the calling thread alone: one thread or no
 * OpenMP), denormals flushed (fp_enter) on every thread of it; inside a team already, fn(arg) on
 * the calling thread as it is. Returns fn's results, or-ed. */
int dw_team_run(int threads, int (*fn)(void *), void *arg) {
    if (dw_team_nt) return fn(arg);
    int rc = 0;
#ifdef _OPENMP
    if (threads > 1) {
        struct dw_team_bar bar = {0, 0};
#pragma omp parallel num_threads(threads) reduction(| : rc)
        {
            unsigned m = fp_enter();
            dw_team_enter(&bar, omp_get_thread_num(), omp_get_num_threads());
            rc |= fn(arg);
            dw_team_leave();
            fp_leave(m);
        }
        return rc;
    }
#endif
    unsigned m = fp_enter();
    rc = fn(arg);
    fp_leave(m);
    return rc;
}
