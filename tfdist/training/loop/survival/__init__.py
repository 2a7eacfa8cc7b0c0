"""Surviving faults: the faults named and classified (``recovery``), the errors that mean a
lost member (``lost``), and checkpoints to resume from (``checkpoints``)."""
