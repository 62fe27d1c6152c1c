/* See qcodes.h.  Every value a code restores to is computed as the decoder computes it, from the integer code, in
 * fp32 and never fused (a multiply-add contracted into an FMA would round once where the decoder rounds twice).
 * The loops are written so that the compiler vectorizes them without reassociating any float arithmetic that
 * the codes depend on: rounding to the nearest integer by adding and subtracting 1.5 * 2^23 (exact for
 * |v| < 2^22, ties to even as rint), absolute maxima taken on the bit patterns as integers, and the error
 * statistics (which no restore depends on) summed in eight fp32 lanes per group. */
#pragma GCC optimize("O3", "fp-contract=off", "no-trapping-math")
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
#include "qcodes.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ROUNDER 12582912.0f /* 1.5 * 2^23 */
#define FINITE_MAX 0x7F7FFFFF /* the largest finite fp32 bit pattern */
#define LANES 8
/* On x86-64 Linux with GCC, an AVX2 build of each kernel beside the baseline one, chosen when the module loads
 * (the same IEEE operations either way); elsewhere the baseline build alone. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default"), optimize("O3", "fp-contract=off", "no-trapping-math")))
#else
#define CLONES
#endif

static inline int32_t bits_of(float v)
{
	int32_t p;

	memcpy(&p, &v, 4);
	return p;
}

static inline float float_of(int32_t p)
{
	float v;

	memcpy(&v, &p, 4);
	return v;
}

/* stats over one group: largest |restored - x| (max into st[0]), sums of squares of the errors and of x */
static void group_stats(const float *restored, const float *x, size_t n, double st[3])
{
	float se[LANES] = {0}, sx[LANES] = {0};
	int32_t emax = 0;
	size_t i = 0;
	int k;

	for (; i + LANES <= n; i += LANES) {
		for (k = 0; k < LANES; k++) {
			float e = restored[i + k] - x[i + k];
			int32_t a = bits_of(e) & 0x7FFFFFFF;

			emax = a > emax ? a : emax;
			se[k] += e * e;
			sx[k] += x[i + k] * x[i + k];
		}
	}
	for (; i < n; i++) {
		float e = restored[i] - x[i];
		int32_t a = bits_of(e) & 0x7FFFFFFF;

		emax = a > emax ? a : emax;
		se[0] += e * e;
		sx[0] += x[i] * x[i];
	}
	for (k = 0; k < LANES; k++) {
		st[1] += se[k];
		st[2] += sx[k];
	}
	if ((double)float_of(emax) > st[0])
		st[0] = float_of(emax);
}

/* Two 4-bit codes (0..15) a byte, the first in the low nibble; an odd count's last high nibble 0. */
static void pack_nibbles(const unsigned char *c, size_t n, unsigned char *out)
{
	size_t j;

	for (j = 0; j < n / 2; j++)
		out[j] = (unsigned char)(c[2 * j] | (c[2 * j + 1] << 4));
	if (n & 1)
		out[n / 2] = c[n - 1];
}

CLONES int lc_qmom(const float *x, size_t n, int bits, size_t group, float *scales, unsigned char *codes,
		   float *restored, double stats[3])
{
	const float top = bits == 4 ? 7.0f : 127.0f;
	const int off = bits == 4 ? 7 : 0;
	unsigned char tmp[LC_QGROUP];
	size_t g0, i;

	stats[0] = stats[1] = stats[2] = 0.0;
	for (g0 = 0; g0 < n; g0 += group) {
		const size_t len = g0 + group < n ? group : n - g0;
		const float *xg = x + g0;
		float *rg = restored + g0;
		unsigned char *cg = bits == 4 ? tmp : codes + g0;
		int32_t m = 0;
		float scale, inv;

		for (i = 0; i < len; i++) {
			int32_t a = bits_of(xg[i]) & 0x7FFFFFFF;

			m = a > m ? a : m;
		}
		if (m > FINITE_MAX)
			return 1; /* NaN or inf */
		scale = float_of(m) / top;
		scale = scale >= 1.17549435e-38f ? scale : 0.0f; /* below the least normal: its inverse overflows */
		inv = scale > 0.0f ? 1.0f / scale : 0.0f;
		scales[g0 / group] = scale;
		for (i = 0; i < len; i++) {
			float q = (xg[i] * inv + ROUNDER) - ROUNDER; /* |x * inv| <= 127 (1 + 2^-23) */
			int32_t c;

			q = q > top ? top : q;
			q = q < -top ? -top : q;
			c = (int32_t)q;
			rg[i] = (float)c * scale;
			cg[i] = (unsigned char)(c + off);
		}
		if (bits == 4)
			pack_nibbles(tmp, len, codes + g0 / 2);
		group_stats(rg, xg, len, stats);
	}
	return 0;
}

