// SPDX-License-Identifier: Apache-2.0
/*
 * layerckpt._uring: the Python face of the native I/O path (ring.c) and of
 * the CRC32C (crc32c.c).  No torch headers: buffers come in through the
 * buffer protocol, files as descriptors.  The ring knows request slots; the
 * Python objects of each request (its buffer view, token and path) live
 * here, in a side array indexed by slot, until the ring hands the slot back.
 * Errors surface as OSError(errno, strerror, path) after every request
 * still in flight has completed, so no buffer is released while the kernel
 * uses it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include "crc32c.h"
#include "planes.h"
#include "qcodes.h"
#include "ring.h"

/* The Python objects of one request slot. */
struct slot {
	Py_buffer view; /* keeps the caller's buffer alive and pinned */
	PyObject *token;
	PyObject *path;
};

typedef struct {
	PyObject_HEAD
	struct lc_ring ring;
	struct slot *slots;	/* ring.depth entries */
	Py_buffer *regs;	/* views of the registered buffers */
	unsigned int nregs;
	int busy;		/* a method is running (maybe GIL released) */
	PyObject *done;		/* tokens finished since the last wait() */
} Ring;

/* OSError(e, strerror(e)[, path]); e > 0. */
static void set_oserror(int e, PyObject *path)
{
	errno = e;
	if (path && path != Py_None)
		PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
	else
		PyErr_SetFromErrno(PyExc_OSError);
}

static void slot_release(struct slot *s)
{
	PyBuffer_Release(&s->view);
	Py_CLEAR(s->token);
	Py_CLEAR(s->path);
}

static void release_regs(Ring *self)
{
	Py_buffer *regs = self->regs;
	unsigned int i, n = self->nregs;

	self->regs = NULL;
	self->nregs = 0;
	for (i = 0; i < n; i++)
		PyBuffer_Release(&regs[i]);
	PyMem_Free(regs);
}

/* Forget the tokens collected so far. */
static void clear_done(Ring *self)
{
	PyObject *fresh = PyList_New(0);

	if (fresh) {
		Py_SETREF(self->done, fresh);
		return;
	}
	PyErr_Clear();
	if (PyList_SetSlice(self->done, 0, PY_SSIZE_T_MAX, NULL) < 0)
		PyErr_Clear();
}

/*
 * Move the finished requests out of the ring: tokens to self->done, views
 * released.  If the ring recorded an error, raise it (dropping every token
 * collected since the last wait()) once all are out.
 */
static int collect(Ring *self)
{
	struct lc_ring *r = &self->ring;
	int err = r->err, failed = 0;
	PyObject *path = NULL;
	struct lc_done d;

	if (err && r->err_slot >= 0) {
		path = self->slots[r->err_slot].path;
		Py_XINCREF(path);
	}
	while (lc_ring_pop(r, &d)) {
		struct slot *s = &self->slots[d.slot];

		if (!err && !failed && PyList_Append(self->done, s->token) < 0)
			failed = 1;
		slot_release(s);
	}
	if (err) {
		lc_ring_clear_error(r);
		if (failed)
			PyErr_Clear();
		clear_done(self);
		set_oserror(-err, path);
		Py_XDECREF(path);
		return -1;
	}
	return failed ? -1 : 0;
}

/* Submit what is queued, wait (GIL released) for @want requests, collect. */
static int pump(Ring *self, unsigned int want)
{
	Py_BEGIN_ALLOW_THREADS
	lc_ring_wait(&self->ring, want);
	Py_END_ALLOW_THREADS
	return collect(self);
}

/* Start a method that uses the ring; pair with self->busy = 0. */
static int ring_enter(Ring *self)
{
	if (self->ring.fd < 0) {
		PyErr_SetString(PyExc_ValueError, "Ring is closed");
		return -1;
	}
	if (self->busy) {
		PyErr_SetString(PyExc_RuntimeError,
				"Ring used from two threads at once");
		return -1;
	}
	self->busy = 1;
	return 0;
}

static PyObject *take_done(Ring *self)
{
	PyObject *out = self->done;
	PyObject *fresh = PyList_New(0);

	if (!fresh)
		return NULL;
	self->done = fresh;
	return out;
}

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
	Ring *self = (Ring *)type->tp_alloc(type, 0);

	if (self) {
		self->ring.fd = -1;
		self->ring.err_slot = -1;
	}
	return (PyObject *)self;
}

