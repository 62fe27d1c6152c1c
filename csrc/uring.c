// SPDX-License-Identifier: Apache-2.0
/*
 * layerckpt._uring: the native I/O path.
 *
 * A small io_uring ring driven through raw syscalls (no liburing needed),
 * plus a hardware CRC32C.  No torch headers: buffers come in through the
 * buffer protocol, files as descriptors.  Each request carries its buffer,
 * offset and remaining length (as in liburing's io_uring-cp example); the
 * completion loop resubmits short transfers, EAGAIN and EINTR, so a request
 * completes only when all of its bytes moved, at EOF (reads), or on error.
 * Errors surface as OSError(errno, strerror, path) after every request still
 * in flight has completed, so no buffer is released while the kernel uses it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_DEPTH 256
#define MAX_XFER (1U << 30) /* one SQE moves at most 1 GiB */

struct req {
	Py_buffer view; /* keeps the caller's buffer alive and pinned */
	PyObject *token;
	PyObject *path;
	int fd;
	int is_write;
	int buf_index; /* registered buffer index, or -1 */
	char *addr;
	size_t left;
	uint64_t off;
	int in_use;
	int queued; /* placed in the SQ, not yet seen by the kernel */
};

typedef struct {
	PyObject_HEAD
	int ring_fd;
	unsigned depth;
	unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
	unsigned *cq_head, *cq_tail, *cq_mask;
	struct io_uring_sqe *sqes;
	struct io_uring_cqe *cqes;
	void *sq_ptr, *cq_ptr;
	size_t sq_sz, cq_sz, sqes_sz;
	struct req *reqs;
	unsigned to_submit; /* SQEs placed, not yet submitted */
	unsigned inflight;  /* requests not yet completed (queued or submitted) */
	Py_buffer *regs;
	unsigned nregs;
	int busy;
	int err;
	PyObject *err_path;
	PyObject *done; /* list of tokens completed since the last wait() */
} Ring;

static int sys_setup(unsigned entries, struct io_uring_params *p)
{
	return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete,
		     unsigned flags)
{
	return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete,
			    flags, NULL, 0);
}

static int sys_register(int fd, unsigned op, void *arg, unsigned nr)
{
	return (int)syscall(__NR_io_uring_register, fd, op, arg, nr);
}

static void ring_unmap(Ring *r)
{
	if (r->sqes && r->sqes != MAP_FAILED)
		munmap(r->sqes, r->sqes_sz);
	if (r->cq_ptr && r->cq_ptr != MAP_FAILED && r->cq_ptr != r->sq_ptr)
		munmap(r->cq_ptr, r->cq_sz);
	if (r->sq_ptr && r->sq_ptr != MAP_FAILED)
		munmap(r->sq_ptr, r->sq_sz);
	r->sqes = NULL;
	r->cq_ptr = r->sq_ptr = NULL;
}

static void release_regs(Ring *r)
{
	unsigned i;

	for (i = 0; i < r->nregs; i++)
		PyBuffer_Release(&r->regs[i]);
	PyMem_Free(r->regs);
	r->regs = NULL;
	r->nregs = 0;
}

static void req_release(struct req *q)
{
	PyBuffer_Release(&q->view);
	Py_CLEAR(q->token);
	Py_CLEAR(q->path);
	q->in_use = 0;
	q->queued = 0;
}