CLONES int lc_qsq(const float *x, size_t n, int bits, int32_t *lohi, unsigned char *codes, float *restored,
	   double stats[3])
{
	const int32_t last = (1 << bits) - 2; /* the highest code's offset: codes 1 .. last + 1 */
	unsigned char tmp[LC_QGROUP];
	size_t g0, i;

	stats[0] = stats[1] = stats[2] = 0.0;
	for (g0 = 0; g0 < n; g0 += LC_QGROUP) {
		const size_t len = g0 + LC_QGROUP < n ? LC_QGROUP : n - g0;
		const float *xg = x + g0;
		int32_t *rg = (int32_t *)(restored + g0);
		unsigned char *cg = bits == 4 ? tmp : codes + g0;
		int32_t lo, hi = 0, s;
		uint32_t um = UINT32_MAX;
		float fs;

		for (i = 0; i < len; i++) { /* (two loops: one reduction each, as the vectorizer wants them) */
			int32_t p = bits_of(xg[i]), neg = p >> 31;
			/* p where not negative; 0 for -0.0; 0x7FFFFFFF for any other negative value */
			int32_t w = (p & ~neg) | (neg & -(int32_t)((p & 0x7FFFFFFF) != 0) & 0x7FFFFFFF);

			hi = w > hi ? w : hi;
		}
		if (hi > FINITE_MAX)
			return 1; /* negative, NaN or inf */
		for (i = 0; i < len; i++) { /* the least positive pattern, as the least of p - 1 unsigned */
			uint32_t u = (uint32_t)bits_of(xg[i]) - 1u;

			um = u < um ? u : um;
		}
		lo = um < (uint32_t)FINITE_MAX ? (int32_t)(um + 1u) : 0; /* 0: a group of zeros */
		s = (int32_t)(((int64_t)hi - lo + last - 1) / last);
		s = s < 1 ? 1 : s;
		fs = 1.0f / (float)s;
		lohi[2 * (g0 / LC_QGROUP)] = lo;
		lohi[2 * (g0 / LC_QGROUP) + 1] = hi;
		for (i = 0; i < len; i++) {
			int32_t p = bits_of(xg[i]);
			int32_t pp = p > 0 ? p : lo; /* zeros: any code, replaced by 0 below */
			/* floor(a / s), as numpy's exact float64 division: estimated in fp32 (within one of it, the
			 * quotient being at most 255 + 1/2), then corrected on the integers */
			int32_t a = pp - lo + s / 2;
			int32_t c = (int32_t)((float)a * fs);
			int32_t v;

			/* (products below 2^32: s <= 0x7F7FFFFF / last, c + 1 <= last + 2) */
			c = (uint32_t)(c + 1) * (uint32_t)s <= (uint32_t)a ? c + 1 : c;
			c = (uint32_t)c * (uint32_t)s > (uint32_t)a ? c - 1 : c;

			c = c > last ? last : c;
			c = c + 1;
			v = lo + (c - 1) * s; /* at most hi + s / 2 < 2^31 */
			v = v < hi ? v : hi;
			c = p > 0 ? c : 0;
			rg[i] = p > 0 ? v : 0;
			cg[i] = (unsigned char)c;
		}
		if (bits == 4)
			pack_nibbles(tmp, len, codes + g0 / 2);
		group_stats(restored + g0, xg, len, stats);
	}
	return 0;
}

