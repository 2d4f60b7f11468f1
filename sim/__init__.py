"""The scheduling simulator (`kvtier simulate`): a discrete-event replay of a trace through the same scheduling
policy objects vLLM's hook runs, with an SSD model, replicas sharing a remote tier, a GPU cost model and a synthetic
workload generator. Not production code: nothing in connector, storage_backends or scheduler_hooks imports it."""