static int Ring_init(Ring *self, PyObject *args, PyObject *kw)
{
	static char *kwlist[] = {"depth", NULL};
	unsigned int depth = 8;
	int ret;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "|I", kwlist, &depth))
		return -1;
	if (depth < 1 || depth > LC_RING_MAX_DEPTH) {
		PyErr_Format(PyExc_ValueError,
			     "depth must be in [1, %d], got %u",
			     LC_RING_MAX_DEPTH, depth);
		return -1;
	}
	if (self->ring.fd >= 0) {
		PyErr_SetString(PyExc_RuntimeError, "Ring already initialised");
		return -1;
	}
	ret = lc_ring_init(&self->ring, depth);
	if (ret < 0) {
		set_oserror(-ret, NULL);
		return -1;
	}
	self->slots = PyMem_Calloc(depth, sizeof(*self->slots));
	if (!self->slots) {
		PyErr_NoMemory();
		goto err;
	}
	Py_XSETREF(self->done, PyList_New(0));
	if (!self->done)
		goto err;
	return 0;
err:
	lc_ring_exit(&self->ring);
	PyMem_Free(self->slots);
	self->slots = NULL;
	return -1;
}

static PyObject *submit_io(Ring *self, PyObject *args, int is_write)
{
	PyObject *bufobj, *token, *path = Py_None;
	unsigned long long off;
	struct lc_ring *r = &self->ring;
	struct slot *s;
	int fd, i, ret;

	if (!PyArg_ParseTuple(args, "iOKO|O", &fd, &bufobj, &off, &token,
			      &path))
		return NULL;
	if (ring_enter(self) < 0)
		return NULL;
	/* a full ring waits for one completion first */
	if (r->inflight >= r->depth && pump(self, 1) < 0)
		goto err;
	i = lc_ring_free_slot(r);
	if (i < 0) {
		PyErr_SetString(PyExc_RuntimeError, "no free request slot");
		goto err;
	}
	s = &self->slots[i];
	if (PyObject_GetBuffer(bufobj, &s->view,
			       is_write ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0)
		goto err;
	ret = lc_ring_queue(r, i, fd, is_write, s->view.buf,
			    (size_t)s->view.len, off, 0);
	if (ret < 0) {
		PyBuffer_Release(&s->view);
		set_oserror(-ret, path);
		goto err;
	}
	Py_INCREF(token);
	s->token = token;
	Py_INCREF(path);
	s->path = path;
	/* a zero-length request has finished already */
	if (collect(self) < 0)
		goto err;
	self->busy = 0;
	Py_RETURN_NONE;
err:
	self->busy = 0;
	return NULL;
}

PyDoc_STRVAR(write_doc,
"write(fd, buffer, offset, token, path=None)\n--\n\n"
"Queue a write of the whole buffer at offset.  Blocks (GIL released) only\n"
"when `depth` requests are already in flight.  `token` is returned by\n"
"wait() once every byte is written.");

static PyObject *Ring_write(Ring *self, PyObject *args)
{
	return submit_io(self, args, 1);
}

PyDoc_STRVAR(read_doc,
"read(fd, buffer, offset, token, path=None)\n--\n\n"
"Queue a read filling the writable buffer from offset (stops early at EOF).");

static PyObject *Ring_read(Ring *self, PyObject *args)
{
	return submit_io(self, args, 0);
}

static PyObject *wait_for(Ring *self, unsigned int want)
{
	int ret = pump(self, want);

	self->busy = 0;
	return ret < 0 ? NULL : take_done(self);
}

PyDoc_STRVAR(wait_doc,
"wait(min_complete=0)\n--\n\n"
"Submit everything queued, wait (GIL released) until at least min_complete\n"
"requests finished, and return the tokens of all requests finished so far.\n"
"Raises OSError(errno, strerror, path) after draining, if any request failed.");

static PyObject *Ring_wait(Ring *self, PyObject *args)
{
	unsigned int want = 0;

	if (!PyArg_ParseTuple(args, "|I", &want))
		return NULL;
	if (ring_enter(self) < 0)
		return NULL;
	return wait_for(self, want);
}

PyDoc_STRVAR(drain_doc,
"drain()\n--\n\nWait for every queued request; returns their tokens.");

static PyObject *Ring_drain(Ring *self, PyObject *noargs)
{
	if (ring_enter(self) < 0)
		return NULL;
	return wait_for(self, self->ring.inflight);
}

PyDoc_STRVAR(register_doc,
"register_buffers(buffers)\n--\n\n"
"Register writable buffers as fixed buffers (replacing any registered),\n"
"so transfers inside them skip the per-I/O page pinning.  An empty list\n"
"unregisters.  Raises OSError if the kernel refuses.");

static PyObject *Ring_register_buffers(Ring *self, PyObject *seq)
{
	struct iovec *iov = NULL;
	PyObject *fast;
	Py_ssize_t n, i;
	int ret;

	if (ring_enter(self) < 0)
		return NULL;
	if (self->ring.inflight) {
		PyErr_SetString(PyExc_RuntimeError,
				"cannot register buffers with I/O in flight");
		goto out;
	}
	if (self->nregs) {
		lc_ring_unregister_buffers(&self->ring);
		release_regs(self);
	}
	fast = PySequence_Fast(seq, "register_buffers takes a sequence");
	if (!fast)
		goto out;
	n = PySequence_Fast_GET_SIZE(fast);
	if (n == 0) {
		Py_DECREF(fast);
		self->busy = 0;
		Py_RETURN_NONE;
	}
	self->regs = PyMem_Calloc(n, sizeof(Py_buffer));
	iov = PyMem_Calloc(n, sizeof(struct iovec));
	if (!self->regs || !iov) {
		PyErr_NoMemory();
		goto err;
	}
	for (i = 0; i < n; i++) {
		PyObject *o = PySequence_Fast_GET_ITEM(fast, i);

		if (PyObject_GetBuffer(o, &self->regs[i], PyBUF_WRITABLE) < 0)
			goto err;
		self->nregs++;
		iov[i].iov_base = self->regs[i].buf;
		iov[i].iov_len = (size_t)self->regs[i].len;
	}
	ret = lc_ring_register_buffers(&self->ring, iov, (unsigned int)n);
	if (ret < 0) {
		set_oserror(-ret, NULL);
		goto err;
	}
	PyMem_Free(iov);
	Py_DECREF(fast);
	self->busy = 0;
	Py_RETURN_NONE;
err:
	PyMem_Free(iov);
	release_regs(self);
	Py_DECREF(fast);
out:
	self->busy = 0;
	return NULL;
}

static void ring_shutdown(Ring *self)
{
	struct slot *slots = self->slots;
	unsigned int i, depth = self->ring.depth;

	if (self->ring.fd < 0)
		return;
	/* waits until the kernel let go of every buffer */
	lc_ring_exit(&self->ring);
	self->slots = NULL;
	for (i = 0; slots && i < depth; i++)
		slot_release(&slots[i]);
	PyMem_Free(slots);
	release_regs(self);
	Py_CLEAR(self->done);
}

PyDoc_STRVAR(close_doc, "close()\n--\n\nWait for I/O in flight and free the ring.");

static PyObject *Ring_close(Ring *self, PyObject *noargs)
{
	if (self->busy) {
		PyErr_SetString(PyExc_RuntimeError,
				"Ring used from two threads at once");
		return NULL;
	}
	ring_shutdown(self);
	Py_RETURN_NONE;
}

static void Ring_dealloc(Ring *self)
{
	ring_shutdown(self);
	Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Ring_get_inflight(Ring *self, void *closure)
{
	return PyLong_FromUnsignedLong(self->ring.inflight);
}

static PyObject *Ring_get_registered(Ring *self, void *closure)
{
	return PyLong_FromUnsignedLong(self->nregs);
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
		out = lc_crc32c(crc, view.buf, (size_t)view.len);
		Py_END_ALLOW_THREADS
	} else {
		out = lc_crc32c(crc, view.buf, (size_t)view.len);
	}
	PyBuffer_Release(&view);
	return PyLong_FromUnsignedLong(out);
}

PyDoc_STRVAR(copy_crc32c_doc,
"copy_crc32c(dst, src, crc=0)\n--\n\n"
"Copy src into dst (same length) and return the CRC32C of the bytes copied,\n"
"continuing from crc: one pass, each block checksummed while it is still in\n"
"the CPU's cache.  Releases the GIL.");

#define COPY_BLOCK (64 * 1024)

static PyObject *py_copy_crc32c(PyObject *self, PyObject *args)
{
	Py_buffer dst, src;
	unsigned int crc = 0;
	uint32_t out;

	if (!PyArg_ParseTuple(args, "w*y*|I", &dst, &src, &crc))
		return NULL;
	if (dst.len != src.len) {
		PyBuffer_Release(&dst);
		PyBuffer_Release(&src);
		PyErr_Format(PyExc_ValueError, "copy_crc32c: dst has %zd bytes, src %zd",
			     dst.len, src.len);
		return NULL;
	}
	out = crc;
	Py_BEGIN_ALLOW_THREADS
	{
		char *d = dst.buf;
		const char *s = src.buf;
		Py_ssize_t off;

		for (off = 0; off < dst.len; off += COPY_BLOCK) {
			size_t n = (size_t)(dst.len - off < COPY_BLOCK ? dst.len - off : COPY_BLOCK);

			memcpy(d + off, s + off, n);
			out = lc_crc32c(out, d + off, n);
		}
	}
	Py_END_ALLOW_THREADS
	PyBuffer_Release(&dst);
	PyBuffer_Release(&src);
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
	int ret = lc_ring_probe();

	if (ret < 0) {
		set_oserror(-ret, NULL);
		return NULL;
	}
	Py_RETURN_NONE;
}

PyDoc_STRVAR(planes_doc,
"planes(raw, ref, out, esize) -> bool\n--\n\n"
"Byte planes of raw's elements of esize bytes (1, 2, 4 or 8) into out, or, where ref is not None, of the\n"
"zigzag-mapped wrapping difference raw - ref.  Returns whether any byte written is nonzero.");

static int check_es(int es, Py_ssize_t n)
{
	if ((es != 1 && es != 2 && es != 4 && es != 8) || n % es) {
		PyErr_Format(PyExc_ValueError, "element size %d does not divide %zd bytes (or is not 1, 2, 4, 8)", es, n);
		return -1;
	}
	return 0;
}

static PyObject *py_planes(PyObject *self, PyObject *args)
{
	Py_buffer raw, ref = {0}, out;
	PyObject *refobj;
	int es, any = 0, have_ref;

	if (!PyArg_ParseTuple(args, "y*Ow*i", &raw, &refobj, &out, &es))
		return NULL;
	have_ref = refobj != Py_None;
	if (have_ref && PyObject_GetBuffer(refobj, &ref, PyBUF_SIMPLE) < 0)
		goto fail;
	if (out.len != raw.len || (have_ref && ref.len != raw.len)) {
		PyErr_Format(PyExc_ValueError, "planes: raw has %zd bytes, out %zd, ref %zd", raw.len, out.len,
			     have_ref ? ref.len : raw.len);
		goto fail;
	}
	if (check_es(es, raw.len) < 0)
		goto fail;
	Py_BEGIN_ALLOW_THREADS
	any = lc_planes(raw.buf, have_ref ? ref.buf : NULL, out.buf, (size_t)raw.len, es);
	Py_END_ALLOW_THREADS
	PyBuffer_Release(&raw);
	PyBuffer_Release(&out);
	if (have_ref)
		PyBuffer_Release(&ref);
	return PyBool_FromLong(any);
fail:
	PyBuffer_Release(&raw);
	PyBuffer_Release(&out);
	if (have_ref && ref.buf)
		PyBuffer_Release(&ref);
	return NULL;
}

PyDoc_STRVAR(unplanes_doc,
"unplanes(planes, out, esize, add)\n--\n\n"
"The inverse of planes(): elements into out; with add, out holds the reference and the delta is added.");

static PyObject *py_unplanes(PyObject *self, PyObject *args)
{
	Py_buffer planes, out;
	int es, add;

	if (!PyArg_ParseTuple(args, "y*w*ip", &planes, &out, &es, &add))
		return NULL;
	if (planes.len != out.len || check_es(es, out.len) < 0) {
		if (!PyErr_Occurred())
			PyErr_Format(PyExc_ValueError, "unplanes: planes has %zd bytes, out %zd", planes.len, out.len);
		PyBuffer_Release(&planes);
		PyBuffer_Release(&out);
		return NULL;
	}
	Py_BEGIN_ALLOW_THREADS
	lc_unplanes(planes.buf, out.buf, (size_t)out.len, es, add);
	Py_END_ALLOW_THREADS
	PyBuffer_Release(&planes);
	PyBuffer_Release(&out);
	Py_RETURN_NONE;
}

/* ---- bounded-loss codes (qcodes.h) ---- */

static int check_floats(Py_buffer *b, const char *what, Py_ssize_t want)
{
	if (b->len % 4 || ((uintptr_t)b->buf & 3) || (want >= 0 && b->len != want)) {
		PyErr_Format(PyExc_ValueError, "%s: %zd bytes, not %s%zd aligned fp32 bytes", what, b->len,
			     want >= 0 ? "" : "a multiple of 4: ", want >= 0 ? want : 4);
		return -1;
	}
	return 0;
}

static int check_len(Py_buffer *b, const char *what, Py_ssize_t want)
{
	if (b->len != want) {
		PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, b->len, want);
		return -1;
	}
	return 0;
}

