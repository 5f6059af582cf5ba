/* The closing flag of a verbs object is written with the GIL held and read by calls that have
 * released it (busy polls, channel waits); atomic accesses keep the compiler from caching it. */
#ifndef PYRDMA_GUARD_H
#define PYRDMA_GUARD_H

#include <stdint.h>

static inline int pyrdma_load_flag(const int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void pyrdma_store_flag(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
/* A word another process reads (process_vm_readv) after the memory it vouches for: changed before
 * that memory is written again. */
static inline void pyrdma_bump_word(uint64_t *p) { __atomic_fetch_add(p, 1, __ATOMIC_RELEASE); }

#endif
