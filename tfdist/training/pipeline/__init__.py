"""Model parallelism: a model cut into stages placed on the workers, and its trainer.
Imported only by the entry (training.plan, training.assemble); never by ps or sync.
"""
