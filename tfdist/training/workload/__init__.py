"""The user's workload: a task found and checked against Keras's fit contract, and its input pipeline.
The bottom of training: imported by every other part; imports none of them.
"""

# The order the input pipeline (``data``) gives a seed, recorded in run.json
# (``RunPlan.defining_flags``): a run directory written with another order is
# not resumed, since its remaining epochs would follow another permutation.
# Here, not in ``data``, so the plan reads it without importing TensorFlow.
DATA_ORDER = 2
