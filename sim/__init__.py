"""The scheduling simulator (`kvtier simulate`): a discrete-event replay of a trace through the same scheduling
policy objects vLLM's hook runs, with an SSD model, replicas sharing a remote tier, a GPU cost model and a synthetic
workload generator. Not production code: nothing in connector, storage_backends or scheduler_hooks imports it.

Modules, each importing only those listed before it (no cycle):
- `cost_model`: GPU and transfer times, tier capacities (`CostProfile`, the profiles).
- `ssd`: the simulated SSD, one device shared by reads and write-back.
- `base`: the shared types (`SimRequest`, `SimConfig`, `SimResult`, `GpuJob`), the shared-tier plug-in point
  (`SharedTierView`) and the trace reader (`load_trace`).
- `tiers`, `gpu`: `Simulator`'s methods for the tiers and hints, and for admission and the GPU jobs.
- `engine`: `Simulator` (state, event loop, arrivals and prefetches, result), `simulate`, `calibrate_time_scale`.
- `remote`: replicas on one clock sharing one store (`Cluster`, `run_cluster`).
- `report`: the tables and the plot.
- `simulate`: the `kvtier simulate` command (`add_arguments`, `run`).
- `workloads`: synthetic traces (`kvtier workload`).
"""
