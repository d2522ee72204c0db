"""Readable numpy references that the native kernels and the model are tested against."""
