# %% [markdown]
# # tfdist from a notebook
#
# Each `# %%` cell runs as a Jupyter or VS Code cell; the file also runs whole:
# `.venv/bin/python examples/notebook.py` (about a minute and a half on a 2-core CPU
# machine, from a clone's root or any directory). Its runs go to `runs/`
# under the current directory; a rerun into a finished run directory resumes it, so
# each cell's run is short the second time.

# %%
import os

import tfdist
from tfdist import TrainOptions

HERE = os.path.dirname(os.path.abspath(__file__)) if "__file__" in globals() else "examples"
CUSTOM_TASK = os.path.join(HERE, "custom_task.py")  # your own model and data: a file

# %% [markdown]
# ## One process
#
# `strategy="none"` is one process with no distribution strategy (`"mirrored"` would
# take every local GPU). `TrainOptions` holds train.py's flags by their Python names.
# A `Result` holds the run's `results.json` record.

# %%
one = tfdist.fit("mnist-cnn", strategy="none", options=TrainOptions(steps=200, model_dir="runs/one"))
print(one.metrics["accuracy"], one.global_step, one.paths["model"])

# %% [markdown]
# ## The same task on a local cluster
#
# `workers=2` starts 2 worker processes on this machine, each with its own `TF_CONFIG`,
# as `tfdist-launch` does; `multiworker` all-reduces the gradients every step.

# %%
two = tfdist.fit("mnist-cnn", strategy="multiworker", workers=2,
                 options=TrainOptions(steps=200, model_dir="runs/two"))
print([(t.member, t.steps) for t in two.members])

# %% [markdown]
# ## Your own task, asynchronous parameter servers, and a worker killed mid-run
#
# `tfdist.launch` takes the launcher's options as typed groups, the same fields as
# launch.py's flags: here worker:1 is killed once the job reports step 150 or later (its
# progress lines come every `log_every` steps) and restarted (`Recovery`'s
# `restart_tasks`); under `ps` the other worker runs on meanwhile, and no scheduled step
# is lost: a step the killed worker had under way runs again, so `global_step` (the
# updates applied) can end a step or two past `steps`, and results.json counts those
# as `reexecuted_steps`.

# %%
from tfdist import Cluster, Faults, Recovery

ps = tfdist.launch("ps", CUSTOM_TASK, cluster=Cluster(workers=2, ps=1),
                   faults=Faults(kill=("worker:1@step=150",)), recovery=Recovery(restart_tasks=True),
                   options=TrainOptions(steps=300, model_dir="runs/custom-ps-killed"))
print(ps.metrics["accuracy"], ps.global_step, {t.member: t.restarts for t in ps.members})

# %% [markdown]
# ## A mistake is one line
#
# Bad input raises `tfdist.TfdistError` with the line and exit code the command would
# print, before anything starts.

# %%
try:
    tfdist.fit("mnist-cnn", strategy="none", options=TrainOptions(steps=-1, model_dir="runs/bad"))
except tfdist.TfdistError as err:
    print(err, "exit code", err.exit_code)
