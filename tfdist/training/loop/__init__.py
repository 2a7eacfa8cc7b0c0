"""The strategy-independent loop: the controller, the trainer contract, schedule,
step, state, checkpoints, evaluation, callbacks, reporting, export and failure kinds.
Imported by the strategy sub-packages (sync, ps, pipeline) and the entry (run); imports none of them.
"""
