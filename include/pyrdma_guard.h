/* The closing flag of a verbs object is written with the GIL held and read by calls that have
 * released it (busy polls, channel waits); atomic accesses keep the compiler from caching it. */
#ifndef PYRDMA_GUARD_H
#define PYRDMA_GUARD_H

static inline int pyrdma_load_flag(const int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void pyrdma_store_flag(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

#endif