static int Ring_init(Ring *r, PyObject *args, PyObject *kw)
{
	static char *kwlist[] = {"depth", NULL};
	struct io_uring_params p;
	unsigned depth = 8;
	int fd;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "|I", kwlist, &depth))
		return -1;
	if (depth < 1 || depth > MAX_DEPTH) {
		PyErr_Format(PyExc_ValueError,
			     "depth must be in [1, %d], got %u", MAX_DEPTH,
			     depth);
		return -1;
	}
	if (r->ring_fd >= 0) {
		PyErr_SetString(PyExc_RuntimeError, "Ring already initialised");
		return -1;
	}
	memset(&p, 0, sizeof(p));
	fd = sys_setup(depth, &p);
	if (fd < 0) {
		PyErr_SetFromErrno(PyExc_OSError);
		return -1;
	}
	r->ring_fd = fd;
	r->depth = depth;
	r->sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
	r->cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
	if (p.features & IORING_FEAT_SINGLE_MMAP) {
		if (r->cq_sz > r->sq_sz)
			r->sq_sz = r->cq_sz;
		r->cq_sz = r->sq_sz;
	}
	r->sq_ptr = mmap(NULL, r->sq_sz, PROT_READ | PROT_WRITE,
			 MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
	if (r->sq_ptr == MAP_FAILED)
		goto err;
	if (p.features & IORING_FEAT_SINGLE_MMAP) {
		r->cq_ptr = r->sq_ptr;
	} else {
		r->cq_ptr = mmap(NULL, r->cq_sz, PROT_READ | PROT_WRITE,
				 MAP_SHARED | MAP_POPULATE, fd,
				 IORING_OFF_CQ_RING);
		if (r->cq_ptr == MAP_FAILED)
			goto err;
	}
	r->sqes_sz = p.sq_entries * sizeof(struct io_uring_sqe);
	r->sqes = mmap(NULL, r->sqes_sz, PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
	if (r->sqes == MAP_FAILED)
		goto err;
	r->sq_head = (unsigned *)((char *)r->sq_ptr + p.sq_off.head);
	r->sq_tail = (unsigned *)((char *)r->sq_ptr + p.sq_off.tail);
	r->sq_mask = (unsigned *)((char *)r->sq_ptr + p.sq_off.ring_mask);
	r->sq_array = (unsigned *)((char *)r->sq_ptr + p.sq_off.array);
	r->cq_head = (unsigned *)((char *)r->cq_ptr + p.cq_off.head);
	r->cq_tail = (unsigned *)((char *)r->cq_ptr + p.cq_off.tail);
	r->cq_mask = (unsigned *)((char *)r->cq_ptr + p.cq_off.ring_mask);
	r->cqes = (struct io_uring_cqe *)((char *)r->cq_ptr + p.cq_off.cqes);
	r->reqs = PyMem_Calloc(depth, sizeof(struct req));
	r->done = PyList_New(0);
	if (!r->reqs || !r->done) {
		PyErr_NoMemory();
		return -1;
	}
	return 0;
err:
	PyErr_SetFromErrno(PyExc_OSError);
	ring_unmap(r);
	close(fd);
	r->ring_fd = -1;
	return -1;
}

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
	Ring *r = (Ring *)type->tp_alloc(type, 0);

	if (r)
		r->ring_fd = -1;
	return (PyObject *)r;
}

static int ring_ready(Ring *r)
{
	if (r->ring_fd < 0) {
		PyErr_SetString(PyExc_ValueError, "Ring is closed");
		return -1;
	}
	if (r->busy) {
		PyErr_SetString(PyExc_RuntimeError,
				"Ring used from two threads at once");
		return -1;
	}
	return 0;
}

/* Place one SQE for request slot i; the ring never holds more than depth. */
static void place_sqe(Ring *r, unsigned i)
{
	struct req *q = &r->reqs[i];
	unsigned tail = *r->sq_tail;
	unsigned idx = tail & *r->sq_mask;
	struct io_uring_sqe *sqe = &r->sqes[idx];
	unsigned len = q->left > MAX_XFER ? MAX_XFER : (unsigned)q->left;

	memset(sqe, 0, sizeof(*sqe));
	if (q->buf_index >= 0) {
		sqe->opcode = q->is_write ? IORING_OP_WRITE_FIXED :
					    IORING_OP_READ_FIXED;
		sqe->buf_index = (unsigned short)q->buf_index;
	} else {
		sqe->opcode = q->is_write ? IORING_OP_WRITE : IORING_OP_READ;
	}
	sqe->fd = q->fd;
	sqe->off = q->off;
	sqe->addr = (unsigned long)q->addr;
	sqe->len = len;
	sqe->user_data = i;
	r->sq_array[idx] = idx;
	__atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
	q->queued = 1;
	r->to_submit++;
}

static void note_error(Ring *r, int e, PyObject *path)
{
	if (r->err)
		return;
	r->err = e;
	Py_XINCREF(path);
	r->err_path = path;
}

