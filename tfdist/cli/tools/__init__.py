"""The project's ``python -m`` tools beside its three commands: the benchmark's studies
(soak, link table, trace study, overlap, XLA) and the launcher's machine tools (hosts,
traffic, MNIST's preparation); each flags → one frozen config → the library call."""
