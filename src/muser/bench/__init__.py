"""Benchmarks as commands: harness, comparator runners, receipts."""
