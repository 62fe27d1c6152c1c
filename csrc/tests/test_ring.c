// SPDX-License-Identifier: Apache-2.0
/*
 * Plain-C test of the ring and the CRC32C, no Python:
 *
 *   gcc -Wall -Werror -std=gnu11 -g csrc/tests/test_ring.c csrc/ring.c \
 *       csrc/sys.c csrc/crc32c.c -o test_ring && ./test_ring [DIR]
 *
 * Writes and reads back a few MiB with O_DIRECT (where DIR's file system
 * allows) at a small queue depth, with registered and plain buffers, and
 * checks the error path.  DIR defaults to $TMPDIR, then /tmp.  Exits 0 on
 * success, 1 on a failure, 77 (skip) if the kernel refuses io_uring.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../crc32c.h"
#include "../ring.h"

#define EXIT_SKIP 77
#define DEPTH 4
#define CHUNK (64U << 10)
#define NCHUNK 64U /* 4 MiB, sixteen times the depth */
#define TOTAL ((size_t)CHUNK * NCHUNK)

#define CHECK(cond, ...)                                                   \
	do {                                                               \
		if (!(cond)) {                                             \
			fprintf(stderr, "%s:%d: check failed: %s: ",       \
				__FILE__, __LINE__, #cond);                \
			fprintf(stderr, __VA_ARGS__);                      \
			fputc('\n', stderr);                               \
			exit(1);                                           \
		}                                                          \
	} while (0)

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;

static uint64_t rnd(void)
{
	uint64_t x = rng_state;

	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return rng_state = x;
}

static void *xalloc(size_t n)
{
	void *p = NULL;

	CHECK(posix_memalign(&p, 4096, n) == 0, "posix_memalign(%zu)", n);
	return p;
}

/* ---- CRC32C ---- */

static void test_crc_vectors(void)
{
	static const struct {
		const char *name;
		unsigned char data[32];
		size_t len;
		uint32_t crc;
	} v[] = {
		{ "123456789", "123456789", 9, 0xE3069283 },
		{ "empty", "", 0, 0 },
		{ "32 x 0x00", { 0 }, 32, 0x8A9136AA },
		{ "32 x 0xff",
		  { [0 ... 31] = 0xff }, 32, 0x62A8AB43 },
		{ "0..31",
		  { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
		    16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
		    31 },
		  32, 0x46DD794E },
		{ "31..0",
		  { 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17,
		    16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0 },
		  32, 0x113FDB5C },
	};
	size_t i;

	for (i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
		uint32_t sw = lc_crc32c_sw(0, v[i].data, v[i].len);
		uint32_t c = lc_crc32c(0, v[i].data, v[i].len);

		CHECK(sw == v[i].crc, "%s: sw %08x, want %08x", v[i].name, sw,
		      v[i].crc);
		CHECK(c == v[i].crc, "%s: %08x, want %08x", v[i].name, c,
		      v[i].crc);
		if (lc_crc32c_have_hw()) {
			uint32_t hw = lc_crc32c_hw(0, v[i].data, v[i].len);

			CHECK(hw == v[i].crc, "%s: hw %08x, want %08x",
			      v[i].name, hw, v[i].crc);
		}
	}
	/* continuation */
	CHECK(lc_crc32c(lc_crc32c(0, "12345", 5), "6789", 4) == 0xE3069283,
	      "continued crc");
}

static void test_crc_hw_sw(void)
{
	size_t n = 4 * 3 * 4096 + 256, i;
	unsigned char *buf = malloc(n);
	int rounds = 300;

	CHECK(buf, "malloc");
	for (i = 0; i < n; i++)
		buf[i] = (unsigned char)rnd();
	while (rounds--) {
		size_t off = rnd() % 64;
		size_t len = rounds < 8 ? n - off : rnd() % (n - off + 1);
		size_t cut = len ? rnd() % (len + 1) : 0;
		uint32_t seed = rounds & 1 ? (uint32_t)rnd() : 0;
		uint32_t sw = lc_crc32c_sw(seed, buf + off, len);
		uint32_t two = lc_crc32c_sw(lc_crc32c_sw(seed, buf + off, cut),
					    buf + off + cut, len - cut);

		CHECK(sw == two, "sw continuation at %zu+%zu/%zu", off, cut,
		      len);
		CHECK(lc_crc32c(seed, buf + off, len) == sw,
		      "lc_crc32c != sw at %zu+%zu", off, len);
		if (lc_crc32c_have_hw()) {
			uint32_t hw = lc_crc32c_hw(seed, buf + off, len);

			CHECK(hw == sw, "hw %08x != sw %08x at %zu+%zu", hw, sw,
			      off, len);
		}
	}
	free(buf);
	printf("crc32c: vectors and %s ok\n",
	       lc_crc32c_have_hw() ? "hardware == software" :
				     "software (no hardware CRC here)");
}

/* ---- the ring ---- */

static unsigned int max_inflight;

/* Pop every finished request; each must have moved all its bytes. */
static unsigned int pop_all(struct lc_ring *r, unsigned char *seen)
{
	struct lc_done d;
	unsigned int n = 0;

	while (lc_ring_pop(r, &d)) {
		CHECK(d.res == 0, "request %lu failed: %s",
		      (unsigned long)d.cookie, strerror(-d.res));
		CHECK(d.bytes == CHUNK, "request %lu moved %zu bytes",
		      (unsigned long)d.cookie, d.bytes);
		CHECK(d.cookie < NCHUNK && !seen[d.cookie],
		      "cookie %lu unknown or twice", (unsigned long)d.cookie);
		seen[d.cookie] = 1;
		n++;
	}
	return n;
}

/* Queue one chunk, waiting for a completion while every slot is taken. */
static void queue_chunk(struct lc_ring *r, int fd, int is_write,
			unsigned char *base, unsigned int k,
			unsigned char *seen)
{
	size_t at = (size_t)k * CHUNK;
	int ret;

	for (;;) {
		ret = lc_ring_queue(r, -1, fd, is_write, base + at, CHUNK, at,
				    k);
		if (ret != -EBUSY)
			break;
		CHECK(r->inflight == DEPTH, "-EBUSY with %u in flight",
		      r->inflight);
		ret = lc_ring_wait(r, 1);
		CHECK(ret == 0, "wait: %s", strerror(-ret));
		CHECK(pop_all(r, seen) >= 1, "wait(1) finished none");
	}
	CHECK(ret >= 0 && ret < DEPTH, "queue: %d", ret);
	if (r->inflight > max_inflight)
		max_inflight = r->inflight;
}

/* All chunks, alternating between the two halves of @base. */
static void transfer_all(struct lc_ring *r, int fd, int is_write,
			 unsigned char *base)
{
	unsigned char seen[NCHUNK] = { 0 };
	unsigned int i, k;
	int ret;

	for (i = 0; i < NCHUNK; i++) {
		k = i / 2 + (i & 1) * (NCHUNK / 2);
		queue_chunk(r, fd, is_write, base, k, seen);
	}
	ret = lc_ring_drain(r);
	CHECK(ret == 0, "drain: %s", strerror(-ret));
	CHECK(r->inflight == 0, "%u in flight after drain", r->inflight);
	pop_all(r, seen);
	for (k = 0; k < NCHUNK; k++)
		CHECK(seen[k], "chunk %u never finished", k);
}

static int open_file(const char *path, int flags, int *direct)
{
	int fd = open(path, flags | O_DIRECT | O_CLOEXEC, 0600);

	*direct = 1;
	if (fd < 0 && errno == EINVAL) { /* e.g. tmpfs */
		*direct = 0;
		fd = open(path, flags | O_CLOEXEC, 0600);
	}
	CHECK(fd >= 0, "open %s: %s", path, strerror(errno));
	return fd;
}

static void test_error_path(struct lc_ring *r, const char *path,
			    unsigned char *src, unsigned char *dst, int fd)
{
	struct lc_done d;
	int rd, bad, ret, direct, got_bad = 0;
	unsigned int n = 0;

	rd = open_file(path, O_RDONLY, &direct);
	/* a good read, a write to a read-only fd, another good read */
	CHECK(lc_ring_queue(r, -1, rd, 0, dst, CHUNK, 0, 100) >= 0, "queue");
	bad = lc_ring_queue(r, -1, rd, 1, src, CHUNK, 0, 101);
	CHECK(bad >= 0, "queue bad: %d", bad);
	CHECK(lc_ring_queue(r, -1, rd, 0, dst + CHUNK, CHUNK, CHUNK, 102) >= 0,
	      "queue");
	ret = lc_ring_drain(r);
	CHECK(ret == -EBADF, "drain returned %d, want -EBADF", ret);
	CHECK(r->err == -EBADF && r->err_slot == bad,
	      "recorded error %d in slot %d, want -EBADF in %d", r->err,
	      r->err_slot, bad);
	CHECK(r->inflight == 0, "%u in flight after a failed drain",
	      r->inflight);
	/* queueing is refused until the error is cleared */
	ret = lc_ring_queue(r, -1, fd, 1, src, CHUNK, 0, 103);
	CHECK(ret == -EBADF, "queue with an error pending: %d", ret);
	while (lc_ring_pop(r, &d)) {
		n++;
		if (d.cookie == 101) {
			CHECK(d.res == -EBADF && d.slot == (unsigned int)bad,
			      "bad write: res %d slot %u", d.res, d.slot);
			got_bad = 1;
		} else {
			CHECK(d.res == 0 || d.res == -ECANCELED,
			      "good read %lu: %d", (unsigned long)d.cookie,
			      d.res);
		}
	}
	CHECK(n == 3 && got_bad, "%u completions", n);
	lc_ring_clear_error(r);

	/* a descriptor that is not open at all */
	bad = dup(rd);
	CHECK(bad >= 0, "dup");
	close(bad);
	CHECK(lc_ring_queue(r, -1, bad, 1, src, CHUNK, 0, 104) >= 0, "queue");
	ret = lc_ring_wait(r, 1);
	CHECK(ret == -EBADF, "closed fd: %d, want -EBADF", ret);
	CHECK(lc_ring_pop(r, &d) == 1 && d.res == -EBADF && d.cookie == 104,
	      "closed fd completion");
	lc_ring_clear_error(r);
	close(rd);

	/* the ring is still usable */
	memset(dst, 0, CHUNK);
	CHECK(lc_ring_queue(r, -1, fd, 1, src + 5 * CHUNK, CHUNK, 5 * CHUNK,
			    1) >= 0, "queue");
	CHECK(lc_ring_drain(r) == 0, "drain");
	CHECK(lc_ring_pop(r, &d) == 1 && d.res == 0 && d.bytes == CHUNK,
	      "rewrite");
	CHECK(lc_ring_queue(r, -1, fd, 0, dst, CHUNK, 5 * CHUNK, 2) >= 0,
	      "queue");
	CHECK(lc_ring_drain(r) == 0, "drain");
	CHECK(lc_ring_pop(r, &d) == 1 && d.res == 0 && d.bytes == CHUNK,
	      "reread");
	CHECK(!memcmp(dst, src + 5 * CHUNK, CHUNK), "reread bytes differ");
	printf("ring: -EBADF surfaced with its slot, ring usable after\n");
}

/* A pipe read gets what is there: the ring resubmits for the rest. */
static void test_short_read(struct lc_ring *r)
{
	char out[200], in[200];
	struct lc_done d;
	int p[2], ret;

	CHECK(pipe(p) == 0, "pipe: %s", strerror(errno));
	memset(in, 'a', 100);
	memset(in + 100, 'b', 100);
	memset(out, 0, sizeof(out));
	CHECK(write(p[1], in, 100) == 100, "pipe write");
	CHECK(lc_ring_queue(r, -1, p[0], 0, out, sizeof(out), 0, 11) >= 0,
	      "queue");
	ret = lc_ring_wait(r, 0); /* submit: 100 bytes come back at once */
	CHECK(ret == 0, "wait: %s", strerror(-ret));
	ret = lc_ring_wait(r, 0); /* reap and resubmit the rest */
	CHECK(ret == 0 && r->inflight == 1, "wait: %d, %u in flight", ret,
	      r->inflight);
	CHECK(write(p[1], in + 100, 100) == 100, "pipe write");
	ret = lc_ring_drain(r);
	CHECK(ret == 0, "drain: %s", strerror(-ret));
	CHECK(lc_ring_pop(r, &d) == 1 && d.res == 0 && d.bytes == sizeof(out),
	      "short read: res %d, %zu bytes", d.res, d.bytes);
	CHECK(!memcmp(in, out, sizeof(out)), "short read bytes");
	close(p[0]);
	close(p[1]);
	printf("ring: short read resubmitted\n");
}

static int test_ring(const char *dir)
{
	struct lc_ring r;
	struct lc_done d;
	struct iovec iov;
	unsigned char *src, *dst;
	char path[4096];
	int fd, ret, direct, slot;
	size_t i;

	ret = lc_ring_init(&r, DEPTH);
	if (ret == -ENOSYS || ret == -EPERM) {
		printf("SKIP: io_uring_setup refused: %s\n", strerror(-ret));
		return EXIT_SKIP;
	}
	CHECK(ret == 0, "lc_ring_init: %s", strerror(-ret));
	CHECK(lc_ring_init(&(struct lc_ring){ 0 }, 0) == -EINVAL, "depth 0");
	CHECK(lc_ring_init(&(struct lc_ring){ 0 }, LC_RING_MAX_DEPTH + 1) ==
		      -EINVAL, "depth too large");

	snprintf(path, sizeof(path), "%s/test_ring.%d.bin", dir, (int)getpid());
	fd = open_file(path, O_RDWR | O_CREAT | O_TRUNC, &direct);
	src = xalloc(TOTAL);
	dst = xalloc(TOTAL);
	for (i = 0; i < TOTAL; i += 8) {
		uint64_t w = rnd();

		memcpy(src + i, &w, 8);
	}

	/* write: the first half registered, the second plain */
	iov.iov_base = src;
	iov.iov_len = TOTAL / 2;
	ret = lc_ring_register_buffers(&r, &iov, 1);
	CHECK(ret == 0 || ret == -ENOMEM || ret == -EPERM,
	      "register: %s", strerror(-ret));
	if (ret == 0) {
		CHECK(r.nregs == 1, "nregs %u", r.nregs);
		slot = lc_ring_queue(&r, -1, fd, 1, src + CHUNK, CHUNK, CHUNK,
				     0);
		CHECK(slot >= 0 && r.reqs[slot].buf_index == 0,
		      "a registered chunk goes unregistered");
		CHECK(lc_ring_queue(&r, slot, fd, 1, src, CHUNK, 0, 0) ==
			      -EBUSY, "a taken slot");
		CHECK(lc_ring_queue(&r, DEPTH, fd, 1, src, CHUNK, 0, 0) ==
			      -EINVAL, "a slot past the depth");
		slot = lc_ring_queue(&r, -1, fd, 1, src + TOTAL / 2 - CHUNK / 2,
				     CHUNK, TOTAL / 2 - CHUNK / 2, 0);
		CHECK(slot >= 0 && r.reqs[slot].buf_index == -1,
		      "a chunk straddling the registered end");
		CHECK(lc_ring_register_buffers(&r, &iov, 1) == -EBUSY,
		      "register with I/O in flight");
		CHECK(lc_ring_drain(&r) == 0, "drain");
		while (lc_ring_pop(&r, &d))
			CHECK(d.res == 0, "%s", strerror(-d.res));
	} else {
		printf("note: buffer registration refused (%s)\n",
		       strerror(-ret));
	}
	/* a zero-length request finishes at once */
	slot = lc_ring_queue(&r, -1, fd, 1, src, 0, 0, 7);
	CHECK(slot >= 0 && r.inflight == 0, "zero-length queue");
	CHECK(lc_ring_pop(&r, &d) == 1 && d.res == 0 && d.bytes == 0 &&
		      d.cookie == 7, "zero-length completion");
	transfer_all(&r, fd, 1, src);
	CHECK(max_inflight == DEPTH, "max in flight %u", max_inflight);

	/* read back: the second half registered this time */
	memset(dst, 0, TOTAL);
	iov.iov_base = dst + TOTAL / 2;
	ret = lc_ring_register_buffers(&r, &iov, 1);
	CHECK(ret == 0 || ret == -ENOMEM || ret == -EPERM,
	      "register: %s", strerror(-ret));
	transfer_all(&r, fd, 0, dst);
	CHECK(!memcmp(src, dst, TOTAL), "read back differs");
	CHECK(lc_ring_unregister_buffers(&r) == 0 && r.nregs == 0,
	      "unregister");

	/* a read across EOF: short, resubmitted, then stops at EOF */
	memset(dst, 0, 2 * CHUNK);
	CHECK(lc_ring_queue(&r, -1, fd, 0, dst, 2 * CHUNK, TOTAL - CHUNK, 9) >=
		      0, "queue");
	CHECK(lc_ring_drain(&r) == 0, "drain");
	CHECK(lc_ring_pop(&r, &d) == 1 && d.res == 0 && d.bytes == CHUNK,
	      "EOF read: res %d, %zu bytes", d.res, d.bytes);
	CHECK(!memcmp(dst, src + TOTAL - CHUNK, CHUNK), "EOF read bytes");
	printf("ring: %zu MiB written and read back at depth %d (%s), "
	       "registered and plain buffers\n",
	       TOTAL >> 20, DEPTH, direct ? "O_DIRECT" : "buffered");

	test_short_read(&r);
	test_error_path(&r, path, src, dst, fd);

	/* exit waits for what is in flight */
	for (i = 0; i < DEPTH; i++)
		CHECK(lc_ring_queue(&r, -1, fd, 0, dst + i * CHUNK, CHUNK,
				    i * CHUNK, i) >= 0, "queue");
	CHECK(lc_ring_wait(&r, 0) == 0, "submit");
	lc_ring_exit(&r);
	CHECK(r.fd == -1 && r.inflight == 0 && r.nregs == 0, "exit state");
	lc_ring_exit(&r);
	CHECK(!memcmp(dst, src, DEPTH * CHUNK), "reads before exit");

	close(fd);
	unlink(path);
	free(src);
	free(dst);
	return 0;
}

int main(int argc, char **argv)
{
	const char *dir = argc > 1 ? argv[1] : getenv("TMPDIR");

	if (!dir || !*dir)
		dir = "/tmp";
	lc_crc32c_init();
	test_crc_vectors();
	test_crc_hw_sw();
	if (test_ring(dir) == EXIT_SKIP)
		return EXIT_SKIP;
	printf("all ok\n");
	return 0;
}
