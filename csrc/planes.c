/* See planes.h.  Little-endian elements of 1, 2, 4 or 8 bytes.  On x86-64 the 2- and 4-byte cases (bf16 and
 * fp16, fp32: nearly every tensor encoded) go 16 elements at a time through SSE2, which every x86-64 CPU has:
 * the zigzag delta in 32- or 16-bit lanes, then a byte transpose by unpacks (4-byte elements) or packs
 * (2-byte ones).  The rest, and the tails, go through the portable loops. */
#pragma GCC optimize("O3")
#include "planes.h"

#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

static inline uint64_t load(const unsigned char *p, int es)
{
	uint64_t v = 0;

	memcpy(&v, p, (size_t)es);
	return v;
}

/* Elements [i0, m) of n / es, one at a time: the tails of the vector loops, and the sizes they do not take. */
static int planes_tail(const unsigned char *raw, const unsigned char *ref, unsigned char *out, size_t m, size_t i0,
		       const int es)
{
	const int bits = 8 * es;
	const uint64_t mask = bits == 64 ? ~(uint64_t)0 : (((uint64_t)1 << bits) - 1);
	uint64_t any = 0;
	size_t i;
	int k;

	for (i = i0; i < m; i++) {
		uint64_t z = load(raw + i * es, es);

		if (ref) {
			uint64_t d = (z - load(ref + i * es, es)) & mask;

			z = ((d << 1) ^ (0 - ((d >> (bits - 1)) & 1))) & mask;
		}
		any |= z;
		for (k = 0; k < es; k++)
			out[(size_t)k * m + i] = (unsigned char)(z >> (8 * k));
	}
	return any != 0;
}

static void unplanes_tail(const unsigned char *planes, unsigned char *out, size_t m, size_t i0, const int es, int add)
{
	const int bits = 8 * es;
	const uint64_t mask = bits == 64 ? ~(uint64_t)0 : (((uint64_t)1 << bits) - 1);
	size_t i;
	int k;

	for (i = i0; i < m; i++) {
		uint64_t z = 0;

		for (k = 0; k < es; k++)
			z |= (uint64_t)planes[(size_t)k * m + i] << (8 * k);
		if (add) {
			uint64_t d = ((z >> 1) ^ (0 - (z & 1))) & mask;

			z = (load(out + i * es, es) + d) & mask;
		}
		memcpy(out + i * es, &z, (size_t)es);
	}
}

/* 1-byte elements: one plane; plain loops the compiler vectorizes */
static int planes1(const unsigned char *raw, const unsigned char *ref, unsigned char *out, size_t n)
{
	unsigned char any = 0;
	size_t i;

	if (!ref) {
		memcpy(out, raw, n);
		for (i = 0; i < n; i++)
			any |= raw[i];
		return any != 0;
	}
	for (i = 0; i < n; i++) {
		unsigned char d = (unsigned char)(raw[i] - ref[i]);

		out[i] = (unsigned char)((unsigned char)(d << 1) ^ (unsigned char)(0 - (d >> 7)));
		any |= out[i];
	}
	return any != 0;
}

static void unplanes1(const unsigned char *planes, unsigned char *out, size_t n, int add)
{
	size_t i;

	if (!add) {
		memcpy(out, planes, n);
		return;
	}
	for (i = 0; i < n; i++) {
		unsigned char z = planes[i];

		out[i] = (unsigned char)(out[i] + (unsigned char)((z >> 1) ^ (unsigned char)(0 - (z & 1))));
	}
}

#ifdef __SSE2__
#define LD(p) _mm_loadu_si128((const __m128i *)(p))
#define ST(p, v) _mm_storeu_si128((__m128i *)(p), (v))

/* One round of byte interleaves over four registers, in place: (v0 v1) and (v2 v3) each unpacked low and high. */
static inline void interleave8(__m128i v[4])
{
	__m128i t0 = _mm_unpacklo_epi8(v[0], v[1]), t1 = _mm_unpackhi_epi8(v[0], v[1]);
	__m128i t2 = _mm_unpacklo_epi8(v[2], v[3]), t3 = _mm_unpackhi_epi8(v[2], v[3]);

	v[0] = t0;
	v[1] = t1;
	v[2] = t2;
	v[3] = t3;
}

static int planes4(const unsigned char *raw, const unsigned char *ref, unsigned char *out, size_t m)
{
	__m128i any = _mm_setzero_si128();
	size_t i;
	int j;

	for (i = 0; i + 16 <= m; i += 16) {
		__m128i v[4];

		for (j = 0; j < 4; j++) {
			v[j] = LD(raw + 4 * i + 16 * j);
			if (ref) {
				v[j] = _mm_sub_epi32(v[j], LD(ref + 4 * i + 16 * j));
				v[j] = _mm_xor_si128(_mm_slli_epi32(v[j], 1), _mm_srai_epi32(v[j], 31));
			}
			any = _mm_or_si128(any, v[j]);
		}
		/* three rounds of byte interleaves and one of 64-bit halves: 16 elements x 4 bytes -> 4 planes x 16 */
		interleave8(v);
		interleave8(v);
		interleave8(v);
		ST(out + i, _mm_unpacklo_epi64(v[0], v[2]));
		ST(out + m + i, _mm_unpackhi_epi64(v[0], v[2]));
		ST(out + 2 * m + i, _mm_unpacklo_epi64(v[1], v[3]));
		ST(out + 3 * m + i, _mm_unpackhi_epi64(v[1], v[3]));
	}
	any = _mm_or_si128(any, _mm_srli_si128(any, 8));
	any = _mm_or_si128(any, _mm_srli_si128(any, 4));
	return (_mm_cvtsi128_si32(any) != 0) | planes_tail(raw, ref, out, m, i, 4);
}

