/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Raw io_uring system calls (no liburing needed).  Each returns what the
 * kernel returns on success and -errno on failure, as liburing does.
 */
#ifndef LC_SYS_H
#define LC_SYS_H

#include <linux/io_uring.h>

int lc_sys_io_uring_setup(unsigned int entries, struct io_uring_params *p);
int lc_sys_io_uring_enter(int fd, unsigned int to_submit,
			  unsigned int min_complete, unsigned int flags);
int lc_sys_io_uring_register(int fd, unsigned int opcode, const void *arg,
			     unsigned int nr_args);

#endif /* LC_SYS_H */
