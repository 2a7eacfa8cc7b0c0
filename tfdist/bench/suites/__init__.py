"""The benchmark's two suites: the default (every strategy against a no-strategy baseline) and the
scenarios (which strategy when), with the scenarios' studies (scaling, sparse, model-parallel)."""