/* Drop requests placed but never submitted (after an error). */
static void drop_unsubmitted(Ring *r)
{
	unsigned i;

	if (!r->to_submit)
		return;
	/* Rewind the tail: the kernel has not seen these entries. */
	__atomic_store_n(r->sq_tail, *r->sq_tail - r->to_submit,
			 __ATOMIC_RELEASE);
	r->to_submit = 0;
	for (i = 0; i < r->depth; i++) {
		if (r->reqs[i].in_use && r->reqs[i].queued) {
			req_release(&r->reqs[i]);
			r->inflight--;
		}
	}
}

/* Reap CQEs; returns the number of requests that finished. */
static int reap(Ring *r)
{
	unsigned head = *r->cq_head;
	unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
	int finished = 0;

	while (head != tail) {
		struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
		unsigned i = (unsigned)cqe->user_data;
		int res = cqe->res;
		struct req *q = &r->reqs[i];

		head++;
		if (i >= r->depth || !q->in_use)
			continue;
		if (res == -EAGAIN || res == -EINTR) {
			if (!r->err) {
				place_sqe(r, i);
				continue;
			}
		} else if (res < 0) {
			note_error(r, -res, q->path);
		} else if (res == 0 && q->is_write && q->left) {
			note_error(r, EIO, q->path); /* no progress */
		} else if (res > 0 && (size_t)res < q->left && !r->err) {
			/* short transfer: advance and resubmit the rest */
			q->addr += res;
			q->off += res;
			q->left -= res;
			place_sqe(r, i);
			continue;
		}
		if (!r->err && PyList_Append(r->done, q->token) < 0)
			note_error(r, ENOMEM, NULL);
		req_release(q);
		r->inflight--;
		finished++;
	}
	__atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
	return finished;
}

/* Submit what is placed and wait until `want` requests finished. */
static int pump(Ring *r, unsigned want)
{
	unsigned got = 0;

	for (;;) {
		int n, min = 0, rc;

		n = reap(r);
		got += n;
		if (r->err)
			drop_unsubmitted(r);
		if (r->err ? r->inflight == 0 :
			     (got >= want && r->to_submit == 0))
			return 0;
		if (r->err || got < want)
			min = 1;
		r->busy = 1;
		Py_BEGIN_ALLOW_THREADS
		rc = sys_enter(r->ring_fd, r->to_submit, min,
			       min ? IORING_ENTER_GETEVENTS : 0);
		Py_END_ALLOW_THREADS
		r->busy = 0;
		if (rc < 0) {
			if (errno == EINTR || errno == EAGAIN || errno == EBUSY)
				continue;
			note_error(r, errno, NULL);
			/* the kernel took nothing: release what was placed */
			drop_unsubmitted(r);
			if (r->inflight == 0)
				return 0;
			continue;
		}
		r->to_submit -= (unsigned)rc > r->to_submit ? r->to_submit :
							     (unsigned)rc;
		if (r->to_submit == 0) {
			unsigned i;

			for (i = 0; i < r->depth; i++)
				r->reqs[i].queued = 0;
		}
	}
}

static PyObject *raise_pending(Ring *r)
{
	PyObject *out;

	if (r->err) {
		int e = r->err;
		PyObject *path = r->err_path;

		r->err = 0;
		r->err_path = NULL;
		errno = e;
		if (path && path != Py_None)
			PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError,
							     path);
		else
			PyErr_SetFromErrno(PyExc_OSError);
		Py_XDECREF(path);
		Py_SETREF(r->done, PyList_New(0));
		return NULL;
	}
	out = r->done;
	r->done = PyList_New(0);
	if (!r->done) {
		r->done = out;
		return PyErr_NoMemory();
	}
	return out;
}

static int find_reg(Ring *r, char *addr, size_t len)
{
	unsigned i;

	for (i = 0; i < r->nregs; i++) {
		char *b = r->regs[i].buf;

		if (addr >= b && addr + len <= b + r->regs[i].len)
			return (int)i;
	}
	return -1;
}

