/* Bounded-loss codes of fp32 training state (layerckpt.format._qblock): one pass each, the same codes and the
 * same restored values as _qblock's numpy encoders, bit for bit.  Each returns 0, or 1 where its code does not
 * fit the values (a value not finite; for qsq, a negative one), having written nothing the caller may use. */
#ifndef LC_QCODES_H
#define LC_QCODES_H

#include <stddef.h>
#include <stdint.h>

#define LC_QGROUP 2048 /* elements per scale at most, _qblock.GROUP */

/* stats: largest |restored - x|, sum of (restored - x)^2, sum of x^2 */

/* Signed moments: absmax over each group of group elements (an even number, at most LC_QGROUP), bits 8 (int8
 * codes, n bytes) or 4 (code + 7 in nibbles, low first, (n + 1) / 2 bytes); scales: one float per group. */
int lc_qmom(const float *x, size_t n, int bits, size_t group, float *scales, unsigned char *codes, float *restored,
	    double stats[3]);

/* Second moments (non-negative): the bit pattern rounded within each group's [lo, hi] of its non-zero values,
 * code 0 for zero; lohi: two int32 per group; codes as lc_qmom's (bits 8: n bytes, 4: nibbles, no offset). */
int lc_qsq(const float *x, size_t n, int bits, int32_t *lohi, unsigned char *codes, float *restored,
	   double stats[3]);

/* Second moments told against a reference (QSQREF): the code each value of ref takes in the groups' [lo, hi]
 * grid (lohi as lc_qsq's), subtracted from (restore 0) or added to (restore 1) the codes, modulo 2^bits, in
 * place (bits 8: n bytes, 4: nibbles; a pad nibble is left as it is). */
void lc_qsq_told(const float *ref, size_t n, int bits, const int32_t *lohi, unsigned char *codes, int restore);

/* A weight's delta against r: *ss = sum of (x - r)^2 (the differences taken in fp32, summed in double). */
int lc_qdelta_ss(const float *x, const float *r, size_t n, double *ss);

/* Its codes rint((x - r) / step) as int32, restored r + step * code, *top the largest |code|; stats[2]
 * untouched.  Fails where a code's magnitude reaches 2^24. */
int lc_qdelta(const float *x, const float *r, size_t n, float step, int32_t *codes, float *restored,
	      double *top, double stats[3]);

#endif
