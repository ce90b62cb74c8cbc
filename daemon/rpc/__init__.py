"""Serving one model across devices with llama.cpp's RPC backend: workers, placement, endpoints, faults."""
