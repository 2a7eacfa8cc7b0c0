"""This machine's resources as the simulated cluster's: the network namespace and the
simulated hosts (``network``), cgroups (``cgroups``: CPU quotas, memory limits, host CPU
budgets), slow-downs, each member's memory, the traffic model and the link traces
and probes. Imports no other wing of the launcher."""
