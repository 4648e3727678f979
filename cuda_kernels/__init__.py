"""spectrio.cuda_kernels: CUDA sources, the CuPy loader and NumPy references."""
