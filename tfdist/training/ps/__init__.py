"""Parameter servers: the async (ps) and synchronous (ps-sync) trainers, the coordinator
wrapper, the ps-side RPCs and watchdog. Imported only by the entry (training.assemble); never by sync or pipeline.
"""
