/* See planes.h.  One pass over the bytes; little-endian elements of 1, 2, 4 or 8 bytes. */
#pragma GCC optimize("O3")
#include "planes.h"

#include <stdint.h>
#include <string.h>

static inline uint64_t load(const unsigned char *p, int es)
{
	uint64_t v = 0;

	memcpy(&v, p, (size_t)es);
	return v;
}

static inline int planes_es(const unsigned char *raw, const unsigned char *ref, unsigned char *out, size_t n,
			    const int es)
{
	const size_t m = n / (size_t)es;
	const int bits = 8 * es;
	const uint64_t mask = bits == 64 ? ~(uint64_t)0 : (((uint64_t)1 << bits) - 1);
	uint64_t any = 0;
	size_t i;
	int k;

	for (i = 0; i < m; i++) {
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

int lc_planes(const unsigned char *raw, const unsigned char *ref, unsigned char *out, size_t n, int es)
{
	switch (es) {
	case 1: return planes_es(raw, ref, out, n, 1);
	case 2: return planes_es(raw, ref, out, n, 2);
	case 4: return planes_es(raw, ref, out, n, 4);
	default: return planes_es(raw, ref, out, n, 8);
	}
}

static inline void unplanes_es(const unsigned char *planes, unsigned char *out, size_t n, const int es, int add)
{
	const size_t m = n / (size_t)es;
	const int bits = 8 * es;
	const uint64_t mask = bits == 64 ? ~(uint64_t)0 : (((uint64_t)1 << bits) - 1);
	size_t i;
	int k;

	for (i = 0; i < m; i++) {
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

void lc_unplanes(const unsigned char *planes, unsigned char *out, size_t n, int es, int add)
{
	switch (es) {
	case 1: unplanes_es(planes, out, n, 1, add); break;
	case 2: unplanes_es(planes, out, n, 2, add); break;
	case 4: unplanes_es(planes, out, n, 4, add); break;
	default: unplanes_es(planes, out, n, 8, add); break;
	}
}
