/* C math kernels of the software NeuronCore: shared declarations for the cffi module and the Cython engine. */
#ifndef TN_KERNELS_H
#define TN_KERNELS_H
#include <stdint.h>
#include <stddef.h>

/* Version of the kernel ABI; bumped whenever a signature below changes. */
int tn_abi_version(void);

#endif
