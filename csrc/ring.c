// SPDX-License-Identifier: Apache-2.0
/*
 * The io_uring ring, driven through raw syscalls.  Each request carries its
 * buffer, offset and remaining length (as in liburing's io_uring-cp
 * example); see ring.h for the contract.
 */
#include "ring.h"
#include "sys.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static void ring_unmap(struct lc_ring *r)
{
	if (r->sqes)
		munmap(r->sqes, r->sqes_sz);
	if (r->cq_ptr && r->cq_ptr != r->sq_ptr)
		munmap(r->cq_ptr, r->cq_sz);
	if (r->sq_ptr)
		munmap(r->sq_ptr, r->sq_sz);
	r->sqes = NULL;
	r->cq_ptr = r->sq_ptr = NULL;
}

static void ring_reset(struct lc_ring *r)
{
	memset(r, 0, sizeof(*r));
	r->fd = -1;
	r->err_slot = -1;
}

static void *map_ring(int fd, size_t sz, uint64_t what)
{
	void *p = mmap(NULL, sz, PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_POPULATE, fd, (off_t)what);

	return p == MAP_FAILED ? NULL : p;
}

int lc_ring_init(struct lc_ring *r, unsigned int depth)
{
	struct io_uring_params p;
	int ret;

	ring_reset(r);
	if (depth < 1 || depth > LC_RING_MAX_DEPTH)
		return -EINVAL;
	r->reqs = calloc(depth, sizeof(*r->reqs));
	r->done = calloc(depth, sizeof(*r->done));
	if (!r->reqs || !r->done) {
		ret = -ENOMEM;
		goto err;
	}
	memset(&p, 0, sizeof(p));
	ret = lc_sys_io_uring_setup(depth, &p);
	if (ret < 0)
		goto err;
	r->fd = ret;
	r->depth = depth;
	r->sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned int);
	r->cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
	if (p.features & IORING_FEAT_SINGLE_MMAP) {
		if (r->cq_sz > r->sq_sz)
			r->sq_sz = r->cq_sz;
		r->cq_sz = r->sq_sz;
	}
	r->sq_ptr = map_ring(r->fd, r->sq_sz, IORING_OFF_SQ_RING);
	if (!r->sq_ptr)
		goto err_errno;
	if (p.features & IORING_FEAT_SINGLE_MMAP) {
		r->cq_ptr = r->sq_ptr;
	} else {
		r->cq_ptr = map_ring(r->fd, r->cq_sz, IORING_OFF_CQ_RING);
		if (!r->cq_ptr)
			goto err_errno;
	}
	r->sqes_sz = p.sq_entries * sizeof(struct io_uring_sqe);
	r->sqes = map_ring(r->fd, r->sqes_sz, IORING_OFF_SQES);
	if (!r->sqes)
		goto err_errno;
	r->sq_head = (unsigned int *)((char *)r->sq_ptr + p.sq_off.head);
	r->sq_tail = (unsigned int *)((char *)r->sq_ptr + p.sq_off.tail);
	r->sq_mask = (unsigned int *)((char *)r->sq_ptr + p.sq_off.ring_mask);
	r->sq_array = (unsigned int *)((char *)r->sq_ptr + p.sq_off.array);
	r->cq_head = (unsigned int *)((char *)r->cq_ptr + p.cq_off.head);
	r->cq_tail = (unsigned int *)((char *)r->cq_ptr + p.cq_off.tail);
	r->cq_mask = (unsigned int *)((char *)r->cq_ptr + p.cq_off.ring_mask);
	r->cqes = (struct io_uring_cqe *)((char *)r->cq_ptr + p.cq_off.cqes);
	return 0;

err_errno:
	ret = -errno;
err:
	ring_unmap(r);
	if (r->fd >= 0)
		close(r->fd);
	free(r->reqs);
	free(r->done);
	ring_reset(r);
	return ret;
}

int lc_ring_probe(void)
{
	struct io_uring_params p;
	int fd;

	memset(&p, 0, sizeof(p));
	fd = lc_sys_io_uring_setup(1, &p);
	if (fd < 0)
		return fd;
	close(fd);
	return 0;
}

