"""Engines: what starts the members of a formation and owns their processes.

Open ``api.py`` first: the ``Engine`` contract the attempt loop and the
supervisor drive (start, signal, poll, wait, stop, close, and the engine's
membership view). ``local.py`` starts members as processes of this host;
``ray_engine.py`` as Ray actors.
"""
