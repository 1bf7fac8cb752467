"""``pdserve bench plan-sim``: the SLA planner (common/planner) in the loop of a
discrete-event model of an engine fleet, against every fixed split. README.md beside this
file: the model, the commands and the figures.

Files, in the order a request meets them: ``workload`` (what arrives), ``routing`` (the
gateway's rules), ``worker`` (an engine's steps), ``cluster`` (the fleet, KV transfers,
role changes), ``observe`` (the windows the planner reads), ``run`` (one run and its
result), ``report`` (fixed splits against the planner), ``cli``.
"""

# Light names the command line offers before anything heavy is imported.
WORKLOADS = ("shift", "mooncake", "rate-step")
PROFILE_NAMES = ("cpu", "gpu")
