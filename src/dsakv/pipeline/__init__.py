"""Pipeline parallelism shared by every role: the stage group (stage_comm), the stage-0 runner the Engine steps
through (runner), the layer split and batch codec (batch), the page mirror of a follower stage (page_mirror).
Imports util, spec, plan, cache, model and engine only."""