/* Place one SQE for slot i; the SQ never holds more than depth entries. */
static void place_sqe(struct lc_ring *r, unsigned int i)
{
	struct lc_req *q = &r->reqs[i];
	unsigned int tail = *r->sq_tail;
	unsigned int idx = tail & *r->sq_mask;
	struct io_uring_sqe *sqe = &r->sqes[idx];
	unsigned int len = q->left > LC_RING_MAX_XFER ? LC_RING_MAX_XFER :
							(unsigned int)q->left;

	memset(sqe, 0, sizeof(*sqe));
	if (q->buf_index >= 0) {
		sqe->opcode = q->is_write ? IORING_OP_WRITE_FIXED :
					    IORING_OP_READ_FIXED;
		sqe->buf_index = (__u16)q->buf_index;
	} else {
		sqe->opcode = q->is_write ? IORING_OP_WRITE : IORING_OP_READ;
	}
	sqe->fd = q->fd;
	sqe->off = q->off;
	sqe->addr = (__u64)(uintptr_t)q->addr;
	sqe->len = len;
	sqe->user_data = i;
	r->sq_array[idx] = idx;
	__atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
	r->to_submit++;
}

/* Slot i finished with res (0 or -errno): queue it for lc_ring_pop(). */
static void finish(struct lc_ring *r, unsigned int i, int res)
{
	struct lc_req *q = &r->reqs[i];
	unsigned int at = r->done_head + r->ndone;

	if (at >= r->depth)
		at -= r->depth;
	q->res = res;
	q->state = LC_REQ_DONE;
	r->done[at] = i;
	r->ndone++;
	r->inflight--;
}

static void note_error(struct lc_ring *r, int err, int slot)
{
	if (r->err)
		return;
	r->err = err;
	r->err_slot = slot;
}

/* Drop the requests placed but not yet taken by the kernel. */
static void drop_unsubmitted(struct lc_ring *r)
{
	unsigned int tail = *r->sq_tail;
	unsigned int k;

	if (!r->to_submit)
		return;
	for (k = tail - r->to_submit; k != tail; k++)
		finish(r, (unsigned int)r->sqes[k & *r->sq_mask].user_data,
		       -ECANCELED);
	/* rewind the tail: the kernel has not seen these entries */
	__atomic_store_n(r->sq_tail, tail - r->to_submit, __ATOMIC_RELEASE);
	r->to_submit = 0;
}

/* Reap CQEs; returns the number of requests that finished. */
static unsigned int reap(struct lc_ring *r)
{
	unsigned int head = *r->cq_head;
	unsigned int tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
	unsigned int finished = 0;

	while (head != tail) {
		struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
		unsigned int i = (unsigned int)cqe->user_data;
		int res = cqe->res;
		struct lc_req *q;
		size_t n;

		head++;
		if (i >= r->depth || r->reqs[i].state != LC_REQ_BUSY)
			continue;
		q = &r->reqs[i];
		if (res == -EAGAIN || res == -EINTR) {
			if (!r->err) {
				place_sqe(r, i);
				continue;
			}
			res = -ECANCELED;
		} else if (res < 0) {
			note_error(r, res, (int)i);
		} else if (res == 0 && q->is_write) {
			res = -EIO; /* no progress */
			note_error(r, res, (int)i);
		} else {
			n = (size_t)res > q->left ? q->left : (size_t)res;
			q->addr += n;
			q->off += n;
			q->left -= n;
			q->moved += n;
			if (n && q->left) {
				if (!r->err) {
					/* short transfer: resubmit the rest */
					place_sqe(r, i);
					continue;
				}
				res = -ECANCELED;
			} else {
				res = 0; /* all moved, or EOF on a read */
			}
		}
		finish(r, i, res);
		finished++;
	}
	__atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
	return finished;
}

int lc_ring_free_slot(const struct lc_ring *r)
{
	unsigned int i;

	for (i = 0; i < r->depth; i++)
		if (r->reqs[i].state == LC_REQ_FREE)
			return (int)i;
	return -EBUSY;
}

static int find_reg(const struct lc_ring *r, const void *addr, size_t len)
{
	uintptr_t a = (uintptr_t)addr;
	unsigned int i;

	for (i = 0; i < r->nregs; i++) {
		uintptr_t b = (uintptr_t)r->regs[i].iov_base;
		size_t sz = r->regs[i].iov_len;

		if (a >= b && len <= sz && a - b <= sz - len)
			return (int)i;
	}
	return -1;
}

