"""The simulated cluster behind ``launch.py``: the request's way in at the top, over three wings.

The top: ``config`` (the request, typed; the launch, frozen), ``job`` (a request
checked and run: ``run_request``, ``run_on``), ``checks`` (every member's own
check), ``attempts`` (the attempt loop on any engine), ``supervisor`` (one
attempt's poll loop), ``outcome`` (what the job did), and the shared ``plan``,
``policy``, ``state``, ``membership``, ``files``. The wings, which import the
top's shared modules and never each other: ``engine`` (what starts members:
``api.Engine``, local processes, Ray actors), ``machine`` (namespaces, simulated
hosts and links, cgroups, slow-downs, memory, traffic), ``recovery`` (fault and
restart plans, the injector, the restarter, the elastic plan).

``launch.py`` is the command users run; it only parses flags and calls these.
"""