PyDoc_STRVAR(qcodes_doc,
"qmom(x, bits, group, scales, codes, restored) -> (emax, esq, ss) or None\n"
"qsq(x, bits, lohi, codes, restored) -> (emax, esq, ss) or None\n--\n\n"
"A moment's bounded-loss codes (layerckpt.format._qblock's QMOM, QSQ) of the fp32 bytes x: the scale of each\n"
"group of group elements (QSQ: 2048, each group's [lo, hi] bit patterns), the codes (bits 8: a byte each; 4: two\n"
"a byte, low nibble first)\n"
"and the restored values, written into the given buffers; None where the code does not fit x.");

static PyObject *py_qmoment(PyObject *args, int sq)
{
	Py_buffer x, sc, codes, out;
	int bits, bad;
	Py_ssize_t group = LC_QGROUP;
	size_t n, groups;
	double st[3];

	if (sq ? !PyArg_ParseTuple(args, "y*iw*w*w*:qsq", &x, &bits, &sc, &codes, &out)
	       : !PyArg_ParseTuple(args, "y*inw*w*w*:qmom", &x, &bits, &group, &sc, &codes, &out))
		return NULL;
	n = (size_t)x.len / 4;
	if (group < 2 || group > LC_QGROUP || group % 2) {
		PyErr_Format(PyExc_ValueError, "group must be even, 2 to %d, not %zd", LC_QGROUP, group);
		goto fail;
	}
	groups = (n + (size_t)group - 1) / (size_t)group;
	if (bits != 8 && bits != 4) {
		PyErr_Format(PyExc_ValueError, "bits must be 8 or 4, not %d", bits);
		goto fail;
	}
	if (check_floats(&x, "x", -1) < 0 || check_floats(&out, "restored", x.len) < 0 ||
	    check_floats(&sc, "scales", (Py_ssize_t)(groups * (sq ? 8 : 4))) < 0 ||
	    check_len(&codes, "codes", (Py_ssize_t)(bits == 8 ? n : (n + 1) / 2)) < 0)
		goto fail;
	Py_BEGIN_ALLOW_THREADS
	bad = sq ? lc_qsq(x.buf, n, bits, sc.buf, codes.buf, out.buf, st)
		 : lc_qmom(x.buf, n, bits, (size_t)group, sc.buf, codes.buf, out.buf, st);
	Py_END_ALLOW_THREADS
	PyBuffer_Release(&x);
	PyBuffer_Release(&sc);
	PyBuffer_Release(&codes);
	PyBuffer_Release(&out);
	if (bad)
		Py_RETURN_NONE;
	return Py_BuildValue("(ddd)", st[0], st[1], st[2]);
fail:
	PyBuffer_Release(&x);
	PyBuffer_Release(&sc);
	PyBuffer_Release(&codes);
	PyBuffer_Release(&out);
	return NULL;
}

