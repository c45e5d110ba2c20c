"""Small C++ kernels built with the machine's compiler on first use and loaded through ctypes (standard library
only: the store and the worker kernels both use it, and it imports nothing of the project)."""
