// SPDX-License-Identifier: Apache-2.0
#include "crc32c.h"

#include <string.h>

#define POLY 0x82F63B78U /* reflected Castagnoli polynomial */

static uint32_t crc_table[8][256];
static int use_hw;

static void crc_init_tables(void)
{
	uint32_t i, j, c;

	for (i = 0; i < 256; i++) {
		c = i;
		for (j = 0; j < 8; j++)
			c = (c >> 1) ^ (POLY & (0U - (c & 1)));
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

void lc_crc32c_init(void)
{
	crc_init_tables();
#if HAVE_HW_CRC
	crc_init_shift();
	__builtin_cpu_init();
	use_hw = !!__builtin_cpu_supports("sse4.2");
#endif
}

int lc_crc32c_have_hw(void)
{
	return use_hw;
}

uint32_t lc_crc32c_sw(uint32_t crc, const void *buf, size_t len)
{
	return ~crc_sw(~crc, buf, len);
}

uint32_t lc_crc32c_hw(uint32_t crc, const void *buf, size_t len)
{
#if HAVE_HW_CRC
	return ~crc_hw(~crc, buf, len);
#else
	return lc_crc32c_sw(crc, buf, len);
#endif
}

uint32_t lc_crc32c(uint32_t crc, const void *buf, size_t len)
{
	return use_hw ? lc_crc32c_hw(crc, buf, len) :
			lc_crc32c_sw(crc, buf, len);
}