static PyObject *py_qmom(PyObject *self, PyObject *args)
{
	return py_qmoment(args, 0);
}

static PyObject *py_qsq(PyObject *self, PyObject *args)
{
	return py_qmoment(args, 1);
}

PyDoc_STRVAR(qsq_told_doc,
"qsq_told(ref, bits, lohi, codes, restore) -> None\n--\n\n"
"QSQREF's codes (layerckpt.format._qblock): the code each fp32 value of ref takes in the grid of each group's\n"
"[lo, hi] bit patterns (lohi, as qsq writes them), subtracted from the codes (restore false) or added to them\n"
"(restore true), modulo 2 ** bits, in place (bits 8: a byte each; 4: two a byte, low nibble first).");

static PyObject *py_qsq_told(PyObject *self, PyObject *args)
{
	Py_buffer ref, sc, codes;
	int bits, restore;
	size_t n, groups;

	if (!PyArg_ParseTuple(args, "y*iy*w*p:qsq_told", &ref, &bits, &sc, &codes, &restore))
		return NULL;
	n = (size_t)ref.len / 4;
	groups = (n + LC_QGROUP - 1) / LC_QGROUP;
	if (bits != 8 && bits != 4) {
		PyErr_Format(PyExc_ValueError, "bits must be 8 or 4, not %d", bits);
		goto fail;
	}
	if (check_floats(&ref, "ref", -1) < 0 || check_floats(&sc, "lohi", (Py_ssize_t)(groups * 8)) < 0 ||
	    check_len(&codes, "codes", (Py_ssize_t)(bits == 8 ? n : (n + 1) / 2)) < 0)
		goto fail;
	Py_BEGIN_ALLOW_THREADS
	lc_qsq_told(ref.buf, n, bits, sc.buf, codes.buf, restore);
	Py_END_ALLOW_THREADS
	PyBuffer_Release(&ref);
	PyBuffer_Release(&sc);
	PyBuffer_Release(&codes);
	Py_RETURN_NONE;
fail:
	PyBuffer_Release(&ref);
	PyBuffer_Release(&sc);
	PyBuffer_Release(&codes);
	return NULL;
}

