/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CRC32C (Castagnoli), continuing from @crc (0 to start): SSE4.2 with three
 * interleaved streams where the CPU has it, else slicing-by-8 tables.
 */
#ifndef LC_CRC32C_H
#define LC_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Build the tables and detect the CPU; call once before the others. */
void lc_crc32c_init(void);

/* 1 if lc_crc32c() uses the hardware instruction. */
int lc_crc32c_have_hw(void);

uint32_t lc_crc32c(uint32_t crc, const void *buf, size_t len);

/* The two paths, for testing; lc_crc32c_hw() only if lc_crc32c_have_hw(). */
uint32_t lc_crc32c_sw(uint32_t crc, const void *buf, size_t len);
uint32_t lc_crc32c_hw(uint32_t crc, const void *buf, size_t len);

#endif /* LC_CRC32C_H */
