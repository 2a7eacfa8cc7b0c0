"""The simulated cluster behind ``launch.py``, one concern per module.

- ``plan``: pure: the tasks, their hosts, addresses and ports, from the strategy kind;
- ``network``: the private network namespace, simulated hosts on a bridge, shaped links;
- ``processes``: start and stop task processes, their output, core pinning;
- ``faults``: kill, preempt, slow, restart, relaunch;
- ``supervisor``: the job's typed state, the poll loop, the outcome.

``launch.py`` is the command users run; it only parses flags and calls these.
"""
