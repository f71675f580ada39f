"""Harnesses for ettr's tests and benchmarks (toy job, SIGKILL trials, spawn helper, fakes); not for training code."""
