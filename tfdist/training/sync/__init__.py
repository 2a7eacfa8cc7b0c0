"""Synchronous data parallelism (none, mirrored, multiworker): its trainer and preemption handling.
Imported only by the entry (training.assemble); never imports ps or pipeline.
"""
