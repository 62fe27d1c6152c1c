// SPDX-License-Identifier: Apache-2.0
#include "sys.h"

#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline int ret_or_errno(long ret)
{
	return ret < 0 ? -errno : (int)ret;
}

int lc_sys_io_uring_setup(unsigned int entries, struct io_uring_params *p)
{
	return ret_or_errno(syscall(__NR_io_uring_setup, entries, p));
}

int lc_sys_io_uring_enter(int fd, unsigned int to_submit,
			  unsigned int min_complete, unsigned int flags)
{
	return ret_or_errno(syscall(__NR_io_uring_enter, fd, to_submit,
				    min_complete, flags, NULL, 0));
}

int lc_sys_io_uring_register(int fd, unsigned int opcode, const void *arg,
			     unsigned int nr_args)
{
	return ret_or_errno(syscall(__NR_io_uring_register, fd, opcode, arg,
				    nr_args));
}