PyDoc_STRVAR(qdelta_doc,
"qdelta_ss(x, r) -> float or None\n"
"qdelta(x, r, step, codes, restored) -> (top, emax, esq) or None\n--\n\n"
"A weight's bounded-loss delta (layerckpt.format._qblock's QDELTA) of the fp32 bytes x against r: the sum of\n"
"the squared differences (None where not finite); then its int32 codes rint((x - r) / step) and the restored\n"
"r + step * code written into the buffers, with the largest |code| (None where it reaches 2**24).");

static PyObject *py_qdelta_ss(PyObject *self, PyObject *args)
{
	Py_buffer x, r;
	double ss = 0.0;
	int bad = 1;

	if (!PyArg_ParseTuple(args, "y*y*:qdelta_ss", &x, &r))
		return NULL;
	if (check_floats(&x, "x", -1) == 0 && check_floats(&r, "r", x.len) == 0) {
		Py_BEGIN_ALLOW_THREADS
		bad = lc_qdelta_ss(x.buf, r.buf, (size_t)x.len / 4, &ss);
		Py_END_ALLOW_THREADS
	}
	PyBuffer_Release(&x);
	PyBuffer_Release(&r);
	if (PyErr_Occurred())
		return NULL;
	if (bad)
		Py_RETURN_NONE;
	return PyFloat_FromDouble(ss);
}

