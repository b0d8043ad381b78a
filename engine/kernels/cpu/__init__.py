"""CPU kernels in C, compiled on first use with the machine's C compiler and called through
ctypes (no build step at install time, no extension toolchain beyond ``cc``)."""
