"""`lockstep bench`: the served group against the in-process engine, on one model and one workload.

Two runs with the same prompts, output length, concurrency and TP size:

- served (`served.py`): `lockstep rank` processes and `lockstep coordinator`, driven through
  `POST /v1/completions` by `concurrency` client threads, each sending its next request when its last
  one is answered;
- in-process (`in_process.py`): the same pure Scheduler driving a LocalGroup of the same ranks
  directly (plan -> step -> apply, no gRPC, no HTTP, no asyncio), with the same concurrency limit.
  This is the limit without the control plane, so the ratio of the two throughputs is what the
  control plane costs.

Per step both record the step's wall time, the slowest rank's engine time, and the coordinator's own
time: plan + apply in-process; plan + serialize/send + apply in the served run, read from the
coordinator's step log (`GET /admin/steps`, the agreement wait excluded). `report.py` turns the raw
measurements into the table; `command.py` is the command line; `tiny_model.py` builds the model
that `--tiny` runs.

    lockstep bench --tiny --requests 64 --concurrency 16 --max-tokens 32 --json bench.json
"""