static PyObject *py_qdelta(PyObject *self, PyObject *args)
{
	Py_buffer x, r, codes, out;
	float step;
	double top = 0.0, st[3] = {0.0, 0.0, 0.0};
	int bad = 1;

	if (!PyArg_ParseTuple(args, "y*y*fw*w*:qdelta", &x, &r, &step, &codes, &out))
		return NULL;
	if (check_floats(&x, "x", -1) == 0 && check_floats(&r, "r", x.len) == 0 &&
	    check_floats(&codes, "codes", x.len) == 0 && check_floats(&out, "restored", x.len) == 0) {
		Py_BEGIN_ALLOW_THREADS
		bad = lc_qdelta(x.buf, r.buf, (size_t)x.len / 4, step, codes.buf, out.buf, &top, st);
		Py_END_ALLOW_THREADS
	}
	PyBuffer_Release(&x);
	PyBuffer_Release(&r);
	PyBuffer_Release(&codes);
	PyBuffer_Release(&out);
	if (PyErr_Occurred())
		return NULL;
	if (bad)
		Py_RETURN_NONE;
	return Py_BuildValue("(ddd)", top, st[0], st[1]);
}

/* ---- the drift sample's gather (layerckpt.select._track) ---- */

PyDoc_STRVAR(gather_runs_doc,
"gather_runs(dst, runs) -> None\n--\n\n"
"Copy the drift sample's fp32 elements into dst, in order: for each (addr, start, stride, count, run, div) of\n"
"runs, count runs of run elements, the i-th at addr + 4 * (start + i * stride), each element divided by div\n"
"(copied as is where div is 1); addr 0: count * run zeros.  The addresses are the caller's live, contiguous\n"
"fp32 tensors, whose bounds it checked: nothing here can.");

