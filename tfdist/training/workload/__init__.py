"""The user's workload: a task found and checked against Keras's fit contract, and its input pipeline.
The bottom of training: imported by every other part; imports none of them.
"""
