/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A small io_uring ring in plain C: a fixed number of request slots, each a
 * whole-buffer read or write.  The completion loop resubmits short
 * transfers, EAGAIN and EINTR, so a request finishes only when all of its
 * bytes moved, at EOF (reads), or on error.  The first error is recorded;
 * the ring then drops what the kernel has not seen yet and waits for what it
 * has, so no buffer is given back while the kernel may still use it.
 *
 * Finished requests keep their slot until lc_ring_pop() hands them out, so
 * a caller may keep per-slot state (indexed by slot) until then.
 *
 * Functions return 0 (or a count / slot) on success and -errno on failure.
 * Not thread-safe: one thread at a time.
 */
#ifndef LC_RING_H
#define LC_RING_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define LC_RING_MAX_DEPTH 256
#define LC_RING_MAX_XFER (1U << 30) /* one SQE moves at most 1 GiB */

struct io_uring_sqe;
struct io_uring_cqe;

enum lc_req_state {
	LC_REQ_FREE = 0,
	LC_REQ_BUSY,	/* placed in the SQ or in flight */
	LC_REQ_DONE,	/* finished, waiting for lc_ring_pop() */
};

struct lc_req {
	char *addr;		/* next byte to move */
	size_t left;		/* bytes still to move */
	size_t moved;		/* bytes moved so far */
	uint64_t off;		/* file offset of addr */
	uintptr_t cookie;	/* the caller's, untouched */
	int fd;
	int is_write;
	int buf_index;		/* registered buffer index, or -1 */
	int res;		/* once done: 0 or -errno */
	enum lc_req_state state;
};

/* One finished request, as lc_ring_pop() hands it out. */
struct lc_done {
	unsigned int slot;
	int res;		/* 0 or -errno; -ECANCELED: dropped */
	size_t bytes;		/* moved; fewer than asked: EOF (reads) */
	uintptr_t cookie;
};

struct lc_ring {
	int fd;			/* io_uring fd, -1 when closed */
	unsigned int depth;
	unsigned int *sq_head, *sq_tail, *sq_mask, *sq_array;
	unsigned int *cq_head, *cq_tail, *cq_mask;
	struct io_uring_sqe *sqes;
	struct io_uring_cqe *cqes;
	void *sq_ptr, *cq_ptr;
	size_t sq_sz, cq_sz, sqes_sz;
	struct lc_req *reqs;	/* depth slots */
	unsigned int *done;	/* FIFO of finished slots, depth entries */
	unsigned int done_head;	/* oldest entry */
	unsigned int ndone;	/* entries in the FIFO */
	unsigned int to_submit;	/* SQEs placed, not yet taken by the kernel */
	unsigned int inflight;	/* requests placed or in flight (not done) */
	struct iovec *regs;	/* registered buffers */
	unsigned int nregs;
	int err;		/* first error since cleared: 0 or -errno */
	int err_slot;		/* the slot that failed with err, or -1 */
};

/* Set up a ring of @depth (1..LC_RING_MAX_DEPTH) request slots. */
int lc_ring_init(struct lc_ring *r, unsigned int depth);

/*
 * Wait for every request in flight (recording -ECANCELED), unregister
 * buffers and free the ring.  Unpopped completions are discarded.  Leaves
 * @r closed (fd -1, all counts 0); safe to call again.
 */
void lc_ring_exit(struct lc_ring *r);

/* 0 if this kernel lets us set up an io_uring, else -errno. */
int lc_ring_probe(void);

/* The lowest free slot, or -EBUSY if all are taken. */
int lc_ring_free_slot(const struct lc_ring *r);

/*
 * Queue a read or write of @len bytes at @buf, file offset @off, in @slot
 * (-1: the lowest free one).  A transfer inside a registered buffer uses it.
 * A zero-length request finishes at once.  Returns the slot; -EBUSY if no
 * slot is free (or @slot is taken), -EINVAL for a bad slot, or the recorded
 * error if one is pending (see lc_ring_clear_error()).  Nothing reaches the
 * kernel before lc_ring_wait().
 */
int lc_ring_queue(struct lc_ring *r, int slot, int fd, int is_write,
		  void *buf, size_t len, uint64_t off, uintptr_t cookie);

/*
 * Submit what is queued and wait until at least @want requests (at most
 * those in flight) finished during this call.  On an error, drops what the
 * kernel has not taken, waits for every request in flight and returns the
 * first error (-errno), which stays recorded until lc_ring_clear_error().
 */
int lc_ring_wait(struct lc_ring *r, unsigned int want);

/* lc_ring_wait() for every request in flight. */
int lc_ring_drain(struct lc_ring *r);

/* Take the oldest finished request and free its slot: 1, or 0 if none. */
int lc_ring_pop(struct lc_ring *r, struct lc_done *d);

/* Forget the recorded error, so the ring queues again. */
void lc_ring_clear_error(struct lc_ring *r);

/*
 * Register @n buffers as fixed buffers, replacing any registered (@n == 0
 * only unregisters).  -EBUSY with I/O in flight; the kernel's error (e.g.
 * -ENOMEM under RLIMIT_MEMLOCK) leaves none registered.
 */
int lc_ring_register_buffers(struct lc_ring *r, const struct iovec *iov,
			     unsigned int n);

/* Unregister the fixed buffers: 0, or -EBUSY with I/O in flight. */
int lc_ring_unregister_buffers(struct lc_ring *r);

#endif /* LC_RING_H */
