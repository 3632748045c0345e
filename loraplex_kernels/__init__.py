"""Pure tensor ops: Triton kernels for CUDA and the torch implementations the engine uses on CPU."""
