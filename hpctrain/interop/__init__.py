"""Interoperability with other frameworks' model formats (no training, MPI or file I/O here)."""
