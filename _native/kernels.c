/* C math kernels of the software NeuronCore (see kernels.h). */
#include "kernels.h"

int tn_abi_version(void) { return 1; }