static int planes2(const unsigned char *raw, const unsigned char *ref, unsigned char *out, size_t m)
{
	const __m128i lo = _mm_set1_epi16(0xff);
	__m128i any = _mm_setzero_si128();
	size_t i;

	for (i = 0; i + 16 <= m; i += 16) {
		const unsigned char *r = raw + 2 * i;
		__m128i a = LD(r), b = LD(r + 16);

		if (ref) {
			a = _mm_sub_epi16(a, LD(ref + 2 * i));
			b = _mm_sub_epi16(b, LD(ref + 2 * i + 16));
			a = _mm_xor_si128(_mm_slli_epi16(a, 1), _mm_srai_epi16(a, 15));
			b = _mm_xor_si128(_mm_slli_epi16(b, 1), _mm_srai_epi16(b, 15));
		}
		any = _mm_or_si128(any, _mm_or_si128(a, b));
		ST(out + i, _mm_packus_epi16(_mm_and_si128(a, lo), _mm_and_si128(b, lo)));
		ST(out + m + i, _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
	}
	any = _mm_or_si128(any, _mm_srli_si128(any, 8));
	any = _mm_or_si128(any, _mm_srli_si128(any, 4));
	return (_mm_cvtsi128_si32(any) != 0) | planes_tail(raw, ref, out, m, i, 2);
}

/* zigzag's inverse in 32- or 16-bit lanes: (z >> 1) ^ -(z & 1) */
#define UNZIG32(z) _mm_xor_si128(_mm_srli_epi32(z, 1), _mm_sub_epi32(zero, _mm_and_si128(z, one32)))
#define UNZIG16(z) _mm_xor_si128(_mm_srli_epi16(z, 1), _mm_sub_epi16(zero, _mm_and_si128(z, one16)))

static void unplanes4(const unsigned char *planes, unsigned char *out, size_t m, int add)
{
	const __m128i zero = _mm_setzero_si128(), one32 = _mm_set1_epi32(1);
	size_t i;

	for (i = 0; i + 16 <= m; i += 16) {
		__m128i p0 = LD(planes + i), p1 = LD(planes + m + i), p2 = LD(planes + 2 * m + i),
			p3 = LD(planes + 3 * m + i);
		__m128i v0 = _mm_unpacklo_epi8(p0, p1), v1 = _mm_unpackhi_epi8(p0, p1);
		__m128i v2 = _mm_unpacklo_epi8(p2, p3), v3 = _mm_unpackhi_epi8(p2, p3);
		__m128i e[4];
		int j;

		e[0] = _mm_unpacklo_epi16(v0, v2);
		e[1] = _mm_unpackhi_epi16(v0, v2);
		e[2] = _mm_unpacklo_epi16(v1, v3);
		e[3] = _mm_unpackhi_epi16(v1, v3);
		for (j = 0; j < 4; j++) {
			unsigned char *o = out + 4 * i + 16 * j;

			ST(o, add ? _mm_add_epi32(LD(o), UNZIG32(e[j])) : e[j]);
		}
	}
	unplanes_tail(planes, out, m, i, 4, add);
}

static void unplanes2(const unsigned char *planes, unsigned char *out, size_t m, int add)
{
	const __m128i zero = _mm_setzero_si128(), one16 = _mm_set1_epi16(1);
	size_t i;

	for (i = 0; i + 16 <= m; i += 16) {
		__m128i p0 = LD(planes + i), p1 = LD(planes + m + i);
		__m128i e[2] = {_mm_unpacklo_epi8(p0, p1), _mm_unpackhi_epi8(p0, p1)};
		int j;

		for (j = 0; j < 2; j++) {
			unsigned char *o = out + 2 * i + 16 * j;

			ST(o, add ? _mm_add_epi16(LD(o), UNZIG16(e[j])) : e[j]);
		}
	}
	unplanes_tail(planes, out, m, i, 2, add);
}
#endif

int lc_planes(const unsigned char *raw, const unsigned char *ref, unsigned char *out, size_t n, int es)
{
	const size_t m = n / (size_t)es;

	switch (es) {
#ifdef __SSE2__
	case 2: return planes2(raw, ref, out, m);
	case 4: return planes4(raw, ref, out, m);
#else
	case 2: return planes_tail(raw, ref, out, m, 0, 2);
	case 4: return planes_tail(raw, ref, out, m, 0, 4);
#endif
	case 1: return planes1(raw, ref, out, n);
	default: return planes_tail(raw, ref, out, m, 0, 8);
	}
}

void lc_unplanes(const unsigned char *planes, unsigned char *out, size_t n, int es, int add)
{
	const size_t m = n / (size_t)es;

	switch (es) {
#ifdef __SSE2__
	case 2: unplanes2(planes, out, m, add); break;
	case 4: unplanes4(planes, out, m, add); break;
#else
	case 2: unplanes_tail(planes, out, m, 0, 2, add); break;
	case 4: unplanes_tail(planes, out, m, 0, 4, add); break;
#endif
	case 1: unplanes1(planes, out, n, add); break;
	default: unplanes_tail(planes, out, m, 0, 8, add); break;
	}
}
