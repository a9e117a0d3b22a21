"""Trace-driven simulation of verification policies: exact for greedy decoding, timed by a cost model."""