int lc_ring_queue(struct lc_ring *r, int slot, int fd, int is_write,
		  void *buf, size_t len, uint64_t off, uintptr_t cookie)
{
	struct lc_req *q;

	if (r->fd < 0)
		return -EBADF;
	if (r->err)
		return r->err;
	if (slot < 0) {
		slot = lc_ring_free_slot(r);
		if (slot < 0)
			return slot;
	} else if ((unsigned int)slot >= r->depth) {
		return -EINVAL;
	}
	q = &r->reqs[slot];
	if (q->state != LC_REQ_FREE)
		return -EBUSY;
	q->addr = buf;
	q->left = len;
	q->moved = 0;
	q->off = off;
	q->cookie = cookie;
	q->fd = fd;
	q->is_write = !!is_write;
	q->buf_index = find_reg(r, buf, len);
	q->res = 0;
	q->state = LC_REQ_BUSY;
	r->inflight++;
	if (!len)
		finish(r, (unsigned int)slot, 0); /* nothing to move */
	else
		place_sqe(r, (unsigned int)slot);
	return slot;
}

int lc_ring_wait(struct lc_ring *r, unsigned int want)
{
	unsigned int got = 0;

	if (r->fd < 0)
		return -EBADF;
	if (want > r->inflight)
		want = r->inflight;
	for (;;) {
		unsigned int min = 0;
		int ret;

		got += reap(r);
		if (r->err)
			drop_unsubmitted(r);
		if (r->err ? r->inflight == 0 :
			     (got >= want && r->to_submit == 0))
			return r->err;
		if (r->err || got < want)
			min = 1;
		ret = lc_sys_io_uring_enter(r->fd, r->to_submit, min,
					    min ? IORING_ENTER_GETEVENTS : 0);
		if (ret < 0) {
			if (ret == -EINTR || ret == -EAGAIN || ret == -EBUSY)
				continue;
			note_error(r, ret, -1);
			/* the kernel took nothing: drop what was placed */
			drop_unsubmitted(r);
			continue;
		}
		r->to_submit -= (unsigned int)ret > r->to_submit ?
					r->to_submit : (unsigned int)ret;
	}
}

int lc_ring_drain(struct lc_ring *r)
{
	return lc_ring_wait(r, r->inflight);
}

int lc_ring_pop(struct lc_ring *r, struct lc_done *d)
{
	struct lc_req *q;
	unsigned int i;

	if (!r->ndone)
		return 0;
	i = r->done[r->done_head];
	if (++r->done_head == r->depth)
		r->done_head = 0;
	r->ndone--;
	q = &r->reqs[i];
	d->slot = i;
	d->res = q->res;
	d->bytes = q->moved;
	d->cookie = q->cookie;
	q->state = LC_REQ_FREE;
	return 1;
}

void lc_ring_clear_error(struct lc_ring *r)
{
	r->err = 0;
	r->err_slot = -1;
}

static void drop_regs(struct lc_ring *r)
{
	if (!r->nregs)
		return;
	lc_sys_io_uring_register(r->fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
	free(r->regs);
	r->regs = NULL;
	r->nregs = 0;
}

int lc_ring_unregister_buffers(struct lc_ring *r)
{
	if (r->inflight)
		return -EBUSY;
	drop_regs(r);
	return 0;
}

int lc_ring_register_buffers(struct lc_ring *r, const struct iovec *iov,
			     unsigned int n)
{
	struct iovec *regs;
	int ret;

	if (r->fd < 0)
		return -EBADF;
	ret = lc_ring_unregister_buffers(r);
	if (ret < 0 || !n)
		return ret;
	regs = malloc(n * sizeof(*regs));
	if (!regs)
		return -ENOMEM;
	memcpy(regs, iov, n * sizeof(*regs));
	ret = lc_sys_io_uring_register(r->fd, IORING_REGISTER_BUFFERS, regs, n);
	if (ret < 0)
		goto err;
	r->regs = regs;
	r->nregs = n;
	return 0;
err:
	free(regs);
	return ret;
}

void lc_ring_exit(struct lc_ring *r)
{
	if (r->fd < 0)
		return;
	/* never give back a buffer the kernel may still touch */
	if (r->inflight) {
		note_error(r, -ECANCELED, -1);
		drop_unsubmitted(r);
		while (r->inflight) {
			int ret = lc_sys_io_uring_enter(r->fd, 0, 1,
							IORING_ENTER_GETEVENTS);

			if (ret < 0 && ret != -EINTR && ret != -EAGAIN)
				break;
			reap(r);
		}
	}
	drop_regs(r);
	ring_unmap(r);
	close(r->fd);
	free(r->reqs);
	free(r->done);
	ring_reset(r);
}