/* out[j] = src[j] / d: a true division, as torch's (no reciprocal), in lanes of 16 (a run of the drift sample). */
static void div_run(float *restrict out, const float *restrict src, size_t n, float d)
{
	size_t j, k;

	for (j = 0; j + 16 <= n; j += 16)
		for (k = 0; k < 16; k++)
			out[j + k] = src[j + k] / d;
	for (; j < n; j++)
		out[j] = src[j] / d;
}

static PyObject *py_gather_runs(PyObject *self, PyObject *args)
{
	Py_buffer dst;
	PyObject *runs, *seq = NULL;
	Py_ssize_t i, k, n, at = 0, need = 0;
	struct gspec { uintptr_t addr; Py_ssize_t start, stride, count, run; float div; } *spec = NULL;

	if (!PyArg_ParseTuple(args, "w*O:gather_runs", &dst, &runs))
		return NULL;
	seq = PySequence_Fast(runs, "runs must be a sequence");
	if (seq == NULL || check_floats(&dst, "dst", -1) < 0)
		goto fail;
	n = PySequence_Fast_GET_SIZE(seq);
	spec = PyMem_Calloc((size_t)(n ? n : 1), sizeof(*spec));
	if (spec == NULL) {
		PyErr_NoMemory();
		goto fail;
	}
	for (i = 0; i < n; i++) {
		unsigned long long addr;
		double div;
		struct gspec *g = &spec[i];

		if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Knnnnd:gather_runs", &addr, &g->start,
				      &g->stride, &g->count, &g->run, &div))
			goto fail;
		if (g->start < 0 || g->count < 0 || g->run < 0 || (g->count > 1 && g->stride < g->run)) {
			PyErr_Format(PyExc_ValueError, "gather_runs: run %zd: start %zd, stride %zd, count %zd, run %zd",
				     i, g->start, g->stride, g->count, g->run);
			goto fail;
		}
		g->addr = (uintptr_t)addr;
		g->div = (float)div;
		need += g->count * g->run;
	}
	if (need * 4 != dst.len) {
		PyErr_Format(PyExc_ValueError, "gather_runs: dst has %zd bytes, the runs %zd", dst.len, need * 4);
		goto fail;
	}
	Py_BEGIN_ALLOW_THREADS
	for (i = 0; i < n; i++) {
		const struct gspec *g = &spec[i];
		float *out = (float *)dst.buf + at;
		size_t len = (size_t)g->run * sizeof(float);

		at += g->count * g->run;
		if (g->addr == 0) {
			memset(out, 0, len * (size_t)g->count);
			continue;
		}
		for (k = 0; k < g->count; k++, out += g->run) {
			const float *src = (const float *)g->addr + g->start + k * g->stride;

			if (g->div == 1.0f)
				memcpy(out, src, len);
			else
				div_run(out, src, (size_t)g->run, g->div);
		}
	}
	Py_END_ALLOW_THREADS
	PyMem_Free(spec);
	Py_DECREF(seq);
	PyBuffer_Release(&dst);
	Py_RETURN_NONE;
fail:
	PyMem_Free(spec);
	Py_XDECREF(seq);
	PyBuffer_Release(&dst);
	return NULL;
}

PyDoc_STRVAR(segsums_doc,
"segsums(specs) -> list of float\n--\n\n"
"Per (a, b, g1, g2, n) of specs, over n fp32 elements at each address, summed in double: where g1 is 0, the\n"
"squared distance sum((a - b)^2) (b 0: sum(a^2)); else the first-order step sum((g1 + g2) / 2 * (a - b));\n"
"0 where n is 0 (an empty tensor's address may be 0).\n"
"The addresses are the caller's live, contiguous fp32 tensors of n elements: nothing here can check them.");

/* Eight chains of double sums, one per lane: the adds overlap and the compiler can vectorize them. */
#define SEG_LANES 8

