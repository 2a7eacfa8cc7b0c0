"""Faults and recovery: the fault and restart flags checked into a plan (``faults``), the
hooks that fire faults (``injector``) and restart members (``restarter``), and the
elastic plan and its batch arithmetic (``elastic``). Imports no other wing of the
launcher."""
