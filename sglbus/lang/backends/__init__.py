"""Backends: where a program's model calls go (an HTTP server, the in-process Engine)."""