static double segsum(const float *restrict a, const float *restrict b, const float *restrict g1,
		     const float *restrict g2, size_t n)
{
	double s[SEG_LANES] = {0.0};
	size_t i = 0, k;

	if (g1 != NULL) {
		for (; i + SEG_LANES <= n; i += SEG_LANES)
			for (k = 0; k < SEG_LANES; k++)
				s[k] += 0.5 * ((double)g1[i + k] + (double)g2[i + k]) * (double)(a[i + k] - b[i + k]);
		for (; i < n; i++)
			s[0] += 0.5 * ((double)g1[i] + (double)g2[i]) * (double)(a[i] - b[i]);
	} else if (b != NULL) {
		for (; i + SEG_LANES <= n; i += SEG_LANES)
			for (k = 0; k < SEG_LANES; k++) {
				double d = (double)(a[i + k] - b[i + k]);

				s[k] += d * d;
			}
		for (; i < n; i++)
			s[0] += (double)(a[i] - b[i]) * (double)(a[i] - b[i]);
	} else {
		for (; i + SEG_LANES <= n; i += SEG_LANES)
			for (k = 0; k < SEG_LANES; k++)
				s[k] += (double)a[i + k] * (double)a[i + k];
		for (; i < n; i++)
			s[0] += (double)a[i] * (double)a[i];
	}
	return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

static PyObject *py_segsums(PyObject *self, PyObject *args)
{
	PyObject *specs, *seq, *out = NULL;
	Py_ssize_t i, n;
	struct sspec { uintptr_t a, b, g1, g2; Py_ssize_t n; } *sp = NULL;
	double *sums = NULL;

	if (!PyArg_ParseTuple(args, "O:segsums", &specs))
		return NULL;
	seq = PySequence_Fast(specs, "specs must be a sequence");
	if (seq == NULL)
		return NULL;
	n = PySequence_Fast_GET_SIZE(seq);
	sp = PyMem_Calloc((size_t)(n ? n : 1), sizeof(*sp));
	sums = PyMem_Calloc((size_t)(n ? n : 1), sizeof(*sums));
	if (sp == NULL || sums == NULL) {
		PyErr_NoMemory();
		goto done;
	}
	for (i = 0; i < n; i++) {
		unsigned long long a, b, g1, g2;

		if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKKKn:segsums", &a, &b, &g1, &g2, &sp[i].n))
			goto done;
		if (sp[i].n == 0) /* an empty tensor: its address may be 0; its sum is 0 */
			continue;
		if (a == 0 || sp[i].n < 0 || (g1 != 0 && (b == 0 || g2 == 0))) {
			PyErr_Format(PyExc_ValueError, "segsums: spec %zd: a step needs a, b, g1 and g2; a sum needs a "
				     "and n >= 0", i);
			goto done;
		}
		sp[i].a = (uintptr_t)a;
		sp[i].b = (uintptr_t)b;
		sp[i].g1 = (uintptr_t)g1;
		sp[i].g2 = (uintptr_t)g2;
	}
	Py_BEGIN_ALLOW_THREADS
	for (i = 0; i < n; i++)
		sums[i] = sp[i].n == 0 ? 0.0
			  : segsum((const float *)sp[i].a, (const float *)sp[i].b, (const float *)sp[i].g1,
				   (const float *)sp[i].g2, (size_t)sp[i].n);
	Py_END_ALLOW_THREADS
	out = PyList_New(n);
	for (i = 0; out != NULL && i < n; i++) {
		PyObject *f = PyFloat_FromDouble(sums[i]);

		if (f == NULL) {
			Py_CLEAR(out);
			break;
		}
		PyList_SET_ITEM(out, i, f);
	}
done:
	PyMem_Free(sp);
	PyMem_Free(sums);
	Py_DECREF(seq);
	return out;
}

static PyMethodDef module_methods[] = {
	{"segsums", py_segsums, METH_VARARGS, segsums_doc},
	{"gather_runs", py_gather_runs, METH_VARARGS, gather_runs_doc},
	{"planes", py_planes, METH_VARARGS, planes_doc},
	{"unplanes", py_unplanes, METH_VARARGS, unplanes_doc},
	{"qmom", py_qmom, METH_VARARGS, qcodes_doc},
	{"qsq", py_qsq, METH_VARARGS, qcodes_doc},
	{"qsq_told", py_qsq_told, METH_VARARGS, qsq_told_doc},
	{"qdelta_ss", py_qdelta_ss, METH_VARARGS, qdelta_doc},
	{"qdelta", py_qdelta, METH_VARARGS, qdelta_doc},
	{"crc32c", py_crc32c, METH_VARARGS, crc32c_doc},
	{"copy_crc32c", py_copy_crc32c, METH_VARARGS, copy_crc32c_doc},
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

	lc_crc32c_init();
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
	if (PyModule_AddIntConstant(m, "HW_CRC32C", lc_crc32c_have_hw()) < 0) {
		Py_DECREF(m);
		return NULL;
	}
	return m;
}
