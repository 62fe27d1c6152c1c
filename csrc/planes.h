/* Byte planes and zigzag deltas of fixed-width elements: the inner loops of layerckpt's encoding. */
#ifndef LC_PLANES_H
#define LC_PLANES_H

#include <stddef.h>

/* out (n bytes, plane-major: byte k of element i at out[k * (n / es) + i]) from raw, or from the zigzag-mapped
 * wrapping difference raw - ref where ref is not NULL.  Returns nonzero if any output byte is nonzero. */
int lc_planes(const unsigned char *raw, const unsigned char *ref, unsigned char *out, size_t n, int es);

/* The inverse: out (element-major) from planes; with add, out held the reference and gets the delta added. */
void lc_unplanes(const unsigned char *planes, unsigned char *out, size_t n, int es, int add);

#endif