static PyObject *submit_io(Ring *r, PyObject *args, int is_write)
{
	PyObject *bufobj, *token, *path = Py_None;
	unsigned long long off;
	struct req *q = NULL;
	int fd;
	unsigned i;

	if (!PyArg_ParseTuple(args, "iOKO|O", &fd, &bufobj, &off, &token,
			      &path))
		return NULL;
	if (ring_ready(r) < 0)
		return NULL;
	if (r->err)
		return raise_pending(r);
	/* a full ring waits for one completion first */
	if (r->inflight >= r->depth) {
		if (pump(r, 1) < 0)
			return NULL;
		if (r->err)
			return raise_pending(r);
	}
	for (i = 0; i < r->depth; i++) {
		if (!r->reqs[i].in_use) {
			q = &r->reqs[i];
			break;
		}
	}
	if (!q) {
		PyErr_SetString(PyExc_RuntimeError, "no free request slot");
		return NULL;
	}
	if (PyObject_GetBuffer(bufobj, &q->view,
			       is_write ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0)
		return NULL;
	q->in_use = 1;
	q->fd = fd;
	q->is_write = is_write;
	q->addr = q->view.buf;
	q->left = (size_t)q->view.len;
	q->off = off;
	q->buf_index = find_reg(r, q->addr, q->left);
	Py_INCREF(token);
	q->token = token;
	Py_INCREF(path);
	q->path = path;
	r->inflight++;
	if (q->left == 0) {
		/* nothing to move: complete at once */
		if (PyList_Append(r->done, token) < 0) {
			req_release(q);
			r->inflight--;
			return NULL;
		}
		req_release(q);
		r->inflight--;
		Py_RETURN_NONE;
	}
	place_sqe(r, i);
	Py_RETURN_NONE;
}

PyDoc_STRVAR(write_doc,
"write(fd, buffer, offset, token, path=None)\n--\n\n"
"Queue a write of the whole buffer at offset.  Blocks (GIL released) only\n"
"when `depth` requests are already in flight.  `token` is returned by\n"
"wait() once every byte is written.");

static PyObject *Ring_write(Ring *r, PyObject *args)
{
	return submit_io(r, args, 1);
}

PyDoc_STRVAR(read_doc,
"read(fd, buffer, offset, token, path=None)\n--\n\n"
"Queue a read filling the writable buffer from offset (stops early at EOF).");

static PyObject *Ring_read(Ring *r, PyObject *args)
{
	return submit_io(r, args, 0);
}

PyDoc_STRVAR(wait_doc,
"wait(min_complete=0)\n--\n\n"
"Submit everything queued, wait (GIL released) until at least min_complete\n"
"requests finished, and return the tokens of all requests finished so far.\n"
"Raises OSError(errno, strerror, path) after draining, if any request failed.");

static PyObject *Ring_wait(Ring *r, PyObject *args)
{
	unsigned want = 0;

	if (!PyArg_ParseTuple(args, "|I", &want))
		return NULL;
	if (ring_ready(r) < 0)
		return NULL;
	if (want > r->inflight)
		want = r->inflight;
	if (pump(r, want) < 0)
		return NULL;
	return raise_pending(r);
}

PyDoc_STRVAR(drain_doc,
"drain()\n--\n\nWait for every queued request; returns their tokens.");

static PyObject *Ring_drain(Ring *r, PyObject *noargs)
{
	if (ring_ready(r) < 0)
		return NULL;
	if (pump(r, r->inflight) < 0)
		return NULL;
	return raise_pending(r);
}

PyDoc_STRVAR(register_doc,
"register_buffers(buffers)\n--\n\n"
"Register writable buffers as fixed buffers (replacing any registered),\n"
"so transfers inside them skip the per-I/O page pinning.  An empty list\n"
"unregisters.  Raises OSError if the kernel refuses.");

static PyObject *Ring_register_buffers(Ring *r, PyObject *seq)
{
	PyObject *fast;
	struct iovec *iov = NULL;
	Py_ssize_t n, i;

	if (ring_ready(r) < 0)
		return NULL;
	if (r->inflight) {
		PyErr_SetString(PyExc_RuntimeError,
				"cannot register buffers with I/O in flight");
		return NULL;
	}
	if (r->nregs) {
		sys_register(r->ring_fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
		release_regs(r);
	}
	fast = PySequence_Fast(seq, "register_buffers takes a sequence");
	if (!fast)
		return NULL;
	n = PySequence_Fast_GET_SIZE(fast);
	if (n == 0) {
		Py_DECREF(fast);
		Py_RETURN_NONE;
	}
	r->regs = PyMem_Calloc(n, sizeof(Py_buffer));
	iov = PyMem_Calloc(n, sizeof(struct iovec));
	if (!r->regs || !iov) {
		PyErr_NoMemory();
		goto err;
	}
	for (i = 0; i < n; i++) {
		PyObject *o = PySequence_Fast_GET_ITEM(fast, i);

		if (PyObject_GetBuffer(o, &r->regs[i], PyBUF_WRITABLE) < 0)
			goto err;
		r->nregs++;
		iov[i].iov_base = r->regs[i].buf;
		iov[i].iov_len = (size_t)r->regs[i].len;
	}
	if (sys_register(r->ring_fd, IORING_REGISTER_BUFFERS, iov,
			 (unsigned)n) < 0) {
		PyErr_SetFromErrno(PyExc_OSError);
		goto err;
	}
	PyMem_Free(iov);
	Py_DECREF(fast);
	Py_RETURN_NONE;
err:
	PyMem_Free(iov);
	release_regs(r);
	Py_DECREF(fast);
	return NULL;
}

static void ring_shutdown(Ring *r)
{
	unsigned i;

	if (r->ring_fd < 0)
		return;
	/* never free a buffer the kernel may still touch */
	if (r->inflight) {
		drop_unsubmitted(r);
		while (r->inflight) {
			int rc = sys_enter(r->ring_fd, 0, 1,
					   IORING_ENTER_GETEVENTS);

			if (rc < 0 && errno != EINTR && errno != EAGAIN)
				break;
			if (!r->err)
				note_error(r, ECANCELED, NULL);
			reap(r);
		}
	}
	for (i = 0; r->reqs && i < r->depth; i++)
		if (r->reqs[i].in_use)
			req_release(&r->reqs[i]);
	if (r->nregs) {
		sys_register(r->ring_fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
		release_regs(r);
	}
	ring_unmap(r);
	close(r->ring_fd);
	r->ring_fd = -1;
	PyMem_Free(r->reqs);
	r->reqs = NULL;
	Py_CLEAR(r->err_path);
	Py_CLEAR(r->done);
}

PyDoc_STRVAR(close_doc, "close()\n--\n\nWait for I/O in flight and free the ring.");

static PyObject *Ring_close(Ring *r, PyObject *noargs)
{
	ring_shutdown(r);
	Py_RETURN_NONE;
}

static void Ring_dealloc(Ring *r)
{
	ring_shutdown(r);
	Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Ring_get_inflight(Ring *r, void *closure)
{
	return PyLong_FromUnsignedLong(r->inflight);
}

static PyObject *Ring_get_registered(Ring *r, void *closure)
{
	return PyLong_FromUnsignedLong(r->nregs);
}

static PyMethodDef Ring_methods[] = {
	{"write", (PyCFunction)Ring_write, METH_VARARGS, write_doc},
	{"read", (PyCFunction)Ring_read, METH_VARARGS, read_doc},
	{"wait", (PyCFunction)Ring_wait, METH_VARARGS, wait_doc},
	{"drain", (PyCFunction)Ring_drain, METH_NOARGS, drain_doc},
	{"register_buffers", (PyCFunction)Ring_register_buffers, METH_O,
	 register_doc},
	{"close", (PyCFunction)Ring_close, METH_NOARGS, close_doc},
	{NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
	{"inflight", (getter)Ring_get_inflight, NULL,
	 "requests queued or in flight", NULL},
	{"registered", (getter)Ring_get_registered, NULL,
	 "number of registered buffers", NULL},
	{NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
	PyVarObject_HEAD_INIT(NULL, 0)
	.tp_name = "layerckpt._uring.Ring",
	.tp_basicsize = sizeof(Ring),
	.tp_flags = Py_TPFLAGS_DEFAULT,
	.tp_doc = PyDoc_STR("Ring(depth=8): an io_uring with a fixed queue depth."),
	.tp_new = Ring_new,
	.tp_init = (initproc)Ring_init,
	.tp_dealloc = (destructor)Ring_dealloc,
	.tp_methods = Ring_methods,
	.tp_getset = Ring_getset,
};

/* ---- CRC32C (Castagnoli) ---- */

static uint32_t crc_table[8][256];

static void crc_init_tables(void)
{
	uint32_t i, j, c;

	for (i = 0; i < 256; i++) {
		c = i;
		for (j = 0; j < 8; j++)
			c = (c >> 1) ^ (0x82F63B78U & (0U - (c & 1)));
		crc_table[0][i] = c;
	}
	for (i = 0; i < 256; i++)
		for (j = 1; j < 8; j++)
			crc_table[j][i] = (crc_table[j - 1][i] >> 8) ^
					  crc_table[0][crc_table[j - 1][i] & 0xff];
}

static uint32_t crc_sw(uint32_t c, const unsigned char *p, size_t n)
{
	while (n && ((uintptr_t)p & 7)) {
		c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
		n--;
	}
	while (n >= 8) {
		uint64_t w;

		memcpy(&w, p, 8);
		w ^= c;
		c = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^
		    crc_table[5][(w >> 16) & 0xff] ^
		    crc_table[4][(w >> 24) & 0xff] ^
		    crc_table[3][(w >> 32) & 0xff] ^
		    crc_table[2][(w >> 40) & 0xff] ^
		    crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
		p += 8;
		n -= 8;
	}
	while (n--)
		c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
	return c;
}

#if defined(__x86_64__)
#include <nmmintrin.h>
#define HAVE_HW_CRC 1
/*
 * Three independent streams hide the 3-cycle latency of crc32q; they are
 * folded back together with the zero-extension operator (crc_shift), which
 * is linear in the crc and precomputed per block length.
 */
#define BLK 4096
static uint32_t shift_table[4][256]; /* multiply by x^(8*BLK) mod P */

static uint32_t gf_mul_xpow(uint32_t c, size_t nbytes)
{
	/* slow reference: feed nbytes zero bytes through the table */
	while (nbytes--)
		c = crc_table[0][c & 0xff] ^ (c >> 8);
	return c;
}

static void crc_init_shift(void)
{
	uint32_t i, b;

	for (b = 0; b < 4; b++)
		for (i = 0; i < 256; i++)
			shift_table[b][i] = gf_mul_xpow(i << (8 * b), BLK);
}

static inline uint32_t crc_shift(uint32_t c)
{
	return shift_table[0][c & 0xff] ^ shift_table[1][(c >> 8) & 0xff] ^
	       shift_table[2][(c >> 16) & 0xff] ^ shift_table[3][c >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t
crc_hw(uint32_t c, const unsigned char *p, size_t n)
{
	uint64_t c0 = c;

	while (n && ((uintptr_t)p & 7)) {
		c0 = _mm_crc32_u8((uint32_t)c0, *p++);
		n--;
	}
	while (n >= 3 * BLK) {
		uint64_t c1 = 0, c2 = 0, a, b, d;
		size_t k;

		for (k = 0; k < BLK; k += 8) {
			memcpy(&a, p + k, 8);
			memcpy(&b, p + BLK + k, 8);
			memcpy(&d, p + 2 * BLK + k, 8);
			c0 = _mm_crc32_u64(c0, a);
			c1 = _mm_crc32_u64(c1, b);
			c2 = _mm_crc32_u64(c2, d);
		}
		c0 = crc_shift(crc_shift((uint32_t)c0) ^ (uint32_t)c1) ^
		     (uint32_t)c2;
		p += 3 * BLK;
		n -= 3 * BLK;
	}
	while (n >= 8) {
		uint64_t a;

		memcpy(&a, p, 8);
		c0 = _mm_crc32_u64(c0, a);
		p += 8;
		n -= 8;
	}
	while (n--)
		c0 = _mm_crc32_u8((uint32_t)c0, *p++);
	return (uint32_t)c0;
}
#else
#define HAVE_HW_CRC 0
#endif

static int use_hw;

static uint32_t crc32c_update(uint32_t crc, const unsigned char *p, size_t n)
{
	uint32_t c = ~crc;

#if HAVE_HW_CRC
	if (use_hw)
		return ~crc_hw(c, p, n);
#endif
	return ~crc_sw(c, p, n);
}

PyDoc_STRVAR(crc32c_doc,
"crc32c(buffer, crc=0)\n--\n\n"
"CRC32C (Castagnoli) of a buffer, continuing from crc.  Hardware-accelerated\n"
"where the CPU has it; releases the GIL on large buffers.");

static PyObject *py_crc32c(PyObject *self, PyObject *args)
{
	Py_buffer view;
	unsigned int crc = 0;
	uint32_t out;

	if (!PyArg_ParseTuple(args, "y*|I", &view, &crc))
		return NULL;
	if (view.len > 65536) {
		Py_BEGIN_ALLOW_THREADS
		out = crc32c_update(crc, view.buf, (size_t)view.len);
		Py_END_ALLOW_THREADS
	} else {
		out = crc32c_update(crc, view.buf, (size_t)view.len);
	}
	PyBuffer_Release(&view);
	return PyLong_FromUnsignedLong(out);
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

PyDoc_STRVAR(populate_doc,
"populate(buffer)\n--\n\n"
"Fault in (and zero) the pages of a fresh writable buffer, GIL released,\n"
"so that later I/O into it does not fault page by page.");

static PyObject *py_populate(PyObject *self, PyObject *args)
{
	Py_buffer view;
	long page = sysconf(_SC_PAGESIZE);
	int rc;

	if (!PyArg_ParseTuple(args, "w*", &view))
		return NULL;
	Py_BEGIN_ALLOW_THREADS
	{
		uintptr_t a = (uintptr_t)view.buf, e = a + (uintptr_t)view.len;
		uintptr_t s = (a + page - 1) & ~((uintptr_t)page - 1);

		rc = 0;
		if (e > s)
			rc = madvise((void *)s, e - s, MADV_POPULATE_WRITE);
		if (rc < 0 || e <= s) { /* old kernel: touch one byte a page */
			volatile char *p = view.buf;
			Py_ssize_t i;

			for (i = 0; i < view.len; i += page)
				p[i] = p[i];
			rc = 0;
		}
	}
	Py_END_ALLOW_THREADS
	PyBuffer_Release(&view);
	Py_RETURN_NONE;
}

PyDoc_STRVAR(probe_doc,
"probe()\n--\n\nRaise OSError if this kernel refuses io_uring; else return None.");

static PyObject *py_probe(PyObject *self, PyObject *noargs)
{
	struct io_uring_params p;
	int fd;

	memset(&p, 0, sizeof(p));
	fd = sys_setup(1, &p);
	if (fd < 0)
		return PyErr_SetFromErrno(PyExc_OSError);
	close(fd);
	Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
	{"crc32c", py_crc32c, METH_VARARGS, crc32c_doc},
	{"probe", py_probe, METH_NOARGS, probe_doc},
	{"populate", py_populate, METH_VARARGS, populate_doc},
	{NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
	PyModuleDef_HEAD_INIT, "layerckpt._uring",
	"Native io_uring writer and CRC32C for layerckpt.", -1,
	module_methods,
};

PyMODINIT_FUNC PyInit__uring(void)
{
	PyObject *m;

	crc_init_tables();
#if HAVE_HW_CRC
	crc_init_shift();
	__builtin_cpu_init();
	use_hw = !!__builtin_cpu_supports("sse4.2");
#endif
	if (PyType_Ready(&RingType) < 0)
		return NULL;
	m = PyModule_Create(&moduledef);
	if (!m)
		return NULL;
	Py_INCREF(&RingType);
	if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
		Py_DECREF(&RingType);
		Py_DECREF(m);
		return NULL;
	}
	if (PyModule_AddIntConstant(m, "HW_CRC32C", use_hw) < 0) {
		Py_DECREF(m);
		return NULL;
	}
	return m;
}
