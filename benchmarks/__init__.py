"""Benchmarks and drills, run as scripts (`python benchmarks/NAME.py`); a package so one may reuse another."""