CLONES void lc_qsq_told(const float *ref, size_t n, int bits, const int32_t *lohi, unsigned char *codes,
			int restore)
{
	const int64_t last = (1 << bits) - 2;
	const unsigned mask = (1u << bits) - 1u;
	unsigned char pred[LC_QGROUP];
	size_t g0, i;

	for (g0 = 0; g0 < n; g0 += LC_QGROUP) {
		const size_t len = g0 + LC_QGROUP < n ? LC_QGROUP : n - g0;
		const int64_t lo = lohi[2 * (g0 / LC_QGROUP)], hi = lohi[2 * (g0 / LC_QGROUP) + 1];
		int64_t s = (hi - lo + last - 1) / last;
		double ds;

		s = s < 1 ? 1 : s;
		ds = (double)s;
		for (i = 0; i < len; i++) {
			/* floor(a / s) exactly: |a| < 2^33, so the rounded quotient never reaches the next integer */
			const int64_t p = bits_of(ref[g0 + i]);
			const int64_t a = p - lo + s / 2;
			int64_t q = a < 0 ? 0 : (int64_t)((double)a / ds);

			q = q > last ? last : q;
			pred[i] = p > 0 ? (unsigned char)(q + 1) : 0;
		}
		if (bits == 8) {
			unsigned char *c = codes + g0;

			for (i = 0; i < len; i++)
				c[i] = (unsigned char)((restore ? c[i] + pred[i] : c[i] - pred[i]) & mask);
		} else {
			unsigned char *c = codes + g0 / 2;

			for (i = 0; i + 1 < len; i += 2) {
				unsigned l = c[i / 2] & 15u, h = c[i / 2] >> 4;

				l = (restore ? l + pred[i] : l - pred[i]) & mask;
				h = (restore ? h + pred[i + 1] : h - pred[i + 1]) & mask;
				c[i / 2] = (unsigned char)(l | (h << 4));
			}
			if (len & 1) {
				unsigned l = c[len / 2] & 15u;

				l = (restore ? l + pred[len - 1] : l - pred[len - 1]) & mask;
				c[len / 2] = (unsigned char)((c[len / 2] & 0xF0u) | l);
			}
		}
	}
}

CLONES int lc_qdelta_ss(const float *x, const float *r, size_t n, double *ss)
{
	double acc = 0.0;
	size_t g0;

	for (g0 = 0; g0 < n; g0 += LC_QGROUP) {
		const size_t len = g0 + LC_QGROUP < n ? LC_QGROUP : n - g0;
		float lane[LANES] = {0};
		size_t i = 0;
		int k;

		for (; i + LANES <= len; i += LANES)
			for (k = 0; k < LANES; k++) {
				float d = x[g0 + i + k] - r[g0 + i + k];

				lane[k] += d * d;
			}
		for (; i < len; i++) {
			float d = x[g0 + i] - r[g0 + i];

			acc += (double)d * (double)d;
		}
		for (k = 0; k < LANES; k++)
			acc += lane[k];
	}
	if (!isfinite(acc))
		return 1;
	*ss = acc;
	return 0;
}

/* rint for any fp32 (|v| of 2^22 or more, or not finite): the rare path */
static int qdelta_slow(const float *x, const float *r, size_t n, float step, int32_t *codes, float *restored)
{
	size_t i;

	for (i = 0; i < n; i++) {
		float q = rintf((x[i] - r[i]) / step);

		if (!(fabsf(q) < 16777216.0f))
			return 1;
		codes[i] = (int32_t)q;
		restored[i] = r[i] + (float)codes[i] * step;
	}
	return 0;
}

CLONES int lc_qdelta(const float *x, const float *r, size_t n, float step, int32_t *codes, float *restored,
		    double *top, double stats[3])
{
	int32_t vmax = 0, cmax = 0;
	size_t g0, i;

	stats[0] = stats[1] = stats[2] = 0.0;
	for (g0 = 0; g0 < n; g0 += LC_QGROUP) { /* a group at a time, while it is in the first-level cache */
		const size_t len = g0 + LC_QGROUP < n ? LC_QGROUP : n - g0;
		const float *xg = x + g0, *rg = r + g0;
		int32_t *cg = codes + g0;
		float *og = restored + g0;

		for (i = 0; i < len; i++) {
			float v = (xg[i] - rg[i]) / step;
			int32_t a = bits_of(v) & 0x7FFFFFFF;
			/* |v| of 2^22 or more, or NaN: 0 here, and the rare path redoes the block */
			float w = float_of(bits_of(v) & -(int32_t)(a < 0x4A800000));
			int32_t c = (int32_t)((w + ROUNDER) - ROUNDER);

			vmax = a > vmax ? a : vmax;
			cg[i] = c;
			og[i] = rg[i] + (float)c * step;
		}
		for (i = 0; i < len; i++)
			cmax = abs(cg[i]) > cmax ? abs(cg[i]) : cmax;
		group_stats(og, xg, len, stats);
	}
	if (vmax >= 0x4A800000) { /* 2^22's bit pattern */ /* a code of 2^22 quanta or more, or a value not finite */
		if (qdelta_slow(x, r, n, step, codes, restored))
			return 1;
		cmax = 0;
		for (i = 0; i < n; i++)
			cmax = abs(codes[i]) > cmax ? abs(codes[i]) : cmax;
		stats[0] = stats[1] = stats[2] = 0.0;
		for (g0 = 0; g0 < n; g0 += LC_QGROUP)
			group_stats(restored + g0, x + g0, g0 + LC_QGROUP < n ? LC_QGROUP : n - g0, stats);
	}
	*top = cmax;
	return 0;
}
