"""The benchmark's suites: the default (every strategy against a no-strategy baseline), the
evaluation (the shared final evaluation against the chief alone) and the
scenarios (which strategy when), with the scenarios' studies (scaling, sparse, model-parallel)."""
