"""The link studies: each kind against its link's limit (``table``), a run's link trace as a table
(``trace_study``) and the all-reduce's overlap with the backward pass (``overlap``)."""
